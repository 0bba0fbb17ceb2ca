"""Fakes and fixtures: a gated backend the test releases, and an in-process server."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from aiohttp.test_utils import TestClient

from batchserve.backends import BatchFn, simulate
from batchserve.config import Config
from batchserve.server import SERVER_KEY, Server, create_app


@dataclass
class GatedBackend:
    """A device factory whose calls block until `gate` opens; it records every call.

    It also counts how many calls are inside each device at once, so a test can prove a
    device never ran two batches together.
    """

    gate: threading.Event = field(default_factory=threading.Event)
    calls: list[tuple[str, list[str]]] = field(default_factory=list)
    max_concurrent: dict[str, int] = field(default_factory=dict)
    _inside: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, device: str) -> BatchFn:
        def run(inputs: list[str]) -> list[str]:
            with self._lock:
                self.calls.append((device, list(inputs)))
                self._inside[device] = self._inside.get(device, 0) + 1
                self.max_concurrent[device] = max(
                    self.max_concurrent.get(device, 0), self._inside[device]
                )
            try:
                self.gate.wait()
                return [simulate(text) for text in inputs]
            finally:
                with self._lock:
                    self._inside[device] -= 1

        return run

    def seen_inputs(self) -> list[str]:
        return [text for _, inputs in self.calls for text in inputs]


@pytest.fixture
def gated() -> Iterator[GatedBackend]:
    backend = GatedBackend()
    yield backend
    backend.gate.set()  # never leave a device thread blocked behind a failed test


Factory = Callable[[str], BatchFn]


@pytest.fixture
def start_server(
    aiohttp_client: Callable[..., object],
) -> Callable[..., object]:
    """Starts the real app in-process; returns (client, server)."""

    async def start(
        factory: Factory, devices: int = 1, **settings: object
    ) -> tuple[TestClient, Server]:
        config = Config(**settings)  # type: ignore[arg-type]
        names = [f"sim:{index}" for index in range(devices)]
        app = create_app(config, names, factory)
        client = await aiohttp_client(  # type: ignore[operator]
            app, server_kwargs={"handler_cancellation": True}
        )
        return client, app[SERVER_KEY]

    return start
