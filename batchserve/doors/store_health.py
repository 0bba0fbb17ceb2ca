"""What a store that fails (Redis down, a disk error) tells clients and the log, for every
store of records (`shared_records.py`) and of batches (`batch_store.py`,
`batch_store_redis.py`): a failure is StoreUnavailable, which the door answers 503 with
Retry-After, and each change between down and up is logged once (not once a request) with
the driver's detail, which never reaches a client (it may name addresses)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TypeVar

from ..errors import StoreUnavailable

log = logging.getLogger(__name__)

Result = TypeVar("Result")

RETRY_AFTER_S = 1.0
"""What a client refused for a store that failed is told to wait before it tries again."""


class StoreHealth:
    """One store's state, up or down: `store` names it to clients ("result store"), `where`
    to the log (its flag and address)."""

    def __init__(self, store: str, where: str) -> None:
        self._store = store
        self._where = where
        self._down = False

    async def run(self, work: Awaitable[Result], failures: tuple[type[Exception], ...]) -> Result:
        """`work`'s result; StoreUnavailable in place of any of `failures`."""
        try:
            result = await work
        except failures as exc:
            if not self._down:
                self._down = True
                log.error("%s is unavailable: %s: %s", self._where, type(exc).__name__, exc)
            raise StoreUnavailable(
                f"the {self._store} is unavailable ({type(exc).__name__}); retry later",
                RETRY_AFTER_S,
            ) from None
        if self._down:
            self._down = False
            log.warning("%s answers again", self._where)
        return result
