"""The step's pass through a Llama-shaped model's layers, run as it is or compiled.

Run as it is, each layer is some sixty small operations dispatched one by one from Python
(RMSNorm alone is seven, RoPE a dozen): at a decode step's few rows of SmolLM2 that
dispatch is about a sixth of the step. Compiled (`torch.compile`, inductor, on a CPU), the
pass is one graph whose elementwise work between the products runs as a few fused C++
loops a layer. Two things stay opaque, as custom operations the graph calls back: the
products, whose weights are packed for oneDNN (inductor cannot lower those), and
attention, which reads the paged cache by a plan made in Python for each step.

The step's token count is the graph's one free size, and unbacked (`mark_unbacked`), so
one graph serves one token and a thousand alike: the warm-up compiles it, and a request
never waits for a compile. A layer's index reaches the operations as a tensor, which
keeps the graph's layers alike. (One graph a layer, called 30 times a step, traced in a
second but lost the gain to its calls' guards and wrappers.)
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .linears import LayerWeights, Prepared, Products, layer_weights

log = logging.getLogger(__name__)

Attend = Callable[[Any, Any, Any, int], Any]
"""(q, k, v, layer index) -> the layer's attention output, before its output projection."""

_LOOPS: weakref.WeakValueDictionary[int, LayerLoop] = weakref.WeakValueDictionary()
"""Each compiled loop by its number, for the custom operations to call back."""
_numbers = itertools.count()
_defined = threading.Lock()
_library: Any = None


class LayerLoop:
    """Every layer over a step's packed tokens (`x`: `[tokens, hidden]`, `cos` and `sin`:
    their RoPE angles): the products by prepared weights, attention by `attend`."""

    def __init__(
        self,
        torch: Any,
        model: Any,
        heads: tuple[int, int, int],
        products: Products,
        attend: Attend,
        *,
        compiled: bool,
    ) -> None:
        self._torch = torch
        self._heads, self._kv_heads, self._head_dim = heads
        """Query heads, KV heads, and their size."""
        self._products = products
        self._attend = attend
        self._modules = list(model.model.layers)
        weights = [layer_weights(torch, layer, products) for layer in self._modules]
        self._slots = [_slots(layer, w) for layer, w in zip(self._modules, weights, strict=True)]
        self._fused_mlp = all(w.gate_up is not None for w in weights)
        act = getattr(self._modules[0].mlp, "act_fn", None)  # used where the MLP is fused
        self._act: Any = torch.nn.functional.silu if _is_silu(act) else act
        """The MLP's activation (each layer's is the config's): SiLU as torch's function,
        which the graph takes as it is for every load of a model (a module is guarded by
        its identity: a graph a load)."""
        refused = _not_compilable(self._modules, weights) if compiled else ""
        if refused:
            log.info("the layers run uncompiled: %s", refused)
        self.compiled = compiled and not refused
        self._layers = [
            _Layer.of(torch, index, module, self.compiled)
            for index, module in enumerate(self._modules)
        ]
        self._number = next(_numbers)
        self._key = torch.tensor(self._number)
        """The number as a tensor, an input of the graph: a model loaded again (a new version)
        reuses the graph compiled for its predecessor, where a constant would not."""
        self._widths = [int(weight.plain.shape[0]) for weight, _ in self._slots[0]]
        self._run: Callable[..., Any] = self._pass
        if self.compiled:
            _define_operations(torch)
            _LOOPS[self._number] = self
            torch._inductor.config.compile_threads = 1  # no pool of worker processes
            self._run = torch.compile(self._pass, dynamic=False, fullgraph=True)

    def __call__(self, x: Any, cos: Any, sin: Any) -> Any:
        if self.compiled:  # the step's tokens vary, from one; nothing else does
            for tensor in (x, cos, sin):
                self._torch._dynamo.decorators.mark_unbacked(tensor, 0)
        return self._run(x, cos, sin)

    def _pass(self, x: Any, cos: Any, sin: Any) -> Any:
        for layer in self._layers:
            x = self._layer(x, cos, sin, layer.index, *layer.norms)
        return x

    def run_as_it_is(self) -> None:
        """From now on, the layers run uncompiled (after a compile that failed)."""
        self.compiled = False
        self._run = self._pass
        self._layers = [_Layer(int(layer.index), layer.norms) for layer in self._layers]
        _LOOPS.pop(self._number, None)

    def weights(self) -> list[Prepared]:
        """Every weight the layers multiply by, in a step's order."""
        return [weight for slots in self._slots for weight, _ in slots]

    def multiply(self, x: Any, layer: Any, which: int) -> Any:
        """`x` times the layer's `which` weight: 0 q, k and v, 1 the attention's output, 2
        the MLP's gate and up, 3 its down."""
        weight, bias = self._slots[int(layer)][which]
        return self._products(x, weight, bias)

    def attend(self, q: Any, k: Any, v: Any, layer: Any) -> Any:
        return self._attend(q, k, v, int(layer))

    def _layer(self, x: Any, cos: Any, sin: Any, layer: Any, *norms: Any) -> Any:
        """One layer (`layer`: its index; `norms`: its RMSNorms' weights and epsilons)."""
        torch, tokens = self._torch, x.shape[0]
        before, before_eps, after, after_eps, q_norm, k_norm, head_eps = norms
        q_size, kv_size = self._heads * self._head_dim, self._kv_heads * self._head_dim
        qkv = self._product(_rms_norm(torch, x, before, before_eps), layer, 0)
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q = q.reshape(tokens, self._heads, self._head_dim)
        k = k.reshape(tokens, self._kv_heads, self._head_dim)
        v = v.reshape(tokens, self._kv_heads, self._head_dim)
        if q_norm is not None:  # Qwen3 normalises each head before RoPE
            q, k = _rms_norm(torch, q, q_norm, head_eps), _rms_norm(torch, k, k_norm, head_eps)
        q = q * cos + _rotate_half(torch, q) * sin
        k = k * cos + _rotate_half(torch, k) * sin
        x = x + self._product(self._attention(q, k, v, layer), layer, 1)
        hidden = _rms_norm(torch, x, after, after_eps)
        if not self._fused_mlp:  # an MLP of another shape, called as it is
            return x + self._modules[int(layer)].mlp(hidden)
        gate, up = self._product(hidden, layer, 2).chunk(2, dim=-1)
        return x + self._product(self._act(gate) * up, layer, 3)

    def _product(self, x: Any, layer: Any, which: int) -> Any:
        if self.compiled:
            width = self._widths[which]
            return self._torch.ops.batchserve.product(x, self._key, layer, which, width)
        return self.multiply(x, layer, which)

    def _attention(self, q: Any, k: Any, v: Any, layer: Any) -> Any:
        if self.compiled:
            return self._torch.ops.batchserve.attend(q, k, v, self._key, layer)
        return self._attend(q, k, v, layer)


