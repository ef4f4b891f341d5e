"""The thread that posts a CPU rank's point-to-point transfers, off its compute thread (torch-free).

On a GPU the compute thread only enqueues a pipeline transfer: it runs on its NCCL communicator's
stream, and the NIC and copy engines move the bytes beside the busy SMs. Under gloo the thread that
calls `isend` writes the message into the socket itself when the peer's receive is already posted
(gloo's tcp pair writes from the caller; its loop thread only writes what the caller could not), and
posting an `irecv` writes a notification to the peer. On the testbed (`sailor.testbed`), whose veths
have segmentation offload off, a 32 KiB message is ~23 frames through TCP, the qdisc and routing.
When the rank's compute thread did that, a device's CPU quota throttled its transfers: 0.17-0.31 ms
of CPU per send (median) on the testbed, against 0.013 ms on unshaped loopback; the post thread now
carries 8-10 ms of CPU per step and rank of a two-stage pipeline across the testbed's links
(`benchmarks/testbed.py`'s pp_mixed and pp_cross_region), 27-67 ms of wall time at their quotas.

It also keeps gloo's socket loop from spinning. gloo handles a socket's events only when its thread
can take the pair's lock (`Pair::handleEvents` tries the lock and returns if another thread holds
it, gloo/transport/tcp/pair.cc), and its epoll is level-triggered: while a posting thread holds the
lock, the loop thread polls in a busy loop. A compute thread holds it in the middle of a send, and
on the testbed such a thread is throttled by its quota or waits in a loaded run queue. In the
planner's interleaved plan (4 ranks of 0.3 cores, 1-minute load 13-37), one `gloo_tcp_loop` thread
per rank used 58-86 s of CPU in a 2-step run and 6-9 s in a 12-step one, stalling the ranks; with
the post thread, at most 0.11 s.

`PostThread` is one daemon thread per process that runs the calls submitted to it (the `isend`s and
`irecv` posts of `pipeline.P2P` on CPU), in submission order: one thread, one FIFO queue, so each
channel's posting order, on which message matching rests (`messages` module docstring), is the one
the rank's program submits. Its OS name is THREAD_NAME, which the testbed's `cgroups.COMM_THREADS`
lists: it runs with torch's communication threads, outside the device quotas. The thread lives as
long as its process (a daemon: it never holds up the process's exit).
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

THREAD_NAME = "sailor_p2p"
"""The OS name (`/proc/PID/task/TID/comm`, at most 15 bytes) of every process's `PostThread`."""

PR_SET_NAME = 15  # prctl option (linux/prctl.h)


def name_os_thread(name: str) -> bool:
    """Set the calling thread's OS name to `name` (its first 15 bytes: the kernel's limit) with
    prctl(PR_SET_NAME); False where libc has no prctl (not Linux) or the call fails."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0


class PostThread:
    """A daemon thread named `name` (Python's name and the OS's) running submitted calls one at a
    time, in submission order."""

    def __init__(self, name: str = THREAD_NAME) -> None:
        self.name, self.pid = name, os.getpid()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        name_os_thread(self.name)
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(e)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue fn(*args); its Future holds the result, or the exception it raised. Raises
        RuntimeError once the thread is closed."""
        if not self._thread.is_alive():
            raise RuntimeError(f"post thread {self.name} has ended")
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def close(self) -> None:
        """Run what is queued, then end the thread (waits for it)."""
        self._queue.put(None)
        self._thread.join()


_shared: PostThread | None = None
_shared_lock = threading.Lock()


def shared_post_thread() -> PostThread:
    """This process's one PostThread, started at the first call (again in a forked child, which
    inherits no thread)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.pid != os.getpid():
            _shared = PostThread()
        return _shared
