"""Device time that is not idle capacity though no call runs: a device stood free while
online requests waited for it (the batcher's pass between two calls, a policy lingering for
a fuller batch). The Batch API's lines never run then (they go only where no online request
waits), so the share of idle time they used is measured against the rest
(`benchmarks/batch_api.py`). Counted while lines wait, or always with
`--count-online-wait`: a window without lines is then the control that tells whether lines
lengthen it.
"""

from __future__ import annotations

from collections.abc import Callable


class OnlineWait:
    """Seconds during which a free device and waiting online requests met."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._since: float | None = None

    @property
    def open(self) -> bool:
        """Whether a wait is being counted now."""
        return self._since is not None

    def seconds_at(self, now: float) -> float:
        """The seconds counted, with the wait still open at `now`: a scrape mid-linger
        sees it."""
        return self.seconds + (0.0 if self._since is None else now - self._since)

    def update(self, waiting: bool, clock: Callable[[], float]) -> None:
        """The state at one of the batcher's changes: the clock is read only where it flips,
        since this runs at every change of every request."""
        if waiting == self.open:
            return
        now = clock()
        if self._since is None:
            self._since = now
        else:
            self.seconds += now - self._since
            self._since = None
