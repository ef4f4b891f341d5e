"""The torchrun backend: one shell command per node, started over ssh from HOSTS.yaml.

Each node runs one torchrun agent per block of consecutive plan ranks it holds (see
`sailor.launch.common`), all against the static rendezvous on rank 0's host. `node_specs` gives the
commands as YAML-ready documents (`--dry-run`); `run_over_ssh` starts them and waits.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from sailor.launch.common import RDZV_HOST_VAR, LaunchLayout, LaunchOptions, node_script, ranks_doc
from sailor.launch.hosts import HostsFile, assign_hosts, bare_host

# Never stop to ask for a password: fail instead. Give up on a host that does not answer within 15 s,
# and on a connection that stops answering for a minute, instead of waiting for TCP's own timeouts.
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=15", "-o", "ServerAliveInterval=15",
               "-o", "ServerAliveCountMax=4")
TERMINATE_GRACE_S = 10.0  # how long ssh sessions get to end after SIGTERM before SIGKILL


@dataclass(frozen=True)
class NodeCommand:
    """What runs on one node: ssh destination (None when no hosts are known) and the shell script."""

    node: str
    destination: str | None
    script: str


def node_commands(layout: LaunchLayout, opts: LaunchOptions, hosts: HostsFile | None = None,
                  source: str = "HOSTS.yaml") -> list[NodeCommand]:
    """The per-node scripts; without `hosts` the rendezvous host is the shell variable
    $SAILOR_RDZV_HOST (set it to rank 0's node before running them).

    Raises:
        SailorInputError: `hosts` lacks a (zone, GPU type) of the plan or has too few hosts.
    """
    dest = assign_hosts(layout, hosts, source) if hosts is not None else {}
    rdzv = bare_host(dest[layout.rdzv_node.name]) if hosts is not None else f"${RDZV_HOST_VAR}"
    return [NodeCommand(node=n.name, destination=dest.get(n.name), script=node_script(n, layout, opts, rdzv))
            for n in layout.nodes]


def node_specs(layout: LaunchLayout, opts: LaunchOptions, hosts: HostsFile | None = None,
               source: str = "HOSTS.yaml") -> list[dict[str, Any]]:
    """One YAML-ready document per node: host, zone, GPU, its agents' plan ranks, and the command."""
    cmds = {c.node: c for c in node_commands(layout, opts, hosts, source)}
    docs = []
    for n in layout.nodes:
        c = cmds[n.name]
        docs.append({"kind": "torchrun-node", "node": n.name, "host": c.destination, "zone": n.zone, "gpu": n.gpu,
                     "rendezvous": f"{bare_host(cmds[layout.rdzv_node.name].destination) if hosts else '$' + RDZV_HOST_VAR}"
                                   f":{opts.rdzv_port}",
                     **ranks_doc(n), "command": c.script})
    return docs


def ssh_argv(destination: str, script: str, ssh: str = "ssh") -> list[str]:
    """`ssh` argv running `script` under bash on `destination`. `-tt` gives the remote side a
    terminal, so closing the connection (the launcher ending) hangs up the remote torchrun too."""
    return [ssh, *SSH_OPTIONS, "-tt", "--", destination, "bash -c " + shlex.quote(script)]


def run_over_ssh(commands: Sequence[NodeCommand], ssh: str = "ssh", poll_s: float = 0.2, log: IO | None = None,
                 timeout_s: float | None = None) -> int:
    """Start every node's script over ssh at once and wait for all of them (at most `timeout_s`
    seconds: then TimeoutError); their output goes to `log` (an open text file: stdout and stderr
    together), else to this process's stdout and stderr, a whole line at a time (`_forward_lines`).

    The first node to fail ends the others (SIGTERM, then SIGKILL after TERMINATE_GRACE_S); so does
    an exception or Ctrl-C here, so no ssh session outlives this call.

    Returns:
        0 when every node succeeded, else the first non-zero ssh exit status.
    """
    assert all(c.destination for c in commands), "run_over_ssh needs a host for every node"
    procs: list[subprocess.Popen] = []
    copiers: list[threading.Thread] = []
    lock = threading.Lock()
    out, err = (log, log) if log is not None else (sys.stdout, sys.stderr)
    status = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        for c in commands:
            p = subprocess.Popen(ssh_argv(c.destination, c.script, ssh), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT if log is not None else subprocess.PIPE)
            procs.append(p)
            for src, dst in ((p.stdout, out), (p.stderr, err)):
                if src is not None:
                    copiers.append(threading.Thread(target=_forward_lines, args=(src, dst, lock), daemon=True))
                    copiers[-1].start()
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                status = failed[0]
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the nodes' commands ran past {timeout_s:g} s")
            time.sleep(poll_s)
        if not status:
            status = next((p.returncode for p in procs if p.returncode), 0)
    finally:
        _end_all(procs)
        for t in copiers:  # the pipes end with the sessions (a process they left holding one: not waited for)
            t.join(timeout=TERMINATE_GRACE_S)
    return status


def _forward_lines(src: IO[bytes], dst: IO[str], lock: threading.Lock) -> None:
    """Copy `src`'s lines to `dst` until its end, each whole and under `lock`. Nodes writing straight
    into one file interleave within a line: an unbuffered Python (the ranks run with
    PYTHONUNBUFFERED) writes a print's pieces one by one, and two nodes' "up on h1" and "up on h2"
    came out as "up onup on  h1h2"."""
    with src:
        for line in iter(src.readline, b""):
            with lock:
                dst.write(line.decode(errors="replace"))
                dst.flush()


def _end_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
