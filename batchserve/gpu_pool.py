"""Devices and their threads: each device runs one batch call at a time on its own thread.

The pool loads each device's batch function on that device's thread (so weights land where
they will be used), runs batches there, checks what comes back and resolves the waiting
futures on the event loop. It owns every batch task it starts and awaits them on close.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .backends import BatchFn, DeviceFactory
from .errors import BackendError, BatchserveError, StartupError
from .item import QueuedRequest, Result

log = logging.getLogger(__name__)

BatchDone = Callable[[float, int], None]
"""Called on the loop when a device frees: the call's duration (s) and the batch size."""


@dataclass(eq=False)
class Device:
    name: str
    executor: ThreadPoolExecutor
    fn: BatchFn | None = None
    busy_since: float | None = None
    batch: list[QueuedRequest] = field(default_factory=list)


class GpuPool:
    def __init__(self, device_names: list[str], factory: DeviceFactory) -> None:
        self._factory = factory
        self._devices = [
            Device(name, ThreadPoolExecutor(1, thread_name_prefix=f"batchserve-{name}"))
            for name in device_names
        ]
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"<GpuPool devices={len(self._devices)} free={self.free_count}>"

    @property
    def free_count(self) -> int:
        return sum(device.busy_since is None for device in self._devices)

    @property
    def busy_since(self) -> list[float]:
        return [d.busy_since for d in self._devices if d.busy_since is not None]

    @property
    def in_flight_requests(self) -> int:
        return sum(len(device.batch) for device in self._devices)

    async def __aenter__(self) -> GpuPool:
        loop = asyncio.get_running_loop()
        loaded = await asyncio.gather(
            *(loop.run_in_executor(d.executor, self._factory, d.name) for d in self._devices),
            return_exceptions=True,
        )
        for device, fn in zip(self._devices, loaded, strict=True):
            if isinstance(fn, BaseException):
                self._shutdown_threads()
                cause = fn if isinstance(fn, StartupError) else f"{type(fn).__name__}: {fn}"
                raise StartupError(f"device {device.name} failed to load: {cause}") from fn
            device.fn = fn
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Waits for the batches already running: their requests were accepted."""
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._shutdown_threads()

    def _shutdown_threads(self) -> None:
        for device in self._devices:
            device.executor.shutdown(wait=False, cancel_futures=True)

    def dispatch(self, batch: list[QueuedRequest], on_done: BatchDone) -> None:
        """Starts `batch` on a free device; the caller has checked that one is free."""
        device = next(d for d in self._devices if d.busy_since is None)
        assert device.fn is not None
        loop = asyncio.get_running_loop()
        device.busy_since = started = loop.time()
        device.batch = batch
        # Submitted here, not in the task's first step: that step would queue behind every
        # handler that the last finished batch just woke, leaving the device idle meanwhile.
        call = loop.run_in_executor(device.executor, device.fn, [r.input for r in batch])
        task = asyncio.create_task(self._finish(device, batch, started, call, on_done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def fail_in_flight(self, error: BatchserveError) -> None:
        """Answers everyone whose batch is still running; late results are then dropped."""
        for device in self._devices:
            for request in device.batch:
                if not request.future.done():
                    request.future.set_exception(error)

    async def _finish(
        self,
        device: Device,
        batch: list[QueuedRequest],
        started: float,
        call: asyncio.Future[list[str]],
        on_done: BatchDone,
    ) -> None:
        loop = asyncio.get_running_loop()
        error: BackendError | None = None
        outputs: list[str] = []
        try:
            outputs = _checked(await call, len(batch))
        except BackendError as exc:
            error = exc
        except Exception as exc:
            error = BackendError(f"the batch function raised {type(exc).__name__}: {exc}")
        finished = loop.time()
        device.busy_since = None
        device.batch = []
        # Wake the batcher before the waiting handlers: its wake-up is then queued ahead of
        # theirs, so the device gets its next batch before a hundred responses are written.
        on_done(finished - started, len(batch))
        if error is not None:
            log.warning(
                "batch of %d on %s failed: %s (request ids: %s)",
                len(batch),
                device.name,
                error,
                ",".join(r.request_id for r in batch),
            )
        for index, request in enumerate(batch):
            if request.future.done():
                continue
            if error is not None:
                request.future.set_exception(error)
            else:
                request.future.set_result(
                    Result(
                        outputs[index], started - request.arrival, finished - started, len(batch)
                    )
                )


def _checked(returned: object, expected: int) -> list[str]:
    if not isinstance(returned, list):
        raise BackendError(
            f"the batch function returned {type(returned).__name__}, not a list of str"
        )
    if len(returned) != expected:
        raise BackendError(
            f"the batch function returned {len(returned)} outputs for {expected} inputs"
        )
    wrong = [type(item).__name__ for item in returned if not isinstance(item, str)]
    if wrong:
        raise BackendError(f"the batch function returned a {wrong[0]} output, not str")
    return returned
