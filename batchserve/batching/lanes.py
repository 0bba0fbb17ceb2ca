"""The batcher's lanes: the waiting requests of one compatibility key (a model version and,
for a length-cost model, a bucket of input lengths), with the size and time of a batch of
them."""

from __future__ import annotations

from ..models.registry import Key, ModelVersion
from ..rules.capacity import LengthCost
from ..rules.fair_queue import FairQueue
from ..rules.sharing import PRESENT_S, shared_count
from .request import QueuedRequest


class Lane:
    """The waiting requests of one compatibility key, and its share of device time so far."""

    __slots__ = ("key", "max_batch", "queue", "tag")

    def __init__(self, key: Key, tag: float) -> None:
        self.key = key
        self.queue = FairQueue[QueuedRequest]()
        self.tag = tag
        """Virtual time at which its next batch starts; smaller goes first."""
        spec = key.version.spec
        self.max_batch = spec.max_batch_size
        if spec.max_batch_tokens is not None:
            longest = (1 << key.bucket) - 1  # the bucket's longest input
            self.max_batch = max(1, min(self.max_batch, spec.max_batch_tokens // longest))

    def __repr__(self) -> str:
        label = self.key.version.spec.label
        return f"<Lane {label} bucket={self.key.bucket} queued={len(self.queue)}>"

    def predicted_s(self, size: int) -> float | None:
        """The batch time of `size` of this lane's requests, padded to the bucket's top."""
        return self.key.version.estimate.predict(size * max(1, (1 << self.key.bucket) - 1))

    def shared(self, count: int, ratio: float, now: float) -> int:
        """`count`, cut short while a tenant other than the one whose request is oldest
        here has sent to the version lately (rules/sharing.py)."""
        version = self.key.version
        oldest = self.queue.head(1)[0].tenant
        if count <= 1 or not version.senders.other_since(oldest, now - PRESENT_S):
            return count
        learning = isinstance(version.estimate, LengthCost) and version.estimate.line() is None
        return shared_count(count, ratio, None if learning else self.predicted_s)


def length_bucket(version: ModelVersion, tokens: int) -> int:
    """Length-cost versions group inputs whose lengths are within 2x of each other (bucket
    b holds 2^(b-1) to 2^b - 1 tokens); flat ones have one bucket."""
    return tokens.bit_length() if version.spec.cost == "length" else 0
