"""The step's products (`models/linears.py`): a weight prepared once (packed for oneDNN on the
CPU) multiplies like torch's own `linear` at every count of rows and dtype, including one
float32 row, which takes the weight as it is (a matrix-vector product beats the packed
layout there)."""

from __future__ import annotations

import pytest

from batchserve.models.linears import Products

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 2, 16, 33])
def test_a_prepared_weight_multiplies_as_linear_does(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    kind = getattr(torch, dtype)
    weight = torch.randn(96, 64, generator=gen).to(kind)
    bias = torch.randn(96, generator=gen).to(kind)
    x = torch.randn(rows, 64, generator=gen).to(kind)
    products = Products(torch, "cpu")
    prepared = products.prepare(weight)
    assert prepared.plain is weight
    assert (prepared.packed is not None) == products.packed
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    got = products(x, prepared, bias)
    assert got.dtype == kind
    tolerance = 1e-4 if dtype == "float32" else 0.3
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=1e-2)
