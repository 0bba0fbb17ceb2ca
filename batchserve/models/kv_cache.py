"""A device's KV cache for a real generator: preallocated once, handed out a token at a time,
and shared between sequences by their common prefix (automatic prefix caching).

The keys and values of every layer live in two tensors of `[layers, rows, kv_heads,
head_dim]`, sized from a byte budget. A sequence holds a list of rows, one per token it has in
the cache, taken from the free rows as it grows: a sequence joins or leaves without copying
any other's cache. One row per token (a page of one) wastes nothing to rounding; the price is
a gather of each sequence's rows per layer, which costs less than the step's matrix products
at a short context (benchmarks/README.md); a prefix shared by many decoding sequences is read
once for all of them, in place where its rows run in order (`attention.py`).

Prefix caching works on whole blocks of `BLOCK` tokens. A block is named by a key chained over
its parent block's key and its own token ids (`block_keys`); the first block's parent is a
root key over what makes rows incompatible (the model, its dtype) and a salt (the tenant, a
request's `cache_salt`), so rows are shared only where they hold the same numbers for the
same reader. Once a sequence has a block's tokens in the cache, the block is registered under
its key, and a sequence that starts with the same blocks adopts those rows instead of
computing them: a block's rows are counted by reference, never written again (new tokens
always go to new rows), and when no sequence holds a block any more it stays cached, idle, in
least-recently-used order, evicted only when rows are asked for and none is free. A block some
sequence is about to compute is `expected` under its key, so that one arriving with the same
prefix can wait for it instead of computing it twice.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..errors import StartupError

BLOCK = 16
"""Tokens in a cached block: the unit a prefix is shared in (vLLM's default block size)."""


class CacheFull(RuntimeError):
    """More rows were asked for than are free: the scheduler kept to a larger budget."""


@dataclass(slots=True, eq=False)
class _Block:
    """A registered block: its key, its `BLOCK` rows, and how many sequences hold it."""

    key: bytes
    rows: list[int]
    refs: int = 0


@dataclass(frozen=True, slots=True)
class Match:
    """A sequence's cached prefix: the blocks found (in order), how many of them no
    sequence holds now (idle: they leave the free rows when taken), and whether the block
    after them is being computed by a running sequence."""

    blocks: list[_Block]
    idle: int
    expected: bool


def root_key(identity: str, salt: str) -> bytes:
    """The parent of a sequence's first block: what its rows depend on besides its tokens."""
    return hashlib.sha256(f"batchserve-kv\0{identity}\0{salt}".encode()).digest()


def block_keys(parent: bytes, ids: list[int]) -> list[bytes]:
    """The keys of the whole blocks of `ids`, each chained over the one before it."""
    keys = []
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        parent = hashlib.sha256(parent + array("q", ids[start : start + BLOCK]).tobytes()).digest()
        keys.append(parent)
    return keys


class PagedKV:
    """Owns the cache tensors, which rows each sequence holds, and the cached blocks."""

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
        prefix_caching: bool = True,
    ) -> None:
        self._torch = torch
        element = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_token = layers * 2 * kv_heads * head_dim * element
        self.capacity: int = budget_bytes // self.bytes_per_token
        if self.capacity < 1:
            raise StartupError(
                f"--kv-cache-bytes {budget_bytes} holds no token: one takes"
                f" {self.bytes_per_token} bytes"
            )
        self.prefix_caching = prefix_caching
        shape = (layers, self.capacity, kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(self.capacity - 1, -1, -1))
        """Rows in no block and held by no sequence; pop() takes the lowest."""
        self._rows: dict[str, list[int]] = {}
        self._held: dict[str, list[_Block]] = {}
        """The registered blocks each sequence holds (adopted, or registered from its rows)."""
        self._sealed: dict[str, int] = {}
        """How many of each sequence's whole blocks were registered or found taken already."""
        self._blocks: dict[bytes, _Block] = {}
        self._idle: OrderedDict[bytes, _Block] = OrderedDict()
        """Cached blocks no sequence holds, least recently used first: evicted in this order."""
        self._expected: dict[bytes, str] = {}
        """Keys of blocks a running sequence will compute, and which sequence."""
        self._expecting: dict[str, list[bytes]] = {}
        self.evicted = 0
        """Cached blocks evicted for their rows."""

    def __repr__(self) -> str:
        return (
            f"<PagedKV sequences={len(self._rows)} free={len(self._free)}"
            f" cached={len(self._blocks)}/{self.capacity // BLOCK}>"
        )

    @property
    def free(self) -> int:
        """Rows a sequence can be given now: free ones, and those of idle cached blocks."""
        return len(self._free) + BLOCK * len(self._idle)

    @property
    def held(self) -> int:
        """Rows some sequence holds (a shared block's once)."""
        return self.capacity - self.free

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    def length(self, seq_id: str) -> int:
        return len(self._rows.get(seq_id, ()))

    def rows(self, seq_id: str) -> list[int]:
        return self._rows.get(seq_id, [])

    def own_rows(self, seq_id: str) -> int:
        """Rows that would become free or idle if the sequence were released now."""
        shared = sum(BLOCK for block in self._held.get(seq_id, ()) if block.refs > 1)
        return self.length(seq_id) - shared

    def match(self, keys: list[bytes], seq_id: str = "") -> Match:
        """The longest run of `keys` whose blocks are cached, and whether the next one is
        expected from another sequence."""
        blocks: list[_Block] = []
        if self.prefix_caching:
            for key in keys:
                block = self._blocks.get(key)
                if block is None:
                    break
                blocks.append(block)
        idle = sum(1 for block in blocks if block.refs == 0)
        following = keys[len(blocks)] if len(blocks) < len(keys) else None
        expected = self._expected.get(following, seq_id) != seq_id if following else False
        return Match(blocks, idle, expected)

    def adopt(self, seq_id: str, blocks: list[_Block], expect: list[bytes]) -> None:
        """A new sequence starts with the rows of `blocks` (a match's), and is expected to
        compute the blocks named by `expect` next."""
        if seq_id in self._rows:
            raise ValueError(f"{seq_id} already holds rows")
        for block in blocks:
            if block.refs == 0:
                del self._idle[block.key]
            block.refs += 1
        self._rows[seq_id] = [row for block in blocks for row in block.rows]
        self._held[seq_id] = list(blocks)
        self._sealed[seq_id] = len(blocks)
        if self.prefix_caching:
            mine = [key for key in expect if self._expected.setdefault(key, seq_id) == seq_id]
            self._expecting[seq_id] = mine

    def grow(self, seq_id: str, count: int) -> list[int]:
        """`count` new rows at the end of the sequence's, for the tokens it takes in now;
        idle cached blocks are evicted, least recently used first, only when none is free."""
        if count > self.free:
            raise CacheFull(f"{count} rows asked for, {self.free} free")
        while count > len(self._free):
            _, block = self._idle.popitem(last=False)
            del self._blocks[block.key]
            self._free.extend(reversed(block.rows))
            self.evicted += 1
        new = [self._free.pop() for _ in range(count)]
        self._rows.setdefault(seq_id, []).extend(new)
        return new

    def copy_rows(self, source: list[int], target: list[int]) -> None:
        """Copies the keys and values of rows `source` into rows `target`, in every layer:
        one of `n` choices takes its sibling's prompt rows that are not in a whole cached
        block (called between steps, the device idle)."""
        torch = self._torch
        with torch.inference_mode():
            into = torch.tensor(target, device=self.keys.device)
            rows = torch.tensor(source, device=self.keys.device)
            for tensor in (self.keys, self.values):
                tensor.index_copy_(1, into, tensor.index_select(1, rows))

    def seal(self, seq_id: str, keys: list[bytes]) -> None:
        """Registers the sequence's whole blocks not yet registered (`keys` names them); a
        block already cached under its key (computed twice) stays the sequence's own."""
        rows = self._rows.get(seq_id, [])
        start = self._sealed.get(seq_id, 0)
        whole = min(len(rows) // BLOCK, len(keys))
        if not self.prefix_caching or whole <= start:
            return
        held = self._held.setdefault(seq_id, [])
        for index in range(start, whole):
            key = keys[index]
            if self._expected.get(key) == seq_id:
                del self._expected[key]
            if key not in self._blocks:
                block = _Block(key, rows[index * BLOCK : (index + 1) * BLOCK], refs=1)
                self._blocks[key] = block
                held.append(block)
        self._sealed[seq_id] = whole

    def release(self, seq_id: str) -> None:
        """The sequence's own rows go back to the free ones; the blocks it held lose a
        reference, and those no one holds stay cached, idle (its last block the first to go)."""
        rows = self._rows.pop(seq_id, [])
        held = self._held.pop(seq_id, [])
        self._sealed.pop(seq_id, None)
        in_blocks: set[int] = set()
        for block in reversed(held):
            in_blocks.update(block.rows)
            block.refs -= 1
            if block.refs == 0:
                self._idle[block.key] = block
        self._free.extend(row for row in reversed(rows) if row not in in_blocks)
        for key in self._expecting.pop(seq_id, ()):
            if self._expected.get(key) == seq_id:
                del self._expected[key]
