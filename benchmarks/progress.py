"""Points done out of the total, with the time left at the pace so far: long runs say where
they are, on stderr, so that stdout stays the table."""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}m{seconds:02d}s"


class Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.started = time.monotonic()

    def step(self, what: str) -> None:
        """One point done; `what` names it."""
        self.done += 1
        elapsed = time.monotonic() - self.started
        left = elapsed / self.done * (self.total - self.done)
        print(f"[{self.done}/{self.total}] {what}  ({_clock(elapsed)} so far, ETA {_clock(left)})",
              file=sys.stderr, flush=True)  # fmt: skip
