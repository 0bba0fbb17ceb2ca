"""The connection of a store kept in the Redis of `--result-store redis://host:port/db` (the
status API's records, `shared_records.py`; the Batch API's store, `batch_store_redis.py`):
checked at start, so that a server that cannot reach Redis does not start, closed at close,
and each command run through `StoreHealth`, so that a failure is a 503, never a 500."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit, urlunsplit

from ..errors import StartupError
from .store_health import StoreHealth

if TYPE_CHECKING:
    import redis.asyncio

Result = TypeVar("Result")

REDIS_TIMEOUT_S = 5.0
"""Longest a Redis connect or command may take before the store counts as unavailable."""


def shown(url: str) -> str:
    """`url` as errors and logs may print it: a password in it (`redis://:secret@host`)
    becomes `***`, since startup errors and store-down lines reach logs others read."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address keeps its brackets
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


class RedisClient:
    """One store's connection pool; `redis` is the client to build commands with, `run`
    awaits one."""

    def __init__(self, url: str, health: StoreHealth) -> None:
        try:
            import redis.asyncio
        except ImportError:  # an optional dependency: say which extra brings it
            raise StartupError(
                f"--result-store {shown(url)}: needs the redis package: "
                "pip install 'batchserve[redis]'"
            ) from None
        self._url = shown(url)
        self.redis: redis.asyncio.Redis = redis.asyncio.Redis.from_url(
            url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S
        )
        self._health = health
        self._failures: tuple[type[Exception], ...] = (redis.asyncio.RedisError, OSError)

    async def start(self) -> None:
        import redis

        try:
            await self.redis.ping()
        except redis.RedisError as exc:
            raise StartupError(f"--result-store {self._url}: {exc}") from None

    async def close(self) -> None:
        await self.redis.aclose()

    async def run(self, work: Awaitable[Result]) -> Result:
        return await self._health.run(work, self._failures)
