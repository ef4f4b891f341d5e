"""Run one function in several fresh rank processes and collect what they report: the process
machinery of `sailor profile` (`runtime.profiler`) and of the network sweep (`runtime.netprofile`).

The driver starts the ranks with `run_ranks`, on this machine or through a `launch` command (ssh);
each rank process runs `rank_main`, joins its process group with `init_rank` and sends JSON messages
back with `rank_message`, one line each on its stdout, prefixed with RANK_MESSAGE. The driver
collects them as they arrive and kills every rank before it returns or raises.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import queue as _queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_MESSAGE = "SAILOR_RANK "  # prefix of a message line a rank prints for the driver
READER_JOIN_S = 30.0  # how long `run_ranks` waits, once its ranks have exited, for their last lines


def run_ranks(target: str, nprocs: int, args: dict[str, Any], *, on_message: Callable[[Any], None] | None = None,
              timeout_s: float = 600.0, port: int | None = None,
              launch: Callable[[int, list[str]], list[str]] | None = None) -> None:
    """Run `target(rank, world, port, args)` ("module:function") in `nprocs` fresh Python processes
    and wait for them: on this machine (`port` None: a free one), or, with `launch`, each as the
    command `launch(rank, argv)` returns, e.g. over ssh on another machine, where `argv` is what follows
    `python` (the arguments dict then travels as its last argument, not on stdin).

    Each rank is `python -m sailor.runtime.profiler`, whose `__main__` is `rank_main` (no re-import of
    the caller's main module, so it works from scripts, stdin and tests; the testbed knows a profiling
    rank by that command line, `testbed.profile.PROFILE_RANK`). A rank reports with `rank_message(obj)`; every message is
    handed to `on_message` as it arrives. Raises RuntimeError with the failing rank's last stderr lines
    if any rank fails or `timeout_s` passes; every rank is killed before this returns or raises.
    """
    port = _free_port() if port is None else port
    payload = json.dumps(args)
    msgs: _queue.Queue = _queue.Queue()
    procs, errs, readers = [], [], []
    try:
        for rank in range(nprocs):
            err = tempfile.TemporaryFile(mode="w+")
            errs.append(err)
            # Each rank in its own session, as torchrun starts the ranks of `sailor train`
            # (start_new_session in torch.distributed.elastic's SubprocessHandler). With the kernel's
            # autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled = 1, the default) a
            # session is one CFS group, and two gloo TP ranks sharing one group ran the `tiny` model's
            # TP-2 pass at ~45-50 ms per micro-batch of 4 on the 2-core build machines, against
            # ~30-37 ms in separate sessions (same code, same machine, torchrun's timing): the
            # profile must see the scheduling a run sees.
            argv = ["-m", "sailor.runtime.profiler", target, str(rank), str(nprocs), str(port)]
            p = subprocess.Popen([sys.executable, *argv] if launch is None else launch(rank, [*argv, payload]),
                                 stdin=subprocess.PIPE if launch is None else subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
            procs.append(p)
            if launch is None:
                p.stdin.write(payload)
                p.stdin.close()
            readers.append(threading.Thread(target=_read_messages, args=(p.stdout, msgs), daemon=True))
            readers[-1].start()
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            _drain(msgs, on_message)
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                raise RuntimeError(f"profiling rank {failed[0]} failed: {_tail(errs[failed[0]])}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"profiling ranks did not finish within {timeout_s:.0f} s")
            time.sleep(0.05)
        for p in procs:
            p.wait()
        for t in readers:  # a rank's last lines may still be in its pipe when it has exited
            t.join(timeout=READER_JOIN_S)
        _drain(msgs, on_message)
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise RuntimeError(f"profiling rank {failed[0]} failed: {_tail(errs[failed[0]])}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for e in errs:
            e.close()


def rank_message(obj: Any) -> None:
    """Send `obj` (JSON-able) from a rank to the driver's `on_message`."""
    print(RANK_MESSAGE + json.dumps(obj), flush=True)


def _read_messages(stream, msgs: _queue.Queue) -> None:
    for line in stream:
        if line.startswith(RANK_MESSAGE):
            msgs.put(json.loads(line[len(RANK_MESSAGE):]))


def _tail(err) -> str:
    err.seek(0)
    lines = [line for line in err.read().splitlines() if line.strip()]
    return " | ".join(lines[-3:]) or "no error output"


def _drain(q: _queue.Queue, on_message) -> None:
    while True:
        try:
            msg = q.get_nowait()
        except _queue.Empty:
            return
        if on_message is not None:
            on_message(msg)


def init_rank(rank: int, world: int, port: int, backend: str, timeout_s: float, addr: str = "127.0.0.1") -> None:
    """Join a `world`-process group (rank `rank`, TCP rendezvous on `addr`:`port`, rank 0's machine)."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=_dt.timedelta(seconds=timeout_s))


def rank_main(argv: list[str]) -> None:
    """Entry point of one rank: `python -m sailor.runtime.profiler MODULE:FUNCTION RANK WORLD PORT [ARGS]`,
    the function's argument dict as JSON in ARGS, else on stdin."""
    import importlib

    from sailor.core.process import die_with_parent

    die_with_parent()  # never outlive the driver
    target, rank, world, port = argv[:4]
    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    fn(int(rank), int(world), int(port), json.loads(argv[4] if len(argv) > 4 else sys.stdin.read()))
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown at exit (see sailor.runtime.worker.main)
