"""A discrete-event engine: a heap of (time, sequence) ordered events and a clock.

Events at the same time run in the order they were scheduled, so a run depends
only on its inputs and seed. The engine owns a :class:`ManualClock`, which it hands
to the policies as their ``Clock``: the same policy objects run live on a real
clock and here on simulated time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from nbfleet.model.clock import ManualClock

Action = Callable[[], None]


@dataclass(order=True)
class _Event:
    at: float
    seq: int
    action: Action = field(compare=False)
    cancelled: bool = field(default=False, compare=False)


class EventHandle:
    """Lets the scheduler of an event cancel it (e.g. a timer made moot)."""

    def __init__(self, event: _Event) -> None:
        self._event = event

    @property
    def at(self) -> float:
        return self._event.at

    def cancel(self) -> None:
        self._event.cancelled = True


class Engine:
    def __init__(self, start: float = 0.0) -> None:
        self.clock = ManualClock(start)
        self._heap: list[_Event] = []
        self._seq = 0
        self.processed = 0

    @property
    def now(self) -> float:
        return self.clock.now()

    def at(self, moment: float, action: Action) -> EventHandle:
        if moment < self.now:
            raise ValueError(f"cannot schedule in the past ({moment} < {self.now})")
        event = _Event(moment, self._seq, action)
        self._seq += 1
        heapq.heappush(self._heap, event)
        return EventHandle(event)

    def after(self, delay: float, action: Action) -> EventHandle:
        if delay < 0:
            raise ValueError("delay must not be negative")
        return self.at(self.now + delay, action)

    @property
    def pending(self) -> int:
        return sum(1 for e in self._heap if not e.cancelled)

    def run(self, until: float | None = None,
            progress: Callable[[float], None] | None = None) -> int:
        """Run events in order until the heap empties or the next is past ``until``.

        Returns the number of events run; ``progress(now)`` is called every 10,000.
        """
        ran = 0
        while self._heap:
            event = self._heap[0]
            if until is not None and event.at > until:
                break
            heapq.heappop(self._heap)
            if event.cancelled:
                continue
            self.clock.advance_to(event.at)
            event.action()
            ran += 1
            if progress is not None and ran % 10_000 == 0:
                progress(self.now)
        if until is not None and until > self.now:
            self.clock.advance_to(until)
        self.processed += ran
        return ran
