"""`testbed.guard`: the starvation test on hand-made run counts (unit), and, as root with cgroup v1
(skipped, saying which is missing, elsewhere), a real guard handing a reserved thread back to
SCHED_OTHER when the process it watches is not run for `STARVED_S`."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sailor.testbed import guard
from sailor.testbed.deadline import is_deadline
from sailor.testbed.host import support_problem


def test_a_process_not_run_for_the_limit_is_starved_once_then_watched_again():
    w = guard.Watch(starved_s=1.0)
    assert not w.step(0.0, 5, stopped=False)
    assert not w.step(0.5, 7, stopped=False)  # it ran: the clock restarts at 0.5
    assert not w.step(1.4, 7, stopped=False)  # 0.9 s unrun
    assert w.step(1.5, 7, stopped=False)  # 1.0 s unrun
    assert not w.step(2.0, 7, stopped=False)  # the clock restarted at 1.5
    assert w.step(2.5, 7, stopped=False)


def test_a_stopped_process_is_not_starved():
    w = guard.Watch(starved_s=1.0)
    w.step(0.0, 3, stopped=False)
    assert not w.step(5.0, 3, stopped=True)  # SIGSTOP: nobody lets it run, the scheduler is not at fault
    assert not w.step(5.9, 3, stopped=False)
    assert w.step(6.0, 3, stopped=False)


def test_the_guard_hands_back_each_time_and_ends_with_the_watched_process(monkeypatch, capsys):
    counts = iter([1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, None])  # run counts, one per check
    now = [0.0]
    handed: list[list[str]] = []
    monkeypatch.setattr(guard, "run_count", lambda pid: next(counts))
    monkeypatch.setattr(guard, "is_stopped", lambda pid: False)
    monkeypatch.setattr(guard, "hand_back", lambda cgroups: handed.append(list(cgroups)) or 2)

    def sleep(s):
        now[0] += 0.1

    # count 2 first seen at t=0.1, unrun 0.5 s at t=0.6; count 3 first seen at t=0.7, fires at 1.2
    assert guard.guard(42, ["cg/r0", "cg/r1"], clock=lambda: now[0], sleep=sleep, starved_s=0.5) == 2
    assert handed == [["cg/r0", "cg/r1"]] * 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith(guard.STARVED_LINE) and "2 rank thread(s)" in line for line in err)


PROBLEM = support_problem()


@pytest.mark.integration
@pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")
def test_a_real_guard_returns_a_reserved_thread_to_sched_other():
    cg = Path(f"/sys/fs/cgroup/cpu/sailor-guard-test-{uuid.uuid4().hex[:8]}")
    cg.mkdir()
    rank = watched = watch = None
    try:
        rank = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                                 "from sailor.testbed.deadline import set_deadline\n"
                                 "set_deadline(0, 0.1); print('reserved', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
        assert rank.stdout.readline().strip() == "reserved"
        (cg / "cgroup.procs").write_text(str(rank.pid))
        assert is_deadline(rank.pid)
        watched = subprocess.Popen(["sleep", "60"])  # never run again: what a starved process looks like
        watch = subprocess.Popen([sys.executable, "-m", "sailor.testbed.guard", str(watched.pid), str(cg)],
                                 stderr=subprocess.PIPE, text=True)
        line = watch.stderr.readline()
        assert line.startswith(guard.STARVED_LINE) and "1 rank thread(s)" in line, line
        assert not is_deadline(rank.pid)
        watched.kill()
        watched.wait()
        assert watch.wait(timeout=5) == 0  # it ends with the process it watches
    finally:
        for p in (rank, watched, watch):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert not cg.exists() and os.path.exists("/sys/fs/cgroup/cpu")
