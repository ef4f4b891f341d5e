"""Start ranks for a multi-process test (callers carry `@pytest.mark.integration`)."""

from __future__ import annotations

import time
from collections.abc import Callable


def spawn(fn: Callable[..., None], nprocs: int, *args, timeout_s: float = 240.0) -> None:
    """Run fn(rank, *args) in `nprocs` fresh processes (start method "spawn", the environment
    inherited); raises torch's ProcessRaisedException when a rank fails, AssertionError when they
    outlive `timeout_s` seconds, and kills every rank still alive either way."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "ranks timed out"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
