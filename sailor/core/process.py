"""Process lifetime: a process that must never outlive its parent asks the kernel to signal it when
the parent dies (Linux `prctl(PR_SET_PDEATHSIG)`), so no rank, torchrun agent or ssh session is left
behind by a launcher, a driver or a torchrun that was killed.

`python -m sailor.core.process COMMAND [ARG...]` runs COMMAND (looked up on PATH) in its place, after
asking for SIGTERM when its parent dies: how a launcher starts a program that is not Python, an ssh
session (which hangs up on SIGTERM). It imports nothing else of Sailor, so it starts in the tens of
milliseconds Python itself takes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl option number, linux/prctl.h


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies (kept across exec). A no-op
    where prctl does not exist (not Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


if __name__ == "__main__":
    die_with_parent(signal.SIGTERM)
    os.execvp(sys.argv[1], sys.argv[1:])
