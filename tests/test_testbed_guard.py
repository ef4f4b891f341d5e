"""`testbed.guard`: the starvation test and the guard's loop on hand-made run counts, its refusal of
bad arguments (unit), and, as root with cgroup v1 (skipped, saying which is missing, elsewhere), the
loop handing a real reserved process back to SCHED_OTHER."""

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
    assert not w.step(0.0, 5, runnable=True)
    assert not w.step(0.5, 7, runnable=True)  # it ran: the clock restarts at 0.5
    assert not w.step(1.4, 7, runnable=True)  # 0.9 s unrun
    assert w.step(1.5, 7, runnable=True)  # 1.0 s unrun
    assert not w.step(2.0, 7, runnable=True)  # the clock restarted at 1.5
    assert w.step(2.5, 7, runnable=True)


def test_a_process_that_does_not_ask_to_run_is_not_starved():
    w = guard.Watch(starved_s=1.0)
    w.step(0.0, 3, runnable=True)
    assert not w.step(5.0, 3, runnable=False)  # asleep, stopped or a zombie: the scheduler is not at fault
    assert not w.step(5.9, 3, runnable=True)
    assert w.step(6.0, 3, runnable=True)


def test_the_guard_refuses_a_missing_process_or_cgroup(tmp_path, capsys):
    assert guard.main([]) == 2 and guard.main(["abc", "cg"]) == 2 and guard.main(["12"]) == 2
    assert guard.main(["999999999", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "guard: no process 999999999"
    assert guard.main([str(os.getpid()), str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"guard: {tmp_path / 'nope'} is not a cgroup (no tasks file)"


def test_the_guard_hands_back_each_time_and_ends_with_the_watched_process(monkeypatch, capsys):
    counts = iter([1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, None])  # run counts, one per check
    now = [0.0]
    handed: list[list[str]] = []
    monkeypatch.setattr(guard, "run_count", lambda pid: next(counts))
    monkeypatch.setattr(guard, "is_runnable", lambda pid: True)
    monkeypatch.setattr(guard, "hand_back", lambda cgroups: handed.append(list(cgroups)) or 2)

    def sleep(s):
        now[0] += 0.1

    # count 2 first seen at t=0.1, unrun 0.5 s at t=0.6; count 3 first seen at t=0.7, fires at 1.2
    assert guard.guard(42, ["cg/r0", "cg/r1"], clock=lambda: now[0], sleep=sleep, starved_s=0.5) == 2
    assert handed == [["cg/r0", "cg/r1"]] * 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith(guard.STARVED_LINE) and "2 rank thread(s)" in line for line in err)


def test_a_hand_back_has_the_kernel_count_its_deadline_bandwidth_anew(monkeypatch):
    rebuilt, cleared = [], []
    monkeypatch.setattr(guard, "reserved_threads", lambda cgroups: [11, 12])
    monkeypatch.setattr(guard.deadline, "clear_deadline", cleared.append)
    assert guard.hand_back(["cg"], rebuild=lambda: rebuilt.append(1) or True) == 2
    assert cleared == [11, 12] and rebuilt == [1]
    monkeypatch.setattr(guard, "reserved_threads", lambda cgroups: [])  # nothing handed back: nothing to count
    assert guard.hand_back(["cg"], rebuild=lambda: rebuilt.append(1) or True) == 0 and rebuilt == [1]


def test_rebuilding_the_accounting_toggles_the_root_cpusets_balance_flag(tmp_path, monkeypatch):
    from sailor.testbed import deadline

    flag = tmp_path / "cpuset.sched_load_balance"
    writes = []
    real = Path.write_text
    monkeypatch.setattr(Path, "write_text", lambda self, text, *a, **k: writes.append(text) or real(self, text, *a, **k))
    flag.write_text("1\n")
    writes.clear()
    assert deadline.rebuild_accounting(flag) and writes == ["0", "1"] and flag.read_text() == "1"
    flag.write_text("0\n")  # the host turned balancing off: left alone
    writes.clear()
    assert not deadline.rebuild_accounting(flag) and writes == []
    assert not deadline.rebuild_accounting(tmp_path / "absent")  # no cgroup v1 cpuset


PROBLEM = support_problem()


@pytest.mark.integration
@pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")
def test_a_real_guard_returns_a_reserved_thread_to_sched_other(monkeypatch, capsys):
    cg = Path(f"/sys/fs/cgroup/cpu/sailor-guard-test-{uuid.uuid4().hex[:8]}")
    cg.mkdir()
    rank = None
    try:
        rank = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                                 "from sailor.testbed.deadline import set_deadline\n"
                                 "set_deadline(0, 0.1); print('reserved', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
        assert rank.stdout.readline().strip() == "reserved"
        (cg / "cgroup.procs").write_text(str(rank.pid))
        assert is_deadline(rank.pid)
        # a watched process that stays runnable and is never run (what the kernel's fault looked
        # like), then ends
        counts = iter([7] * 12 + [None])
        monkeypatch.setattr(guard, "run_count", lambda pid: next(counts))
        monkeypatch.setattr(guard, "is_runnable", lambda pid: True)
        assert guard.guard(42, [str(cg)], starved_s=1.0, sleep=lambda s: time.sleep(0.1)) == 1
        assert not is_deadline(rank.pid)  # handed back for real
        line = capsys.readouterr().err.strip()
        assert line.startswith(guard.STARVED_LINE) and "1 rank thread(s)" in line, line
    finally:
        if rank is not None:
            rank.kill()
            rank.wait()
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert not cg.exists() and os.path.exists("/sys/fs/cgroup/cpu")