@dataclass(frozen=True, slots=True)
class _Layer:
    """What one layer's call takes besides the tokens."""

    index: Any
    """An int; where compiled, a 0-dim tensor: an input of the graph, not a constant that
    would make each layer's code its own."""
    norms: tuple[Any, ...]
    """Its RMSNorms' weights and epsilons, and Qwen3's q and k norms (else None)."""

    @classmethod
    def of(cls, torch: Any, index: int, layer: Any, compiled: bool) -> _Layer:
        attention = layer.self_attn
        before, after = layer.input_layernorm, layer.post_attention_layernorm
        q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        norms = (
            before.weight,
            before.variance_epsilon,
            after.weight,
            after.variance_epsilon,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            None if q_norm is None else q_norm.variance_epsilon,
        )
        return cls(torch.tensor(index) if compiled else index, norms)


def _slots(layer: Any, weights: LayerWeights) -> list[tuple[Prepared, Any]]:
    """A layer's weights and biases by `LayerLoop.multiply`'s `which` (the MLP's only
    where they are fused)."""
    slots = [(weights.qkv, weights.qkv_bias), (weights.o, layer.self_attn.o_proj.bias)]
    if weights.gate_up is not None and weights.down is not None:
        slots += [(weights.gate_up, None), (weights.down, layer.mlp.down_proj.bias)]
    return slots


def _not_compilable(layers: list[Any], weights: list[LayerWeights]) -> str:
    """Why one graph cannot serve these layers ("" where it can)."""
    if any(w.gate_up is None for w in weights):
        return "an MLP that is not Llama's"
    if not all(_is_silu(layer.mlp.act_fn) for layer in layers):
        return "an MLP whose activation is not SiLU"
    if len({(w.qkv_sizes, w.qkv_bias is None) for w in weights}) > 1:
        return "layers of different shapes"
    return ""


def _is_silu(act: Any) -> bool:
    return type(act).__name__ in ("SiLU", "SiLUActivation")


def _define_operations(torch: Any) -> None:
    """`batchserve::product` and `batchserve::attend`, once a process: what a compiled layer
    calls for a product and for attention, and the shapes they answer while it compiles."""
    global _library
    with _defined:
        if _library is not None:
            return
        library = torch.library.Library("batchserve", "DEF")
        library.define(
            "product(Tensor x, Tensor loop, Tensor layer, int which, int width) -> Tensor"
        )
        library.define("attend(Tensor q, Tensor k, Tensor v, Tensor loop, Tensor layer) -> Tensor")

        def product(x: Any, loop: Any, layer: Any, which: int, width: int) -> Any:
            return _LOOPS[int(loop)].multiply(x, layer, which)

        def attend(q: Any, k: Any, v: Any, loop: Any, layer: Any) -> Any:
            return _LOOPS[int(loop)].attend(q, k, v, layer)

        def product_shape(x: Any, loop: Any, layer: Any, which: int, width: int) -> Any:
            return x.new_empty(x.shape[0], width)

        def attend_shape(q: Any, k: Any, v: Any, loop: Any, layer: Any) -> Any:
            return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

        library.impl("product", product, "CPU")
        library.impl("attend", attend, "CPU")
        torch.library.register_fake("batchserve::product", product_shape, lib=library)
        torch.library.register_fake("batchserve::attend", attend_shape, lib=library)
        _library = library


def _rms_norm(torch: Any, x: Any, weight: Any, eps: float) -> Any:
    """transformers' LlamaRMSNorm, operation for operation (so uncompiled tokens equal
    theirs): in float32, back to `x`'s dtype before the weight."""
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def _rotate_half(torch: Any, x: Any) -> Any:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
