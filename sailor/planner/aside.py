"""The search's node keys computed on a second core (large clusters only).

On a large cluster the heuristic mode reaches almost every (P, micro-batch) node, and each node's
estimate (`prune.node_estimate`) is among the search's costliest parts. The estimates are pure
(the same value whoever computes them, in whatever order: `prune.NodeKeys`), so a forked child
process computes them from the last node in bound order backwards while the search asks for them
from the first: the search takes each key the child has sent by then and computes the others
itself. The keys, so the order of the search and everything it finds, are those of the serial
search (`tests/test_planner_aside.py` checks it). The child sends each key as it has it and ends
when it has them all or when the search ends (`keys_aside` kills it and waits for it); it writes
nothing but its pipe and leaves the parent's state alone (fork: a copy of the parent's memory).

Only clusters of at least ASIDE_MIN_POOLS (zone, GPU type) pools outside exact mode get a child
(so unit tests start no process), and only where the platform forks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct

from sailor.planner.prune import Key, NodeKeys

ASIDE_MIN_POOLS = 64  # (zone, GPU type) pools from which node keys are computed aside
_RECORD = struct.Struct("<iidd")  # P, micro-batch, the key's two components


class AsideKeys(NodeKeys):
    """`NodeKeys` that take the keys a child process computed (`keys_aside`) before computing one."""

    _read_fd: int = -1
    _buffer: bytes = b""

    def key(self, bound: Key, P: int, mbs: int) -> Key:
        if (P, mbs) not in self._keys and self._read_fd >= 0:
            self._drain()
        return super().key(bound, P, mbs)

    def _drain(self) -> None:
        """Take every complete record the child has written so far (the pipe does not block)."""
        while True:
            try:
                chunk = os.read(self._read_fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:  # the child is done (or gone): nothing more will come
                os.close(self._read_fd)
                self._read_fd = -1
                return
            self._buffer += chunk
            whole = len(self._buffer) - len(self._buffer) % _RECORD.size
            for P, mbs, k0, k1 in _RECORD.iter_unpack(self._buffer[:whole]):
                self._keys.setdefault((P, mbs), (k0, k1))
            self._buffer = self._buffer[whole:]


def _child(nodes: NodeKeys, write_fd: int) -> None:
    """In the forked child: every node's key, from the last in bound order, each written as computed."""
    for bound, P, mbs in sorted(nodes.bounds, reverse=True):
        os.write(write_fd, _RECORD.pack(P, mbs, *nodes.key(bound, P, mbs)))


@contextlib.contextmanager
def keys_aside(nodes: NodeKeys, pools: int):
    """`nodes` as `AsideKeys` fed by a forked child while the block runs, on clusters of at least
    ASIDE_MIN_POOLS pools outside exact mode (else `nodes` as they are, no process). The child is
    killed and waited for when the block ends, however it ends."""
    if nodes.exact_mode or pools < ASIDE_MIN_POOLS or not hasattr(os, "fork"):
        yield nodes
        return
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, write, and leave without running the parent's exit handlers
        status = 1
        try:
            os.close(read_fd)
            _child(nodes, write_fd)
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    os.set_blocking(read_fd, False)
    aside = AsideKeys(nodes.ctx, nodes.opts, nodes.exact_mode, nodes.bounds, nodes.sync, nodes._keys)
    aside._read_fd = read_fd
    try:
        yield aside
    finally:
        if aside._read_fd >= 0:
            os.close(aside._read_fd)
            aside._read_fd = -1
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
