"""Who may send what: API keys, tenants' rate limits, deadlines and the input itself, and
what a generation may ask for (new tokens within a device's budget, stop strings).

The engine asks these questions of every request, from HTTP or from Python, before it
queues it (`engine/intake.py`, one order for both schedulers); whether the engine is ready
and whether its queue has room are its own to say. Time is passed in.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable, Mapping

from ..config import Config
from ..errors import InputTooLarge, InvalidInput, OverTierBurst, RateLimited, Unauthenticated
from .gateway import GatewayHeaders
from .tenants import KeyRing, Tenant, bearer_secret


class Admission:
    def __init__(self, config: Config) -> None:
        self._timeout_ms = config.timeout_ms
        self._first_token_timeout_ms = config.first_token_timeout_ms
        self._max_input_bytes = config.max_input_bytes
        self._keys = (
            KeyRing.load(config.keys_file, config.anonymous_tier) if config.keys_file else None
        )
        self._admin_key = (config.admin_key or "").encode()
        self._public_numbers = config.public_metrics
        self._gateway = (
            GatewayHeaders(self._keys.by_name() if self._keys else {})
            if config.trust_gateway_headers
            else None
        )
        self._max_tokens = config.max_tokens
        self._max_tokens_cap = config.max_tokens_cap

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The caller's tenant from `Authorization: Bearer <key>`; None when the server runs
        open (no keys file)."""
        if self._keys is None:
            return None
        tenant = self._keys.authenticate(authorization)
        if tenant is None:
            raise Unauthenticated(
                "send Authorization: Bearer <API key>; this one is missing or unknown"
            )
        return tenant

    def gateway_tenant(
        self, headers: Mapping[str, str], authenticated: Tenant | None
    ) -> Tenant | None:
        """The tenant the inference gateway's headers name (with --trust-gateway-headers;
        else `authenticated`): gateway.py."""
        if self._gateway is None:
            return authenticated
        return self._gateway.tenant(headers, authenticated)

    def authorize_operator(self, authorization: str | None) -> None:
        """Lets the caller read the server's numbers (/metrics, /api/stats): anyone on a
        server without keys or with --public-metrics on, else only an operator key (a
        keys-file entry with role = "operator") or the admin key."""
        if self._keys is None or self._public_numbers:
            return
        secret = bearer_secret(authorization)
        if secret and self._admin_key and hmac.compare_digest(secret, self._admin_key):
            return
        tenant = self._keys.authenticate(authorization)
        if tenant is None or not tenant.operator or tenant is self._keys.anonymous:
            raise Unauthenticated(
                "send Authorization: Bearer <operator key>: a key whose keys-file entry has"
                ' role = "operator", or the admin key (or start with --public-metrics on)'
            )

    def take_tokens(
        self,
        tenant: Tenant | None,
        now: float,
        capacity_rps: Callable[[], float | None],
        count: int = 1,
    ) -> None:
        """Spends `count` of the tenant's tokens (one a request, one a string of a list), all
        or none, at its tier's rate for the live capacity; or refuses the whole request: 413
        for more than the tier's burst (no wait would let it in), else 429 with when to
        retry and the rate now."""
        if tenant is None or self._keys is None or tenant.idle:  # idle: capacity left over
            return
        burst = self._keys.limits[tenant.tier].burst
        if count > burst:
            raise OverTierBurst(
                f"the request holds {count} inputs; the {tenant.tier} tier takes at most"
                f" {burst:g} at once: send them in lists of {math.floor(burst)} or fewer"
            )
        wait_s, bucket = self._keys.take(tenant, now, capacity_rps(), count)
        if wait_s:
            raise RateLimited(
                f"tenant {tenant.name} is over the {tenant.tier} tier's rate of"
                f" {bucket.rate:.3g} requests a second",
                retry_after_s=wait_s,
                limit=bucket.rate,
                reset_s=bucket.seconds_to_full(),
            )

    def check_input(self, text: str) -> None:
        if not isinstance(text, str):
            raise InvalidInput(f"the input must be a str, not {type(text).__name__}")
        if text.isascii() and len(text) <= self._max_input_bytes:
            return  # the common case, without encoding it: ASCII is one byte a character
        try:
            size = len(text.encode())
        except UnicodeEncodeError:
            raise InvalidInput("the input is not valid Unicode text") from None
        if size > self._max_input_bytes:
            raise InputTooLarge(f"the input is {size} bytes; the limit is {self._max_input_bytes}")

    def timeout_s(
        self, timeout_ms: float | None, tenant: Tenant | None, *, first_token: bool = False
    ) -> float:
        """The request's own timeout, capped by the server's (--timeout-ms, or a generation's
        --first-token-timeout-ms for its `first_token`) and by its tier's deadline."""
        cap_ms = self._first_token_timeout_ms if first_token else self._timeout_ms
        if tenant is not None:
            if self._keys is not None:
                tier_ms = self._keys.limits[tenant.tier].timeout_ms
                if tier_ms is not None:
                    cap_ms = min(cap_ms, tier_ms)
            if tenant.timeout_cap_ms is not None:
                cap_ms = min(cap_ms, tenant.timeout_cap_ms)
        if timeout_ms is None:
            return cap_ms / 1e3
        return min(checked_timeout_ms(timeout_ms), cap_ms) / 1e3

    def check_prompt_bytes(
        self,
        prompt: str,
        max_token_bytes: int | None,
        max_tokens: object,
        budget: int,
        *,
        least: int = 1,
    ) -> None:
        """Refuses (413), before any tokenizer runs, a prompt too long for the budget by its
        UTF-8 bytes alone: one token stands for at most `max_token_bytes` of them (None: the
        tokenizer gives no such bound), so it is at least bytes / that many tokens. A 1 MiB
        prompt costs the tokenizer seconds; its byte count, a millisecond. `least`: as
        `new_tokens`'."""
        if max_token_bytes is None:
            return
        size = len(prompt) if prompt.isascii() else len(prompt.encode())
        fewest = -(-size // max_token_bytes)
        limit = _max_tokens(max_tokens, self._max_tokens_cap, least) or 1
        if fewest + limit > budget:
            raise InputTooLarge(
                f"the prompt is {size} bytes, at least {fewest} tokens (a token stands for at"
                f" most {max_token_bytes} bytes); with {limit} new tokens it cannot fit a"
                f" device's budget of {budget} tokens: shorten the prompt"
            )

    def new_tokens(
        self, prompt_tokens: int, max_tokens: object, budget: int, *, least: int = 1
    ) -> int:
        """The most tokens a generation may make: its `max_tokens` (at least `least`: 0
        only where the prompt's log-probabilities are all it asks for), else the server's
        default; refused (413) when the prompt and that many new tokens cannot fit a
        device's budget of `budget` tokens."""
        limit = _max_tokens(max_tokens, self._max_tokens_cap, least)
        if prompt_tokens >= budget:
            raise InputTooLarge(
                f"the prompt is {prompt_tokens} tokens; a device holds {budget} in all,"
                " the prompt and at least one new token: shorten the prompt"
            )
        if limit is None:
            limit = min(self._max_tokens, self._max_tokens_cap, budget - prompt_tokens)
        if prompt_tokens + limit > budget:
            raise InputTooLarge(
                f"the prompt's {prompt_tokens} tokens and max_tokens {limit} do not fit a"
                f" device's budget of {budget} tokens: ask for at most"
                f" {budget - prompt_tokens} new tokens"
            )
        return limit


def checked_timeout_ms(timeout_ms: object) -> float:
    """A request's own timeout as given (a body's field, a header, a library caller's
    argument): a finite number of milliseconds above 0. The one rule for it: the doors
    check what they parse with it, and the engine what it is handed."""
    if isinstance(timeout_ms, bool) or not (
        isinstance(timeout_ms, int | float) and math.isfinite(timeout_ms) and timeout_ms > 0
    ):
        raise InvalidInput("timeout_ms must be a number above 0")
    return float(timeout_ms)


def _max_tokens(given: object, cap: int, least: int = 1) -> int | None:
    if given is None:
        return None
    if isinstance(given, float) and given.is_integer():
        given = int(given)  # a whole JSON number, as JSON Schema's integer takes it
    if isinstance(given, bool) or not isinstance(given, int) or not least <= given <= cap:
        echo = " (0 only with echo and logprobs)" if least else ""
        raise InvalidInput(f"max_tokens must be a whole number from {least} to {cap}{echo}")
    return given


MAX_STOPS = 16
MAX_STOP_CHARS = 256


def stop_strings(stop: object) -> tuple[str, ...]:
    """`stop` as given (a string or a list of them), checked: non-empty, few and short."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise InvalidInput(
            f'"stop" must be a string or a list of at most {MAX_STOPS} strings, each 1 to'
            f" {MAX_STOP_CHARS} characters"
        )
    return tuple(stops)
