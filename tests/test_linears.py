"""The step's products (`models/linears.py`): a weight prepared once (packed for oneDNN on the
CPU) multiplies like torch's own `linear` at every count of rows and dtype, including one
float32 row, which takes whichever of the weight as it is (a matrix-vector product by the
BLAS) and the packed layout was timed faster through all the weights once they were
prepared."""

from __future__ import annotations

import pytest

from batchserve.models.linears import ROW_TRIALS, PackedForward, Products, pack_linears

torch = pytest.importorskip("torch")


class Stopwatch:
    """A clock that moves only when a product runs, by the cost given to its path; it counts
    the products of each path too."""

    def __init__(self, *, plain: float, packed: float) -> None:
        self.now = 0.0
        self.costs = {"plain": plain, "packed": packed}
        self.calls = {"plain": 0, "packed": 0}

    def __call__(self) -> float:
        return self.now

    def watch(self, products: Products) -> Products:
        """`products` with each path's product moving this clock."""

        def timed(path: str, product):
            def run(*args):
                self.now += self.costs[path]
                self.calls[path] += 1
                return product(*args)

            return run

        products._linear = timed("plain", products._linear)
        if products.packed:
            products._packed_linear = timed("packed", products._packed_linear)
        return products


@pytest.mark.parametrize("plain_row", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 2, 16, 33])
def test_a_prepared_weight_multiplies_as_linear_does(dtype, rows, plain_row):
    gen = torch.Generator().manual_seed(rows)
    kind = getattr(torch, dtype)
    weight = torch.randn(96, 64, generator=gen).to(kind)
    bias = torch.randn(96, generator=gen).to(kind)
    x = torch.randn(rows, 64, generator=gen).to(kind)
    products = Products(torch, "cpu")
    products.plain_row = plain_row
    prepared = products.prepare(weight)
    assert prepared.plain is weight
    assert (prepared.packed is not None) == products.packed
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    got = products(x, prepared, bias)
    assert got.dtype == kind
    tolerance = 1e-4 if dtype == "float32" else 0.3
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=1e-2)


@pytest.mark.parametrize("plain_faster", [True, False])
def test_one_float32_row_takes_the_way_timed_faster_through_all_the_weights(plain_faster):
    watch = Stopwatch(plain=1.0 if plain_faster else 3.0, packed=2.0)
    products = watch.watch(Products(torch, "cpu", clock=watch))
    if not products.packed:
        pytest.skip("torch without oneDNN: every weight is plain")
    weights = [products.prepare(torch.randn(96, 64)), products.prepare(torch.randn(32, 96))]
    bf16 = products.prepare(torch.randn(8, 64).to(torch.bfloat16))  # always packed: not timed
    products.choose_row_path([*weights, bf16])
    assert products.plain_row == plain_faster
    assert watch.calls == {"plain": 2 * ROW_TRIALS, "packed": 2 * ROW_TRIALS}
    before = dict(watch.calls)
    products(torch.randn(1, 64), weights[0])
    products(torch.randn(2, 64), weights[0])  # more rows: always the packed layout
    products(torch.randn(1, 64).to(torch.bfloat16), bf16)  # bf16: always packed
    taken = {path: watch.calls[path] - before[path] for path in before}
    assert taken == ({"plain": 1, "packed": 2} if plain_faster else {"plain": 0, "packed": 3})


def test_the_one_row_timing_stops_at_its_budget_of_bytes():
    watch = Stopwatch(plain=1.0, packed=2.0)
    products = watch.watch(Products(torch, "cpu", clock=watch))
    if not products.packed:
        pytest.skip("torch without oneDNN: every weight is plain")
    weights = [products.prepare(torch.randn(96, 64)) for _ in range(3)]
    products.choose_row_path(weights, budget_bytes=96 * 64 * 4 + 1)  # past the first weight
    assert watch.calls == {"plain": 2 * ROW_TRIALS, "packed": 2 * ROW_TRIALS}


def test_an_encoders_linears_packed_give_its_outputs():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=2,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config).eval()
    ids = torch.randint(5, 500, (3, 17))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    products = Products(torch, "cpu")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert pack_linears(torch, model, products) == (len(linears) if products.packed else 0)
    with torch.inference_mode():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if products.packed:
        assert all(isinstance(m.forward, PackedForward) for m in linears)
