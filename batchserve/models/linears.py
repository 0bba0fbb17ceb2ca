"""The step's matrix products: each layer's projections fused, and on the CPU prepacked.

q, k and v are one matrix and the MLP's gate and up another: four products a layer instead
of seven, which a small batch runs nearer the device's peak. The layer's own weights
become views into the fused ones, so transformers' own forward (and `generate`) still runs on
the same model.

On the CPU, where torch has oneDNN, every weight the step multiplies by is also kept
reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`): a plain
`linear` repacks the weight on every call, which at a decode step's few rows costs as much as
the product. Measured here on one core at 16 rows: SmolLM2's LM head 33 ms to 14 ms, an MLP's
gate and up 0.89 to 0.59 ms. The price is a second copy of those weights in memory.

One row of float32 (a lone stream's decode) is the exception that depends on the machine:
there torch's plain `linear` is a matrix-vector product by its BLAS (MKL), which beat the
blocked layout on an Intel Xeon (SmolLM2's step 7-10 % faster) and lost to it by 1.8x on an
AMD EPYC, where MKL does not take its AVX-512 code unless the launcher lets it
(models/mkl_paths.py). So once the model is loaded, one row is timed through its weights
both ways (`choose_row_path`: the first 256 MiB of them, past any cache), and one float32
row takes the faster from then on.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ROWS_HINT = 16
"""The batch size oneDNN lays a packed weight out for; any other count of rows works."""
ROW_TRIALS = 3
"""Passes of one row through the weights each way; the best of each counts."""
ROW_TIMING_BYTES = 256 << 20
"""The one-row choice times the first weights up to about this many bytes: far more than any
cache holds, so each comes from memory as in a step, while a model of many GB is not read
six more times at every load."""


class Products:
    """Multiplies by weights prepared for this device: packed for oneDNN on the CPU, else as
    they are."""

    def __init__(
        self, torch: Any, device: str, *, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._torch = torch
        self.packed = device == "cpu" and bool(torch.backends.mkldnn.is_available())
        self._linear = torch.nn.functional.linear
        self._clock = clock
        self.plain_row = False
        """Whether one float32 row multiplies by the weight as it is (`choose_row_path`)."""
        if self.packed:
            self._pack = torch.ops.mkldnn._reorder_linear_weight
            self._packed_linear = torch.ops.mkldnn._linear_pointwise

    def __repr__(self) -> str:
        return f"<Products packed={self.packed}>"

    def prepare(self, weight: Any) -> Prepared:
        """The weight as `__call__` takes it."""
        if self.packed and weight.dtype in (self._torch.float32, self._torch.bfloat16):
            return Prepared(weight, self._pack(weight.detach(), ROWS_HINT))
        return Prepared(weight, None)

    def __call__(self, x: Any, weight: Prepared, bias: Any = None) -> Any:
        packed = weight.packed
        if packed is not None and (
            x.shape[0] > 1 or x.dtype != self._torch.float32 or not self.plain_row
        ):
            return self._packed_linear(x, packed, bias, "none", [None], "")
        return self._linear(x, weight.plain, bias)

    def choose_row_path(
        self, weights: Sequence[Prepared], budget_bytes: int = ROW_TIMING_BYTES
    ) -> None:
        """Time one float32 row through the first of `weights` (a step's products, in its
        order) up to `budget_bytes`, each read from memory as in a step (a weight timed alone
        stays hot in a cache), by each way, and keep the faster for one row from now on."""
        timed, size = [], 0
        for weight in weights:
            if weight.packed is None or weight.plain.dtype != self._torch.float32:
                continue
            timed.append(weight)
            size += weight.plain.numel() * weight.plain.element_size()
            if size >= budget_bytes:
                break
        if not timed:
            return
        rows = {int(w.plain.shape[1]): self._torch.randn(1, w.plain.shape[1]) for w in timed}
        best = {True: math.inf, False: math.inf}
        with self._torch.no_grad():
            for _ in range(ROW_TRIALS):
                for plain in best:
                    self.plain_row = plain
                    start = self._clock()
                    for weight in timed:
                        self(rows[int(weight.plain.shape[1])], weight)
                    best[plain] = min(best[plain], self._clock() - start)
        self.plain_row = best[True] < best[False]
        log.info(
            "one float32 row multiplies by the %s weights: %.1f ms a pass, against %.1f",
            "plain" if self.plain_row else "packed",
            1e3 * best[self.plain_row],
            1e3 * best[not self.plain_row],
        )


@dataclass(slots=True, frozen=True)
class Prepared:
    """A weight as it is and, on the CPU, packed for oneDNN (None where it is not)."""

    plain: Any
    packed: Any | None


@dataclass(slots=True, frozen=True)
class PackedForward:
    """A `torch.nn.Linear`'s forward by its weight prepared (`pack_linears`), over any
    leading dimensions."""

    products: Products
    weight: Prepared
    bias: Any

    def __call__(self, x: Any) -> Any:
        rows = x.reshape(-1, x.shape[-1])
        return self.products(rows, self.weight, self.bias).reshape(*x.shape[:-1], -1)


def pack_linears(torch: Any, model: Any, products: Products) -> int:
    """Every `torch.nn.Linear` of `model` multiplies from now on by its weight prepared by
    `products` (packed for oneDNN on a CPU), its forward replaced on the instance; answers
    how many. For an encoder called as transformers' module (MiniLM, a cross-encoder),
    whose linears otherwise run torch's plain `linear`: MKL's, which on an AMD EPYC takes
    its AVX2 code unless the launcher lets it take its Intel kernels (mkl_paths.py). There,
    a reranker of MiniLM-L6's shape, 10 pairs of 66 tokens on one core: 150 ms plain, 77 ms
    packed, the logits within 3e-7. The module keeps its weight."""
    if not products.packed:
        return 0
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for linear in linears:
        linear.forward = PackedForward(products, products.prepare(linear.weight), linear.bias)
    return len(linears)


@dataclass(slots=True, frozen=True)
class LayerWeights:
    """One layer's weights as the step multiplies by them."""

    qkv: Prepared
    qkv_bias: Any
    qkv_sizes: tuple[int, int, int]
    o: Prepared
    gate_up: Prepared | None
    """None: an MLP of another shape, called as it is (and `down` unused)."""
    down: Prepared | None


def layer_weights(torch: Any, layer: Any, products: Products) -> LayerWeights:
    attention = layer.self_attn
    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    qkv = _stack(torch, projections, "weight")
    biases = [p.bias for p in projections]
    qkv_bias = None if any(b is None for b in biases) else _stack(torch, projections, "bias")
    mlp = layer.mlp
    gate_up = down = None
    llama_mlp = all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))
    if llama_mlp and mlp.gate_proj.bias is None and mlp.up_proj.bias is None:
        gate_up = products.prepare(_stack(torch, [mlp.gate_proj, mlp.up_proj], "weight"))
        down = products.prepare(mlp.down_proj.weight)
    q, k, v = (int(p.weight.shape[0]) for p in projections)
    o = products.prepare(attention.o_proj.weight)
    return LayerWeights(products.prepare(qkv), qkv_bias, (q, k, v), o, gate_up, down)


def _stack(torch: Any, linears: list[Any], name: str) -> Any:
    """The linears' `name` tensors stacked in one, each linear's now a view of its part."""
    joined = torch.cat([getattr(linear, name).data for linear in linears])
    start = 0
    for linear in linears:
        size = getattr(linear, name).shape[0]
        setattr(linear, name, torch.nn.Parameter(joined[start : start + size], requires_grad=False))
        start += size
    return joined
