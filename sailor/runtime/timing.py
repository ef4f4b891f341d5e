"""Time phases of work as the device runs them: CUDA events on a GPU, the host clock on the CPU.

On CUDA, kernels run asynchronously: `time.perf_counter()` around a forward measures how long the
host took to queue it, not how long the GPU took to run it. `PhaseClock.mark()` records a CUDA
event on the current stream instead (torch.cuda.Event(enable_timing=True), "CUDA semantics" notes,
"Asynchronous execution"), so the span between two marks is the GPU's time between the two points
of the stream; nothing waits when a mark is made. `totals()` waits once for the last mark and sums
`start.elapsed_time(end)` (milliseconds) per phase, so the caller reads the clock once per step. On
the CPU a mark is `time.perf_counter()`, and the work has run by the time the mark is made.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class PhaseClock:
    """Seconds spent per named phase between marks. Not thread-safe; one per rank and step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._spans: list[tuple[str, object, object]] = []

    def mark(self) -> object:
        """A point in the device's work now queued: a recorded CUDA event, or the host clock (s)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, phase: str, start: object, end: object) -> None:
        """Count the span from mark `start` to mark `end` under `phase`."""
        self._spans.append((phase, start, end))

    def totals(self) -> dict[str, float]:
        """Seconds per phase (phases never added are absent); on CUDA waits for the last mark once."""
        out: dict[str, float] = defaultdict(float)
        if self.cuda and self._spans:
            self._spans[-1][2].synchronize()  # type: ignore[attr-defined]  # then every earlier mark is done
        for phase, start, end in self._spans:
            out[phase] += seconds_between(start, end)
        return dict(out)


def seconds_between(start: object, end: object) -> float:
    """Seconds from mark `start` to mark `end` of a `PhaseClock` (CUDA events: waits for `end`)."""
    if isinstance(start, float):
        return end - start  # type: ignore[operator]
    end.synchronize()  # type: ignore[attr-defined]
    return start.elapsed_time(end) / 1000.0  # type: ignore[attr-defined]


class Stopwatch:
    """One span at a time on the device (CUDA events) or the host: `start()`, work, `stop()` ->
    seconds, waiting for the device only in `stop()`."""

    def __init__(self, device: torch.device) -> None:
        self.clock = PhaseClock(device)
        self._start: object = None

    def start(self) -> None:
        self._start = self.clock.mark()

    def stop(self) -> float:
        return seconds_between(self._start, self.clock.mark())
