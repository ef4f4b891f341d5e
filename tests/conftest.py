"""Shared fixtures: where the public Sailor reference data lives (../shared next to the repo root, or
the folder the SAILOR_REFERENCE environment variable names), and the two test tiers.

Tiers: a unit test starts no process; a test that starts one (torchrun ranks, the CLI in a
subprocess, ssh stand-ins, namespaces) carries `@pytest.mark.integration`. The rule is enforced: in
a test without the marker, starting a process raises (`_unit_tests_start_no_process`), and a scratch
folder (`core.scratch`) gets no watcher process. The unit tier alone is `pytest -m "not integration"`."""

import contextlib
import io
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from sailor.core import scratch

SAILOR_REF = Path(os.environ.get("SAILOR_REFERENCE")
                  or Path(__file__).resolve().parents[2] / "shared" / "reference" / "sailor")


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Tests (and the processes they start) keep machine profiles in a folder of their own, never
    in the user's cache (`sailor.runtime.machine.cache_dir`)."""
    old = os.environ.get("SAILOR_CACHE_DIR")
    os.environ["SAILOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("sailor-cache"))
    yield
    if old is None:
        os.environ.pop("SAILOR_CACHE_DIR", None)
    else:
        os.environ["SAILOR_CACHE_DIR"] = old


class ProcessInUnitTest(RuntimeError):
    """A test without the `integration` marker tried to start a process."""


class _NoWatcher:
    """Stands in for `core.scratch.start_watcher`'s process in unit tests: the folder is removed by
    the block's end alone (`test_scratch` runs the real watcher)."""

    def __init__(self, path: str) -> None:
        self.stdin = io.BytesIO()

    def wait(self, timeout: float | None = None) -> int:
        return 0


def _refuse_processes(item) -> list[tuple[object, str, object]]:
    """Make Popen (subprocess.run and check_output use it), fork and posix_spawn raise
    ProcessInUnitTest; returns what to put back."""
    def refuse(*args, **kwargs):
        raise ProcessInUnitTest(f"{item.nodeid} starts a process: mark it @pytest.mark.integration")

    class NoPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            refuse()

    saved = [(subprocess, "Popen", subprocess.Popen), (scratch, "start_watcher", scratch.start_watcher)]
    subprocess.Popen = NoPopen
    scratch.start_watcher = _NoWatcher  # a scratch folder's watcher is a process: integration tests have it
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            saved.append((os, name, getattr(os, name)))
            setattr(os, name, refuse)
    return saved


def pytest_sessionstart(session):
    """matplotlib lists the machine's fonts with `fc-list` (a process) the first time it is imported
    on a machine without its font cache: build that cache here, before any unit test refuses processes."""
    with contextlib.suppress(ImportError):
        import matplotlib.font_manager  # noqa: F401


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Unit tests (no `integration` marker) start no process, in the test or in any fixture it sets
    up (a module-scoped fixture starting ranks is caught too)."""
    saved = [] if item.get_closest_marker("integration") else _refuse_processes(item)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@pytest.fixture
def sailor_ref() -> Path:
    """The Sailor reference folder; skips the test with the reason when ../shared is absent."""
    if not SAILOR_REF.is_dir():
        pytest.skip(f"public Sailor reference data not found at {SAILOR_REF} (../shared is absent;"
                    " set SAILOR_REFERENCE to its folder)")
    return SAILOR_REF


def _live(*, with_env: bool = False):
    """(pid, command line, environment entries or []) of every other live (not zombie) process
    this user may read."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if with_env else []
            except OSError:
                continue
            if state != "Z":
                yield int(pid), cmd, env


def live_processes(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of other live (not zombie) processes whose command line mentions
    `marker`: used to check that nothing a test started outlives it."""
    return [(pid, cmd) for pid, cmd, _ in _live() if marker in cmd]


TOKEN_ENV = "SAILOR_TEST_TOKEN"


@contextlib.contextmanager
def own_processes():
    """Mark every process started inside the block with a unique token (children inherit it through
    the environment, whatever their command line, and keep it when reparented); yields a function
    that lists (pid, command line) of the marked processes still alive. A test that checks it left
    nothing behind looks only at these, never at other tests' or users' processes."""
    token = uuid.uuid4().hex
    old = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = token
    try:
        yield lambda: _marked(f"{TOKEN_ENV}={token}".encode())
    finally:
        if old is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = old


def _marked(entry: bytes) -> list[tuple[int, str]]:
    return [(pid, cmd) for pid, cmd, env in _live(with_env=True) if entry in env]


@pytest.fixture(scope="session")
def reference_losses() -> list[float]:
    """Per-step losses of 60 steps of the tiny model (global batch 8, seed 0) trained in one process:
    what every elastic run (any plans, switches, rollbacks) must reproduce."""
    import torch

    from sailor.runtime.data import load_corpus
    from sailor.runtime.reference import train_reference
    from sailor.specs.job import JobSpec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # this tiny model on 2 busy cores: extra threads only slow it down
    try:
        losses, _ = train_reference(JobSpec(model="tiny", global_batch_size=8), steps=60, seed=0, corpus=load_corpus())
    finally:
        torch.set_num_threads(threads)
    return losses


def pytest_terminal_summary(terminalreporter) -> None:
    """One report line with the mutated inputs tried per reader (tests/test_bad_input.py)."""
    import sys
    mutate = sys.modules.get("mutate")
    if mutate is not None and mutate.TRIED:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(mutate.TRIED.items()))
        terminalreporter.write_line(f"bad-input cases tried per reader: {counts} (total {sum(mutate.TRIED.values())})")
