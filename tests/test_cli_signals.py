"""Ctrl-C (SIGINT) and SIGTERM reaching a `sailor` command (`sailor.cli.main`): one line on stderr,
exit status 130 or 143, and everything on the way unwound (its `finally` blocks run).

The unit tests run `main` in this process with the command replaced by one that signals this very
process (SIGINT only: without the handler under test a SIGTERM would end the test run). The
integration test signals a real `sailor profile` of the tiny model, as the testbed's profiler stops
its busy ones (SIGTERM, with SIGINT ignored as in a script's background job): its ranks and its
scratch folder must go, not wait for the SIGKILL 10 s later."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from conftest import own_processes

import sailor.cli as cli


def _main_with(command, monkeypatch, capsys) -> tuple[int, list[str]]:
    """Run `cli.main` with a typer app whose one command is `command` (typer's own handling of a
    KeyboardInterrupt included); (exit status, stderr lines)."""
    app = typer.Typer()
    app.command()(command)
    monkeypatch.setattr(cli, "_register", lambda: None)
    monkeypatch.setattr(cli, "app", app)
    monkeypatch.setattr(sys, "argv", ["sailor"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    return e.value.code, capsys.readouterr().err.splitlines()


def test_sigint_unwinds_the_command_and_exits_130_with_one_line(monkeypatch, capsys):
    unwound = []

    def command():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the signal's handler raises here
        finally:
            unwound.append(True)

    # Python's own SIGINT handler, as an interactive shell starts it: a test run started as a
    # background job inherits SIGINT ignored, which `main` keeps (the next test)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, err = _main_with(command, monkeypatch, capsys)
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)
    assert (code, err, unwound) == (130, ["interrupted (SIGINT)"], [True])
    assert after is signal.default_int_handler  # handed back after the command


def test_a_sigint_ignored_at_start_stays_ignored(monkeypatch, capsys):
    def command():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code, err = _main_with(command, monkeypatch, capsys)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)
    assert (code, err) == (0, [])


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_sailor_profile_removes_its_ranks_and_folder(tmp_path, sig):
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    job = Path(__file__).parents[1] / "examples" / "tiny_job.yaml"
    # SIGINT ignored as a script's background job has it, when SIGTERM is what stops it
    keep_sigint = signal.SIG_IGN if sig == signal.SIGTERM else signal.SIG_DFL
    with own_processes() as alive:
        proc = subprocess.Popen([sys.executable, "-m", "sailor", "profile", "--job", str(job), "--tp", "1",
                                 "--mbs", "1", "--repeats", "1000", "--out", str(tmp_path / "p.json")],
                                env=dict(os.environ, TMPDIR=str(scratch)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, keep_sigint))
        try:
            deadline = time.monotonic() + 120
            while not any("sailor.runtime.profiler" in cmd for _, cmd in alive()):  # its ranks started
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.1)
            assert [f.name[:15] for f in scratch.glob("sailor-*")] == ["sailor-profile-"]
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 128 + sig, err
            assert err.splitlines()[-1:] == [f"{'interrupted' if sig == signal.SIGINT else 'terminated'}"
                                             f" ({signal.Signals(sig).name})"]
            assert list(scratch.glob("sailor-*")) == []  # removed by sailor itself, not its watcher
            end = time.monotonic() + 5  # (exited children may still be on their way out)
            while alive() and time.monotonic() < end:
                time.sleep(0.05)
            assert alive() == []
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
            for pid, _ in alive():
                os.kill(pid, signal.SIGKILL)
