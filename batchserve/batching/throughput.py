"""What the healthy devices can take, in requests a second of full batches: read by
admission (tenants' rates), shedding, the metrics and the replica count; and the part of
shared devices a version's partial batches may spread over. Measured, not assumed: a
version counts once one of its batches has finished. The pool answers through `Fleet`,
since batching/ sits below it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from typing import Protocol

from ..clock import Clock
from ..models.registry import ModelVersion


class Fleet(Protocol):
    """What throughput reads of the devices (the pool)."""

    def healthy_for(self, version: ModelVersion) -> int: ...

    def sharing(self, version: ModelVersion) -> frozenset[ModelVersion]: ...

    def healthy_versions(self) -> Iterator[Collection[ModelVersion]]: ...


class Throughput:
    """The devices' capacity, read from the fleet's health and each version's call time."""

    def __init__(self, fleet: Fleet, clock: Clock) -> None:
        self._fleet = fleet
        self._clock = clock

    def rps(self, version: ModelVersion | None = None) -> float | None:
        """Requests a second the healthy devices can take in full batches of `version`;
        without one, of the versions they run (each device at its fastest). None until a
        batch has finished, since the call time is measured, not assumed."""
        if version is not None:
            call_s = version.estimate.seconds
            if not call_s:
                return None
            return self._devices_left(version) * version.spec.max_batch_size / call_s
        rates = [
            max(measured)
            for versions in self._fleet.healthy_versions()
            if (measured := [rate for v in versions if (rate := _full_batch_rps(v))])
        ]
        return sum(rates) if rates else None

    def device_share(self, version: ModelVersion, now: float) -> float | None:
        """The devices `version`'s partial batches may spread over where other versions
        share them: its part of their arrivals. (Counting what the others leave idle as
        well was measured worse: the small batches it allows take time the others then
        lack, so their share falls and this one's grows.) None where it has its devices
        to itself."""
        sharing = self._fleet.sharing(version)
        if len(sharing) < 2:
            return None
        total = sum(v.arrivals.at(now) for v in sharing)
        if total <= 0:
            return None
        return self._fleet.healthy_for(version) * version.arrivals.at(now) / total

    def _devices_left(self, version: ModelVersion) -> float:
        """The healthy devices `version` can count on: what the versions sharing them took
        of their time lately is not, though start-time fair queuing leaves it at least an
        even split when all want more."""
        devices = self._fleet.healthy_for(version)
        sharing = self._fleet.sharing(version)
        if len(sharing) < 2:
            return devices
        now = self._clock.time()
        taken = sum(v.device_time.at(now) for v in sharing if v is not version)
        return max(devices - taken, devices / len(sharing))


def queue_wait_s(queued: int, capacity_rps: float | None) -> float:
    """How long `queued` requests take to drain at `capacity_rps` (forever at none)."""
    if not queued:
        return 0.0
    return queued / capacity_rps if capacity_rps else math.inf


def _full_batch_rps(version: ModelVersion) -> float | None:
    call_s = version.estimate.seconds
    return version.spec.max_batch_size / call_s if call_s else None
