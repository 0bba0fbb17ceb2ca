"""What a door may ask of the engine: the faces it is handed instead of the `Engine`.

A door that holds the whole engine can reach anything in it, and nothing says what it
needs; a face says it, and mypy holds each door to it. `server.py` hands each door the
engine (which has all of these) typed as the smallest face the door needs, or the engine's
part itself (`engine.generation`, `engine.versions`). No door module imports
`engine/core.py` (pyproject.toml's import contracts, run by tests/test_architecture.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from ..batching.request import Ask, QueuedRequest, Result, Ticket
from ..clock import Clock, Timer
from ..config import Config
from ..engine.requests import Caller, Prompt
from ..engine.views import EngineView
from ..errors import BatchserveError
from ..generation.request import Generation
from ..rules.tenants import Tenant


class Reception(Protocol):
    """What reading any request asks: the clock, the live settings, who is calling, and the
    record of what a door refuses before the engine sees it (`wire.read_call`)."""

    @property
    def clock(self) -> Clock: ...

    @property
    def config(self) -> Config:
        """The running settings: a reload replaces them, so a door reads them each time."""
        ...

    def authenticate(self, authorization: str | None) -> Tenant | None: ...

    def gateway_tenant(
        self, headers: Mapping[str, str], authenticated: Tenant | None
    ) -> Tenant | None: ...

    def record(
        self,
        route: str,
        request_id: str,
        arrival: float,
        outcome: Result | BatchserveError,
        tenant: Tenant | None,
    ) -> None: ...


class Views(Protocol):
    """The read-only views: the models, readiness and the devices' states."""

    @property
    def view(self) -> EngineView: ...

    def readiness(self) -> tuple[bool, str]: ...

    def device_states(self) -> dict[str, str]: ...


class BatchFace(Reception, Views, Protocol):
    """The batch path, as the batch doors ask it: one input in parts (the fast door's
    admit, await, settle) or whole, a list of inputs, or one submitted to be polled."""

    def admit(
        self,
        route: str,
        ask: Ask,
        request_id: str | None,
        tenant: Tenant | None,
        arrival: float | None,
    ) -> tuple[QueuedRequest, Timer | None]: ...

    def settle(
        self,
        route: str,
        request: QueuedRequest,
        expiry: Timer | None,
        tenant: Tenant | None,
        outcome: Result | BatchserveError | None,
    ) -> None: ...

    async def infer(self, ask: Ask | str, caller: Caller | None = None) -> Result: ...

    async def infer_all(
        self,
        asks: Sequence[Ask],
        caller: Caller | None = None,
        check: Callable[[], None] | None = None,
    ) -> list[Result]: ...

    def submit(self, ask: Ask | str, caller: Caller | None = None) -> Ticket: ...


class Generating(Protocol):
    """The generation path (`engine.generation`), as the generation doors ask it."""

    def generate(
        self, prompt: Prompt | str, caller: Caller | None = None
    ) -> AbstractAsyncContextManager[Generation]: ...

    def chat_prompt(
        self,
        model: str | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """A chat's messages (and tools) as one prompt, in the template of `model`'s
        generator."""
        ...
