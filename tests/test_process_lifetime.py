"""No rank outlives the process that started it, even when that one is killed while the rank is still
importing torch (seconds on a loaded machine): torchrun starts its workers in sessions of their own,
so killing a launch's process groups (a start timeout, `launcher.kill_groups`) reaches a worker only
through its parent-death signal (`core.process.die_with_parent`), which must be set before torch's
imports. Before it was, a launch killed during its workers' imports left them running, connecting to
the next launch's rendezvous on the same port.

Integration tests (they start processes): a parent starts `sailor.runtime.worker` (rank 1 of 2,
waiting for a rank 0 that never comes) or a pool process `sailor.runtime.inplace` (waiting for an
epoch that is never published) in a session of its own, as torchrun and the live pool do, and is
SIGKILLed once the child has begun loading torch; the child must end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARENT = ("import subprocess, sys, time\n"
          "child = subprocess.Popen(sys.argv[1:], start_new_session=True)\n"
          "print(child.pid, flush=True)\n"
          "time.sleep(600)\n")


def _loading_torch(pid: int) -> bool:
    try:
        return "torch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(cond, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """Rank 1 of a 2-rank plan whose rank 0 never comes (its rendezvous port is closed)."""
    from sailor.plan.spec import Plan
    from sailor.runtime.command import WorkerSettings

    job = tmp_path / "job.json"
    job.write_text(json.dumps({"model": "tiny", "global_batch_size": 8}))
    plan = tmp_path / "plan.json"
    Plan.model_validate({"micro_batch_size": 2, "stages": [[0, 6]], "pipelines": [
        {"microbatches": 2, "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}]}] * 2}).save(plan)
    argv = WorkerSettings(plan=str(plan), job=str(job), steps=4, timeout_s=600.0).argv()
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    return argv, env


def _pool_process(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """Process 0 of a live pool whose first epoch is never published."""
    return ["-m", "sailor.runtime.inplace", str(tmp_path), "0", "0"], {}


@pytest.mark.integration
@pytest.mark.parametrize("child", [_worker, _pool_process], ids=["worker", "pool_process"])
def test_a_rank_ends_when_its_parent_is_killed_during_its_imports(tmp_path, child):
    argv, env = child(tmp_path)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, sys.executable, *argv], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, **env}, start_new_session=True)
    pid = int(parent.stdout.readline())
    try:
        assert _wait(lambda: _loading_torch(pid) or not _alive(pid), 120), "the child never began importing torch"
        assert _alive(pid), "the child ended before its parent was killed"
        parent.kill()
        parent.wait()
        assert _wait(lambda: not _alive(pid), 60), f"process {pid} outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
