"""Inputs found poison, remembered: a client retrying one must not sink a fresh batch again.

Only digests are kept (never the input): of the model version, the canonical params and
the text, so the same text is poison for one model and not another. Bounded in entries and
in time: the oldest go first, and each is forgotten `ttl_s` after it was last found, since
a fixed model may take it again. Pure: time is passed in.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from ..models.registry import Key

POISON_TTL_S = 3600.0
"""How long a poison input is remembered after it last failed."""


class PoisonMemory:
    def __init__(self, capacity: int, ttl_s: float = POISON_TTL_S) -> None:
        self.capacity = capacity
        self._ttl_s = ttl_s
        self._expiry: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._expiry)

    def __repr__(self) -> str:
        return f"<PoisonMemory {len(self)} of {self.capacity}>"

    def remember(self, key: Key, text: str, now: float) -> None:
        if not self.capacity:
            return
        digest = _digest(key, text)
        self._expiry[digest] = now + self._ttl_s
        self._expiry.move_to_end(digest)
        while len(self._expiry) > self.capacity:
            self._expiry.popitem(last=False)

    def recall(self, key: Key, text: str, now: float) -> bytes:
        """The digest of `text` under `key`'s version and params if it was found poison
        lately, else b"". Costs nothing while nothing is remembered: the common case."""
        if not self._expiry:
            return b""
        digest = _digest(key, text)
        expiry = self._expiry.get(digest)
        if expiry is None:
            return b""
        if expiry <= now:
            del self._expiry[digest]
            return b""
        return digest


def _digest(key: Key, text: str) -> bytes:
    blake = hashlib.blake2b(digest_size=16)
    for part in (key.version.spec.label.encode(), key.params_key, text.encode()):
        blake.update(len(part).to_bytes(8, "little"))
        blake.update(part)
    return blake.digest()
