"""A stand-in `ssh` for the testbed: runs the remote command inside the named node's network namespace
and cgroup, as sshd would run it on that machine (`sh -c COMMAND`).

Takes what `sailor.launch.torchrun.ssh_argv` passes (`-o OPTION`, `-t`/`-tt`/`-T`, `--`, the
destination "user@address", then the command). The destination is a node's address (HOSTS.yaml
lists them) or its name. The command runs in a new session; SIGTERM, SIGINT or SIGHUP to this
process reach its whole process group (closing a real ssh connection hangs up the remote side), and
what is still running after a grace period is killed. While it runs, every rank torchrun starts is
moved into its own cgroup with its device class's per-rank quota (`cgroups.place_ranks`, every 0.1 s),
and `testbed.guard` watches that this process is still being run (else it hands the ranks' deadline
reservations back).
Its exit status is the command's, 255 when the node is unknown (as ssh's when it cannot connect).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from sailor.core.errors import SailorInputError
from sailor.core.process import die_with_parent
from sailor.testbed import guard
from sailor.testbed.cgroups import PLACE_EVERY_S, place_ranks, rank_cgroups
from sailor.testbed.host import enter_argv, locate

GRACE_S = 10.0  # how long the remote command has to end after SIGTERM before SIGKILL
SSH_UNREACHABLE = 255  # ssh's exit status when it cannot connect


def parse(argv: list[str]) -> tuple[str | None, str, str]:
    """(state folder or None, destination, command) from an ssh argv (without the program name).

    Raises:
        SailorInputError: no destination or no command, or --state-dir without a folder.
    """
    state_dir = None
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        if argv[i] == "--state-dir":
            if i + 1 >= len(argv):
                raise SailorInputError("--state-dir needs a folder", source="ssh")
            state_dir, i = argv[i + 1], i + 2
        elif argv[i] in ("-o", "-p", "-l", "-i", "-F"):
            i += 2  # an option with a value
        else:
            i += 1  # -t, -tt, -T, -n, ...
    if i < len(argv) and argv[i] == "--":
        i += 1
    if len(argv) < i + 2:
        raise SailorInputError("expected a destination and a command", source="ssh")
    return state_dir, argv[i], " ".join(argv[i + 1:])


def main(argv: list[str] | None = None) -> int:
    try:
        state_dir, destination, command = parse(sys.argv[1:] if argv is None else argv)
        _, node = locate(destination, state_dir)
    except SailorInputError as e:
        print(e.one_line() if e.source else f"ssh: {e.one_line()}", file=sys.stderr)
        return SSH_UNREACHABLE
    child = subprocess.Popen(enter_argv(node, ["sh", "-c", command]), start_new_session=True,
                             preexec_fn=die_with_parent)  # noqa: PLW1509 - no thread here
    guard.start(os.getpid(), rank_cgroups(node))  # ends with this process

    def hang_up(signum, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
        sys.exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, hang_up)
    while True:  # each rank into its own cgroup as soon as torchrun starts it
        try:
            return child.wait(timeout=PLACE_EVERY_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                place_ranks(node)


if __name__ == "__main__":
    sys.exit(main())
