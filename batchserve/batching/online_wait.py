"""Device time that is not idle capacity though no call runs: a device stood free while
online requests waited for it (the batcher's pass between two calls, a policy lingering for
a fuller batch). The Batch API's lines never run then (they go only where no online request
waits), so the share of idle time they used is measured against the rest
(`benchmarks/batch_api.py`). Counted only while lines wait: otherwise nothing could use it.
"""

from __future__ import annotations


class OnlineWait:
    """Seconds during which a free device and waiting online requests (and lines) met."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._since: float | None = None

    @property
    def open(self) -> bool:
        return self._since is not None

    def update(self, now: float, waiting: bool) -> None:
        """The state at `now`, read at each change: the interval since the last is counted
        if online requests waited for a free device through it."""
        if self._since is not None:
            self.seconds += now - self._since
        self._since = now if waiting else None
