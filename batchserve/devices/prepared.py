"""The Batch API's idle calls prepared to follow the one in hand on a device, one a device:
its thread starts the next the moment the last returns (`DeviceThread.prepare`), so a run of
idle calls leaves the device no gap for the loop's round trip (hear the end, decide, submit)
between them. Each is taken back, its lines to the idle tier, the moment online work for its
version may want the device (`withdraw`): online work still finds at most the one call in
hand ahead of it. What the thread did start, the pool hears of when the call before it ends
(`after`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from ..batching.request import QueuedRequest
from ..models.registry import Key, ModelVersion
from ..rules.tenants import IDLE_RANK
from .device import Device, run_checked
from .thread import Next

Withdrawn = Callable[[Key, list[QueuedRequest]], None]
"""Told of the lines of a call that was withdrawn, never started: they wait again."""


@dataclass(slots=True)
class PreparedCall:
    device: Device
    key: Key
    batch: list[QueuedRequest]
    next: Next


class PreparedCalls:
    def __init__(self, withdrawn: Withdrawn) -> None:
        self._by_device: dict[str, PreparedCall] = {}
        self._withdrawn = withdrawn

    def __bool__(self) -> bool:
        return bool(self._by_device)

    def __repr__(self) -> str:
        return f"<PreparedCalls on {list(self._by_device)}>"

    def chainable(self, devices: list[Device]) -> list[Device]:
        """Of `devices`, those whose call in hand is an idle one that a prepared call may
        follow: none is prepared yet, and no step or warm-up waits for a turn there (it
        would wait behind that call too)."""
        return [
            d
            for d in devices
            if d.batch
            and d.batch[0].tier_rank == IDLE_RANK
            and not d.residents
            and not d.turns
            and d.name not in self._by_device
        ]

    def prepare(self, device: Device, key: Key, batch: list[QueuedRequest]) -> bool:
        """`batch` (all of `key`) to start on `device` as its call in hand returns; False
        if that has returned already, or `batch` is a rescue's that failed there (it goes
        elsewhere if it can: `GpuPool.dispatch`)."""
        if device.name in batch[-1].failed_on:
            return False
        run = functools.partial(run_checked, device.fns[key.version], key.params)
        prepared = device.thread.prepare(run, [request.input for request in batch])
        if prepared is None:
            return False
        self._by_device[device.name] = PreparedCall(device, key, batch, prepared)
        return True

    def after(self, device: Device) -> PreparedCall | None:
        """The call in hand on `device` ended (returned, or hung): the call its thread
        started after it, if any; one prepared and not started is withdrawn."""
        call = self._by_device.pop(device.name, None)
        if call is not None and device.thread.withdraw(call.next):
            self._withdrawn(call.key, call.batch)
            return None
        return call

    def withdraw(self, versions: Collection[ModelVersion] | None = None) -> None:
        """Takes back every call prepared (of `versions`, if given) that has not started;
        one that started stays, for `after` to report."""
        for call in list(self._by_device.values()):
            mine = versions is None or call.key.version in versions
            if mine and call.device.thread.withdraw(call.next):
                del self._by_device[call.device.name]
                self._withdrawn(call.key, call.batch)

    def requests(self) -> Iterator[QueuedRequest]:
        """The lines of every prepared call, started or not."""
        for call in self._by_device.values():
            yield from call.batch
