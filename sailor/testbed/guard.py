"""A guard that hands the ranks' deadline reservations back when the kernel stops running ordinary
threads (`python -m sailor.testbed.guard WATCHED_PID CGROUP...`).

Why. On the build machine's kernel (Linux 6.18, PREEMPT(none), HZ 250), 3 of about 200 rank
launches with reserved compute threads (`testbed.deadline`; 2026-12-05, all three with 4 reserved
ranks, two of them an interleaved pipeline) left every ordinary (SCHED_OTHER) thread of the machine
without a CPU for 59-120 s: the kernel logged "workqueue lockup" on both CPUs and "rcu_preempt
kthread starved ... state=0x0" (runnable, not run), and the ranks, whose communication threads are
ordinary ones, waited until their 2-minute timeout. The reservations alone cannot take that much:
one reserved thread that never blocks got 0.300 of a CPU at 0.3 cores, measured. The fault lies in
how this kernel serves ordinary threads beside deadline ones (its "deadline server"; faults of this
kind were fixed upstream in 2026, e.g. "sched/deadline: Fix 'stuck' dl_server", 115135422562); it
ended each time the reserved threads ended.

What it does. The guard is a process of its own with one thread (no interpreter lock shared with
what it watches), under a small reservation of its own (`deadline.GUARD_CORES`), so it runs while
ordinary threads starve. Every CHECK_EVERY_S it reads how often a watched ordinary process has been
run (`/proc/PID/schedstat`, third field): the stand-in ssh or the profiling driver, which wake at
least ten times a second (`cgroups.PLACE_EVERY_S`). When that count stands still for STARVED_S while
the process is runnable (state R: woken, waiting for a CPU), it returns every deadline thread of the
given cgroups (`RANK_CGROUP/tasks`) to SCHED_OTHER, where their rank cgroups' CFS quotas still hold
them to their device's speed (the emulation without reservations: a pass after a wait runs faster,
`testbed.deadline`), and writes one line on stderr starting with STARVED_LINE. It keeps watching (a
rank placed later is reserved again, and handed back again if it happens again) until the watched
process ends.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from sailor.core.process import die_with_parent
from sailor.testbed import deadline
from sailor.testbed.cgroups import reserved_threads

CHECK_EVERY_S = 0.1
STARVED_S = 1.0
"""How long the watched process may go unrun before the reservations are handed back: 10x the
longest it sleeps between runs (`cgroups.PLACE_EVERY_S`)."""
STARVED_LINE = "testbed: ordinary threads starved"


def run_count(pid: int) -> int | None:
    """How many times process `pid`'s main thread has been put on a CPU (`/proc/PID/schedstat`:
    run time, wait time, run count; Documentation/scheduler/sched-stats.rst), None when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return None


def is_runnable(pid: int) -> bool:
    """Whether process `pid`'s main thread is runnable (state R in `/proc/PID/stat`): waiting for a CPU
    or on one. A sleeping, stopped or dead process is not run because it does not ask to be, which is
    not starvation. False when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] == "R"


def hand_back(cgroups: Iterable[str], rebuild: Callable[[], bool] = deadline.rebuild_accounting) -> int:
    """Return every deadline thread of `cgroups` to SCHED_OTHER (`deadline.clear_deadline`); how many
    were (threads that end meanwhile are skipped). Then, where any was, have the kernel count its
    deadline bandwidth anew (`rebuild`, default `deadline.rebuild_accounting`: this kernel lost the
    bandwidth of the threads handed back, so that later runs' reservations were refused)."""
    n = 0
    for tid in reserved_threads(cgroups):
        try:
            deadline.clear_deadline(tid)
            n += 1
        except OSError:
            continue
    if n:
        with contextlib.suppress(OSError):
            rebuild()
    return n


class Watch:
    """The starvation test of one watched process, fed the time and its run count (`step`)."""

    def __init__(self, starved_s: float = STARVED_S) -> None:
        self.starved_s = starved_s
        self.count: int | None = None
        self.since = 0.0  # when `count` was first seen

    def step(self, now: float, count: int, runnable: bool) -> bool:
        """Whether the process has gone unrun for `starved_s` while runnable, at time `now` (s), given
        its run count then and whether it is runnable (one that is not, or that ran, restarts the
        clock). After a True, the clock restarts."""
        if not runnable or count != self.count:
            self.count, self.since = count, now
            return False
        if now - self.since >= self.starved_s:
            self.since = now
            return True
        return False


def guard(pid: int, cgroups: list[str], *, starved_s: float = STARVED_S, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> int:
    """Watch process `pid` until it ends, handing back the reservations of `cgroups` whenever it goes
    unrun for `starved_s` (module docstring); how many times it did."""
    watch, fired = Watch(starved_s), 0
    while (count := run_count(pid)) is not None:
        if watch.step(clock(), count, is_runnable(pid)):
            fired += 1
            n = hand_back(cgroups)
            print(f"{STARVED_LINE}: process {pid} was not run for {watch.starved_s:g} s; {n} rank thread(s)"
                  " returned from their deadline reservations to their CFS quotas", file=sys.stderr, flush=True)
        sleep(CHECK_EVERY_S)
    return fired


def start(pid: int, cgroups: Iterable[str]) -> subprocess.Popen:
    """Start the guard of process `pid` and the rank cgroups `cgroups` (its stderr is the caller's);
    it ends with `pid`, and with the caller (`die_with_parent`, set by `main`)."""
    return subprocess.Popen([sys.executable, "-m", "sailor.testbed.guard", str(pid), *cgroups], stdin=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or not args[0].isdigit():
        print("usage: python -m sailor.testbed.guard WATCHED_PID CGROUP...", file=sys.stderr)
        return 2
    if run_count(int(args[0])) is None:
        print(f"guard: no process {args[0]}", file=sys.stderr)
        return 2
    missing = [c for c in args[1:] if not Path(c, "tasks").is_file()]
    if missing:
        print(f"guard: {missing[0]} is not a cgroup (no tasks file)", file=sys.stderr)
        return 2
    die_with_parent()
    try:
        deadline.set_deadline(0, deadline.GUARD_CORES, deadline.GUARD_PERIOD_US)
    except OSError as e:
        print(f"testbed: the starvation guard runs without a reservation ({e})", file=sys.stderr, flush=True)
    guard(int(args[0]), args[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
