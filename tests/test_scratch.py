"""`core.scratch.scratch_dir`: the folder goes when the block ends, by return or exception, and when
its process is SIGKILLed (no Python code runs then: the watcher removes it). Integration tests: each
starts the watcher process, and the last one a Python child that owns the folder. Every folder is
made in the test's own temp folder (TMPDIR), every process is one the test started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import own_processes

from sailor.core.scratch import WATCH_RETRY_S, scratch_dir

pytestmark = pytest.mark.integration


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch) -> Path:
    """TMPDIR of this process and its children: a folder of the test's own."""
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    return folder


def _wait_gone(alive, path: Path, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while (alive() or path.exists()) and time.monotonic() < end:
        time.sleep(0.05)


@pytest.mark.parametrize("raises", [False, True])
def test_the_folder_and_its_watcher_go_when_the_block_ends(tmpdir_env, raises):
    with own_processes() as alive:
        with pytest.raises(RuntimeError) if raises else contextlib.nullcontext():
            with scratch_dir("sailor-test-") as path:
                assert Path(path).parent == tmpdir_env and Path(path).name.startswith("sailor-test-")
                (Path(path) / "sub").mkdir()
                (Path(path) / "sub" / "f").write_text("x")
                end = time.monotonic() + 10  # (until it has exec'd sh, it shows this process's command line)
                while not any("sailor-scratch-watch" in cmd for _, cmd in alive()) and time.monotonic() < end:
                    time.sleep(0.02)
                assert any("sailor-scratch-watch" in cmd for _, cmd in alive())  # sh, and its cat
                if raises:
                    raise RuntimeError("boom")
        assert not Path(path).exists()  # removed by the block itself, at once
        _wait_gone(alive, Path(path), 5.0)
        assert alive() == []
    assert list(tmpdir_env.iterdir()) == []


def test_the_folder_of_a_sigkilled_process_is_removed(tmpdir_env):
    child = ("import sys, time\n"
             "from sailor.core.scratch import scratch_dir\n"
             "with scratch_dir('sailor-test-') as path:\n"
             "    open(path + '/f', 'w').write('x')\n"
             "    print(path, flush=True)\n"
             "    time.sleep(600)\n")
    with own_processes() as alive:
        proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        try:
            path = Path(proc.stdout.readline().strip())
            assert path.parent == tmpdir_env and (path / "f").exists()
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            _wait_gone(alive, path, WATCH_RETRY_S + 5)
            assert not path.exists()
            assert alive() == []  # the watcher ended too
        finally:
            for pid, _ in alive():
                os.kill(pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()

