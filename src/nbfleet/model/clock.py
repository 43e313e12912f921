"""The injectable clock: pure code asks it for the time and never reads the wall clock."""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock's own timeline (simulated or real)."""
        ...


class ManualClock:
    """A clock that moves only when told to: the simulator's, and tests'."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance_to(self, moment: float) -> None:
        if moment < self._now:
            raise ValueError(f"time cannot go back from {self._now} to {moment}")
        self._now = moment
