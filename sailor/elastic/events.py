"""The trace clock and the event log of `sailor run`.

`Clock`: wall seconds since the controller started, and trace seconds (wall or training seconds
divided by the time scale). `EventLog`: one JSON line per controller event, each stamped with both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

from sailor.core.errors import SailorInputError

POLL_S = 0.05  # how often `sailor run` looks at the trace clock and the runtime's events


class ClockKind(str, Enum):
    """What drives the trace's time axis."""

    WALL = "wall"          # wall seconds since the controller started
    TRAINING = "training"  # seconds spent in training steps (start-up and switches excluded)
    STEPS = "steps"        # training steps taken, one "second" each: a trace replayed step by step, whatever the speed


class EventLog:
    """Appends controller events as JSON lines to `path` (None: kept in memory only; a file that
    holds events already is refused before, by `options.check_run`, unless asked) and hands each
    record to `echo` (the CLI prints the notable ones)."""

    def __init__(self, path: str | None, clock: "Clock", echo: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.path = Path(path) if path else None
        self.clock = clock
        self.echo = echo
        self.records: list[dict[str, Any]] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event; returns the record."""
        rec = {"event": event, "time_s": round(self.clock.wall_s(), 4),
               "trace_time_s": round(self.clock.trace_s(), 4), **fields}
        self.records.append(rec)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if self.echo is not None:
            self.echo(rec)
        return rec


class Clock:
    """Wall time since the controller started, and trace time: wall (or training) seconds, or steps,
    / time_scale.

    The `training` clock replays a trace against the job's own progress, so that start-up and switch
    times of a slow machine do not eat the trace (tests, demos on CPU); it advances by each step's
    `step_time_s` (steps redone after a rollback count again: they took time). The `steps` clock
    advances by 1 per step instead, so a change happens after the same steps on any machine, however
    loaded (tests).
    """

    def __init__(self, time_scale: float, kind: ClockKind = ClockKind.WALL) -> None:
        if not time_scale > 0:
            raise SailorInputError(f"must be > 0, got {time_scale}", source="--time-scale")
        self.time_scale = time_scale
        self.kind = kind
        self.t0 = time.monotonic()
        self.training_s = 0.0

    def wall_s(self) -> float:
        """Seconds since the controller started."""
        return time.monotonic() - self.t0

    def trace_s(self) -> float:
        """Trace seconds now."""
        return (self.wall_s() if self.kind is ClockKind.WALL else self.training_s) / self.time_scale

    def add_step(self, step_time_s: float) -> None:
        """Count one training step of `step_time_s` seconds (the `steps` clock: one)."""
        self.training_s += 1.0 if self.kind is ClockKind.STEPS else step_time_s

    def wait_until(self, trace_s: float, interrupted) -> None:
        """Let trace time reach `trace_s`: sleep (wall clock) or jump (training and steps clocks, where
        nothing trains while waiting); returns early when `interrupted()` is true."""
        if self.kind is not ClockKind.WALL:
            self.training_s = max(self.training_s, trace_s * self.time_scale)
            return
        while self.trace_s() < trace_s and not interrupted():
            time.sleep(POLL_S)
