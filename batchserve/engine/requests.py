"""What a caller hands the engine: who asks (`Caller`) and, for a generation, what (`Prompt`);
a batch input's what is `batching.request.Ask`.

    result = await engine.infer(Ask("some input", model="a"), Caller(request_id="r-1"))
    async with engine.generate(Prompt("Once upon", max_tokens=50)) as gen: ...

Value objects rather than keywords, so that a door reads a body into one and hands it on
whole, and every door and library caller names the same fields the same way. A bare string
stands for the request with every default (`engine.infer("x")`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

from ..models.grammar import Constraint
from ..rules.tenants import Tenant

MAX_INPUTS_PER_CALL = 2048
"""The most inputs a door takes in one request for `infer_all` (an embeddings list, an Open
Inference Protocol tensor): OpenAI's own limit on inputs per embeddings request."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """Who sent a request, when, and through which door: what its record and metrics name."""

    request_id: str | None = None
    """The client's id (unique among its tenant's requests in flight); None: a fresh one."""
    tenant: Tenant | None = None
    """Its tenant (`engine.authenticate`); None on a server without keys."""
    arrival: float | None = None
    """When the caller received it, on the engine's clock; None: now."""
    route: str | None = None
    """The door it came through, in metrics and logs; None: the call's own ("inference",
    "requests", "generate")."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One generation asked for: what `engine.generate` runs."""

    text: str
    _: KW_ONLY
    model: str | None = None
    version: str | None = None
    """Pins one of the model's versions; None: they share traffic by weight."""
    max_tokens: int | None = None
    """At most this many new tokens; None: as many as the device's budget allows."""
    stop: str | list[str] | None = None
    params: Mapping[str, Any] | None = None
    """Sampling params (`rules/sampling_params.py`); other keys go to the generator."""
    timeout_ms: float | None = None
    """Bounds the wait for the first token; None: the server's."""
    cache_salt: str | None = None
    """vLLM's: only requests with the same salt share cached prefixes."""
    prompt_ids: list[int] | None = None
    """The prompt as token ids (`text` is then its text, or "")."""
    fork_of: str | None = None
    """The request id of a generation with the same prompt (one of `n` choices) whose
    prompt's rows this one copies instead of computing them."""
    constraint: Constraint | None = None
    """A grammar its output keeps to (structured output, a forced tool call)."""
