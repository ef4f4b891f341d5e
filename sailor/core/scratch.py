"""Scratch folders that never outlive the process that made them, however it ends.

`scratch_dir(prefix)` is `tempfile.TemporaryDirectory` plus a watcher: a `sh` process, in a session
of its own, that blocks reading a pipe whose only writer is this process. On any normal way out
(return, exception, KeyboardInterrupt) the context manager removes the folder itself, then closes the
pipe, and the watcher, finding nothing left, exits. When the process dies without unwinding
(SIGKILL, the OOM killer, a signal it has no handler for), the kernel closes the pipe: the watcher
reads end-of-file and removes the folder. It retries for up to `WATCH_RETRY_S` seconds, since
children of the dead process (ranks ended by their parent-death signal, torchrun agents tearing
down) may still write into the folder for a moment, then exits.

The watcher runs in its own session so that a Ctrl-C at the terminal, or a kill of the caller's
process group, does not end it before it has done its work; its output goes nowhere, so it never
holds open a pipe that someone reads the caller's output from. No Python is started: `sh` takes
about a millisecond.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator

WATCH_RETRY_S = 10.0  # how long the watcher keeps trying to remove the folder after its owner died
_RETRY_PAUSE_S = 0.2

# $1: the folder. `cat` returns at end-of-file, when the owner has closed the pipe or died.
_WATCH = ('cat >/dev/null; i=0; while [ -e "$1" ] && [ "$i" -lt "$2" ]; do'
          ' rm -rf -- "$1" 2>/dev/null || sleep "$3"; i=$((i+1)); done')


def start_watcher(path: str) -> subprocess.Popen:
    """Start the watcher of the folder `path` (module docstring); its stdin is the pipe to close."""
    return subprocess.Popen(
        ["sh", "-c", _WATCH, "sailor-scratch-watch", path, str(int(WATCH_RETRY_S / _RETRY_PAUSE_S)),
         str(_RETRY_PAUSE_S)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[str]:
    """A new temporary folder (its path) named `prefix` + random letters in the temp folder
    (`TMPDIR`), removed when the block ends and, through the watcher, when the process is killed
    (module docstring)."""
    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    try:
        watcher = start_watcher(tmp.name)
    except BaseException:
        tmp.cleanup()
        raise
    try:
        yield tmp.name
    finally:
        try:
            tmp.cleanup()  # first: the watcher must not remove files while this process still does
        finally:
            watcher.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                watcher.wait(timeout=1.0)  # it finds nothing left and exits at once
