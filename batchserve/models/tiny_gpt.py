"""A tiny GPT-2-shaped decoder with a real KV cache per sequence, for tests and benchmarks.

    pip install 'batchserve[torch]'
    python -m batchserve --generator batchserve.models.tiny_gpt:load --devices cpu

Random weights from a fixed seed (the same model on every device and every run), a
byte-level tokenizer (a prompt's UTF-8 bytes; it writes printable ASCII only, one character a
token, or ends the sequence), no files. Each sequence keeps its keys and values per layer on
the device; a step prefills new sequences (one by one, their whole prompt and tokens) and
then decodes every sequence's next token in one batched pass over the padded caches, as a
continuous-batching server's model does. Greedy unless `params` has a `temperature` above 0
(then sampled, seeded by `seed` and the sequence's length, so it repeats); `ignore_eos` and
`min_tokens` hold its end of sequence back; it ignores `top_p` and `top_k`.
"""

from __future__ import annotations

import importlib
import math
import os
from typing import Any

from ..errors import StartupError
from .generators import Seq
from .sampling import choose_token

VOCAB = 257
EOS = 256
PRINTABLE = range(32, 127)
"""What it writes: one printable ASCII character a token."""


class TinyGPT:
    """One device's model and the caches of the sequences it holds."""

    def __init__(
        self,
        device: str,
        *,
        layers: int = 2,
        heads: int = 4,
        width: int = 64,
        kv_budget_tokens: int = 4096,
        seed: int = 0,
        dtype: Any = None,
    ) -> None:
        torch = _torch()
        self._torch = torch
        self.device = device
        self.kv_budget_tokens = kv_budget_tokens
        self._heads, self._width = heads, width
        generator = torch.Generator().manual_seed(seed)

        def weight(*shape: int) -> Any:
            scale = 1 / math.sqrt(shape[0]) if len(shape) == 2 and shape[0] == width else 0.3
            return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

        self._embed = weight(VOCAB, width)
        self._positions = weight(kv_budget_tokens, width)
        self._layers = [
            {"qkv": weight(width, 3 * width), "out": weight(width, width),
             "up": weight(width, 4 * width), "down": weight(4 * width, width)}
            for _ in range(layers)
        ]  # fmt: skip
        self._unembed = weight(width, VOCAB)
        allowed = torch.full((VOCAB,), -math.inf)
        allowed[list(PRINTABLE)] = 0.0
        allowed[EOS] = 0.0
        self._allowed = allowed.to(device)
        self._caches: dict[str, list[tuple[Any, Any]]] = {}
        """Per sequence, per layer: keys and values, (heads, length, head width)."""

    def __repr__(self) -> str:
        return f"<TinyGPT {self.device} sequences={len(self._caches)}>"

    max_token_bytes = 1

    def count_tokens(self, text: str) -> int:
        return len(text.encode())

    def step(self, seqs: list[Seq]) -> list[str | None]:
        with self._torch.inference_mode():
            rows = {seq.id: self._prefill(seq) for seq in seqs if seq.id not in self._caches}
            decoding = [seq for seq in seqs if seq.id not in rows]
            if decoding:
                rows.update(zip([seq.id for seq in decoding], self._decode(decoding), strict=True))
            return [self._choose(seq, rows[seq.id]) for seq in seqs]

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._caches.pop(seq_id, None)

    def _prefill(self, seq: Seq) -> Any:
        """Runs the prompt and the tokens made so far, keeps their cache, and returns the
        next token's logits."""
        torch = self._torch
        ids = list(seq.prompt.encode()) + [ord(token) for token in seq.tokens] or [EOS]
        index = torch.tensor(ids, device=self.device)
        x = self._embed[index] + self._positions[: len(ids)]
        cache = []
        for layer in self._layers:
            q, k, v = (
                part.view(len(ids), self._heads, -1).transpose(0, 1)
                for part in (_norm(torch, x) @ layer["qkv"]).chunk(3, dim=-1)
            )
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = self._mlp(layer, x + attended.transpose(0, 1).reshape(len(ids), -1) @ layer["out"])
            cache.append((k, v))
        self._caches[seq.id] = cache
        return x[-1] @ self._unembed

    def _decode(self, seqs: list[Seq]) -> Any:
        """Each sequence's last token against its own cache, all in one padded pass."""
        torch = self._torch
        lengths = [self._caches[seq.id][0][0].shape[1] for seq in seqs]
        index = torch.tensor([ord(seq.tokens[-1]) for seq in seqs], device=self.device)
        where = torch.tensor(lengths, device=self.device)
        x = self._embed[index] + self._positions[where]
        longest = max(lengths) + 1
        mask = torch.arange(longest, device=self.device)[None, :] <= where[:, None]
        head_width = self._width // self._heads
        for number, layer in enumerate(self._layers):
            q, k, v = (
                part.view(len(seqs), self._heads, 1, head_width)
                for part in (_norm(torch, x) @ layer["qkv"]).chunk(3, dim=-1)
            )
            keys = x.new_zeros(len(seqs), self._heads, longest, head_width)
            values = torch.zeros_like(keys)
            for row, seq in enumerate(seqs):
                cache = self._caches[seq.id]
                old_k, old_v = cache[number]
                cache[number] = (torch.cat([old_k, k[row]], 1), torch.cat([old_v, v[row]], 1))
                keys[row, :, : lengths[row] + 1] = cache[number][0]
                values[row, :, : lengths[row] + 1] = cache[number][1]
            attended = torch.nn.functional.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask[:, None, None, :]
            )
            x = self._mlp(layer, x + attended.reshape(len(seqs), -1) @ layer["out"])
        return x @ self._unembed

    def _mlp(self, layer: dict[str, Any], x: Any) -> Any:
        torch = self._torch
        return x + torch.nn.functional.gelu(_norm(torch, x) @ layer["up"]) @ layer["down"]

    def _choose(self, seq: Seq, logits: Any) -> str | None:
        """Greedy, or sampled at the sequence's `temperature` (seeded: it repeats)."""
        logits = logits.float() + self._allowed
        if seq.params.get("ignore_eos") or len(seq.tokens) < seq.params.get("min_tokens", 0):
            logits[EOS] = -math.inf
        token = choose_token(self._torch, logits, seq.params, len(seq.tokens))
        return None if token == EOS else chr(token)


def _norm(torch: Any, x: Any) -> Any:
    return torch.nn.functional.layer_norm(x, x.shape[-1:])


def load(device: str) -> TinyGPT:
    """The per-device factory. On CPU it computes in float64, so a sequence's tokens do not
    depend on which others share its steps (tests compare them), and torch keeps one core
    free for the event loop."""
    torch = _torch()
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    return TinyGPT(device, dtype=torch.float64 if device == "cpu" else torch.float32)


def _torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise StartupError(
            "batchserve.models.tiny_gpt needs torch: pip install 'batchserve[torch]'"
        ) from None
