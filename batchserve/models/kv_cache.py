"""A device's KV cache for a real generator: preallocated once, handed out a token at a time.

The keys and values of every layer live in two tensors of `[layers, rows, kv_heads,
head_dim]`, sized from a byte budget. A sequence owns a list of rows, one per token it has in
the cache, taken from a free list as it grows and given back whole when it is released: a
sequence joins or leaves without copying any other's cache, and the scheduler's budget (the
sum of every running sequence's tokens) is exactly the rows there are. One row per token (a
page of one) wastes nothing to rounding; the price is a gather of each sequence's rows per
layer, which costs less than the step's matrix products (benchmarks/README.md).
"""

from __future__ import annotations

from typing import Any

from ..errors import StartupError


class CacheFull(RuntimeError):
    """More rows were asked for than are free: the scheduler kept to a larger budget."""


class PagedKV:
    """Owns the cache tensors and which rows each sequence holds."""

    def __init__(
        self,
        torch: Any,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: Any,
        device: str,
        budget_bytes: int,
    ) -> None:
        element = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_token = layers * 2 * kv_heads * head_dim * element
        self.capacity = budget_bytes // self.bytes_per_token
        if self.capacity < 1:
            raise StartupError(
                f"--kv-cache-bytes {budget_bytes} holds no token: one takes"
                f" {self.bytes_per_token} bytes"
            )
        shape = (layers, self.capacity, kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(self.capacity - 1, -1, -1))
        """Free rows; pop() takes the lowest, so a lightly used cache stays compact."""
        self._rows: dict[str, list[int]] = {}

    def __repr__(self) -> str:
        return f"<PagedKV sequences={len(self._rows)} free={len(self._free)}/{self.capacity}>"

    @property
    def free(self) -> int:
        return len(self._free)

    def length(self, seq_id: str) -> int:
        return len(self._rows.get(seq_id, ()))

    def rows(self, seq_id: str) -> list[int]:
        return self._rows.get(seq_id, [])

    def grow(self, seq_id: str, count: int) -> list[int]:
        """`count` new rows at the end of the sequence's, for the tokens it takes in now."""
        if count > len(self._free):
            raise CacheFull(f"{count} rows asked for, {len(self._free)} free")
        new = [self._free.pop() for _ in range(count)]
        self._rows.setdefault(seq_id, []).extend(new)
        return new

    def release(self, seq_id: str) -> None:
        self._free.extend(reversed(self._rows.pop(seq_id, [])))
