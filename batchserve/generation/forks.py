"""Where one of `n` choices runs: on its sibling's device. A choice copies its sibling's
prompt rows from that device's cache (`Seq.fork_of`); on another device it would compute the
whole prompt again. So a device that takes such a choice from the line while the sibling runs
elsewhere leaves it here for that device, which takes it next (`GenerationModel.take`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from .request import Generation


class Loop(Protocol):
    """What is read of a device's scheduler (`step_loop.StepLoop`)."""

    device: str
    running: list[Generation]

    @property
    def in_service(self) -> bool: ...


class ForkLines:
    """The choices left for their sibling's device, one line a device, in the order left."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._lines: dict[str, deque[Generation]] = {}
        self._wake = wake
        """Wakes the devices waiting for work (one may be the device a choice is left for)."""

    def __len__(self) -> int:
        return sum(map(len, self._lines.values()))

    def __iter__(self) -> Iterator[Generation]:
        for line in self._lines.values():
            yield from line

    def left_elsewhere(self, gen: Generation, device: str, loops: Iterable[Loop]) -> bool:
        """Whether `gen`, taken from the line by `device`, is one of `n` choices whose
        sibling runs on another device in service: then it is left for that one."""
        sibling = gen.seq.fork_of
        if not sibling:
            return False
        for loop in loops:
            if loop.in_service and any(other.seq.id == sibling for other in loop.running):
                if loop.device == device:
                    return False
                self._lines.setdefault(loop.device, deque()).append(gen)
                self._wake()
                return True
        return False

    def has(self, device: str) -> bool:
        return bool(self._lines.get(device))

    def take(self, device: str) -> Generation | None:
        line = self._lines.get(device)
        if not line:
            return None
        gen = line.popleft()
        if not line:
            del self._lines[device]
        return gen

    def discard(self, gen: Generation) -> None:
        for device, line in list(self._lines.items()):
            if gen in line:
                line.remove(gen)
                if not line:
                    del self._lines[device]

    def out_of_service(self, loops: Iterable[Loop]) -> list[Generation]:
        """The choices left for devices now out of service, taken out to go back in line."""
        return [gen for loop in loops if not loop.in_service
                for gen in self._lines.pop(loop.device, ())]  # fmt: skip

    def clear(self) -> None:
        self._lines.clear()
