"""A rank's device speed as a SCHED_DEADLINE reservation of its compute thread: `cores` of a CPU in
every DEADLINE_PERIOD_US, enforced by the kernel's deadline scheduler (sched(7), "SCHED_DEADLINE";
Documentation/scheduler/sched-deadline.rst), on top of the rank cgroup's CFS quota
(`cgroups.create_cgroups`), which still caps the rank's other threads.

Why not the CFS quota alone: a quota is a budget per CFS period of at least 1 ms of CPU
(`spec.MIN_QUOTA_US`), and a rank that waits (for a neighbour's activation, a gradient, a
collective) leaves it unspent, so the pass after a wait runs at a full core until the budget is
gone. A GPU that waited computes no faster afterwards. Measured on the 2-core build machine (a
thread that sleeps 5 ms, then computes 1 ms or 5 ms of CPU; 100 rounds, median wall time; quiet,
2026-12-05): in a cgroup of 0.3 cores (1000 µs per 3334 µs) the 1 ms took 1.00 ms and the 5 ms 14.9 ms,
where a device of 0.3 cores takes 3.33 and 16.7 ms; under SCHED_DEADLINE (100 µs per 333 µs)
3.37 and 16.71 ms, and 6.70 / 33.37 ms at 0.15 cores (50 µs per 333 µs; ideal 6.67 / 33.3). The
same cause made pipelines on the testbed faster than their profile (`benchmarks/testbed.py`, quiet,
2026-12-05: a 0.3-core stage feeding a 0.15-core one ran its passes in 0.071 s per step where the
profile, every rank busy, said 0.137 s; +49.6 % predicted against measured step time). A deadline
task is replenished `runtime` every period and throttled when it is spent (the budget after a wait
is at most one period's runtime), and the kernel admits it only while the deadline tasks of the
machine stay under `sched_rt_runtime_us / sched_rt_period_us` of every CPU (`bandwidth_limit`).

Only a rank's main thread (the one computing: the runtime runs each rank's passes on it) gets the
reservation; with SCHED_FLAG_RESET_ON_FORK the threads it starts later (a process group's gloo
threads) are ordinary threads, which `cgroups.place_ranks` moves out of the quota. A deadline task
keeps the affinity of every CPU (the kernel refuses one pinned narrower than its root domain).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from pathlib import Path

DEADLINE_PERIOD_US = 500
"""Period of every rank's reservation (µs): the longest a rank's budget waits for its refill, short
against a pass (the `tiny` model's block takes 2-3 ms of CPU per micro-batch of 2). The kernel takes
periods down to `kernel.sched_deadline_period_min_us` (100 µs by default)."""

GUARD_CORES = 0.02
"""The reservation of each `testbed.guard` (cores; 200 µs every GUARD_PERIOD_US): one check reads a
few small /proc files, ~0.1 ms of CPU."""
GUARD_PERIOD_US = 10_000

SCHED_OTHER, SCHED_DEADLINE = 0, 6  # include/uapi/linux/sched.h
SCHED_FLAG_RESET_ON_FORK = 0x01
SCHED_ATTR_SIZE = 48  # SCHED_ATTR_SIZE_VER0: size, policy, flags, nice, priority, runtime, deadline, period
SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}  # arch/x86/entry/syscalls/syscall_64.tbl; asm-generic/unistd.h


def sched_attr(cores: float, period_us: int = DEADLINE_PERIOD_US) -> bytes:
    """The `struct sched_attr` (include/uapi/linux/sched/types.h, version 0: 48 bytes, native byte
    order) of a deadline reservation of `cores` (0 < cores <= 1) of a CPU per `period_us`, its
    deadline the period, reset on fork."""
    if not 0 < cores <= 1:
        raise ValueError(f"a deadline reservation takes 0 < cores <= 1, got {cores}")
    period_ns = period_us * 1000
    return struct.pack("=IIQiIQQQ", SCHED_ATTR_SIZE, SCHED_DEADLINE, SCHED_FLAG_RESET_ON_FORK, 0, 0,
                       round(cores * period_ns), period_ns, period_ns)


def set_deadline(tid: int, cores: float, period_us: int = DEADLINE_PERIOD_US) -> None:
    """Give thread `tid` (0: the calling thread) a deadline reservation of `cores` per `period_us`
    (`sched_attr`).

    Raises:
        OSError: the kernel refused (EBUSY: the machine's deadline bandwidth is taken; EPERM: not
            root, or the thread is pinned to fewer CPUs than the machine's; ENOSYS/unknown machine:
            no sched_setattr).
    """
    _sched_setattr(tid, sched_attr(cores, period_us), f"SCHED_DEADLINE, {cores:g} cores")


def clear_deadline(tid: int) -> None:
    """Return thread `tid` to SCHED_OTHER at nice 0 (what a thread has before `set_deadline`).
    Raises OSError as `set_deadline` does (ESRCH: the thread is gone)."""
    _sched_setattr(tid, struct.pack("=IIQiIQQQ", SCHED_ATTR_SIZE, SCHED_OTHER, 0, 0, 0, 0, 0, 0), "SCHED_OTHER")


def _sched_setattr(tid: int, attr: bytes, what: str) -> None:
    number = SYS_SCHED_SETATTR.get(platform.machine())
    if number is None:
        raise OSError(f"sched_setattr's system call number on {platform.machine()} is not known here")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, ctypes.c_int(tid), ctypes.create_string_buffer(attr), ctypes.c_uint(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sched_setattr({what}) of thread {tid}: {os.strerror(err)}")


def is_deadline(tid: int) -> bool:
    """Whether thread `tid` runs under SCHED_DEADLINE (`policy` in /proc/TID/sched). Raises OSError
    when it is gone."""
    for line in Path(f"/proc/{tid}/sched").read_text().splitlines():
        if line.startswith("policy"):
            return int(line.split(":")[1]) == SCHED_DEADLINE
    return False


ROOT_CPUSET_BALANCE = "/sys/fs/cgroup/cpuset/cpuset.sched_load_balance"
"""The root cpuset's load-balance flag (cgroup v1), the one control whose change makes the kernel
rebuild its scheduling domains (`rebuild_accounting`)."""


def rebuild_accounting(flag: str | Path = ROOT_CPUSET_BALANCE) -> bool:
    """Have the kernel count the deadline bandwidth of its root domain anew from the deadline tasks
    that exist: the root cpuset's `sched_load_balance` set to 0 and back to 1 rebuilds the scheduling
    domains, and with them the root domain's sum of admitted reservations (the kernel's
    `dl_rebuild_rd_accounting`, Linux 6.x). Whether it was done: False without a cgroup v1 cpuset
    root, or where the flag is not 1 (the host balances as it chose; left alone).

    Why: this kernel (6.18) lost the bandwidth of reservations the starvation guard had handed back
    (`guard.hand_back`). After it returned two 0.3-core rank threads to SCHED_OTHER (2026-12-05
    21:39), the machine admitted 1.2 cores of new reservations instead of 1.8 (1.9 less the fair
    servers' 0.1), until this rebuild gave the 1.8 back, and each later row of that run had one
    0.3-core rank refused (EBUSY) and left on its CFS quota. Raises OSError when the flag cannot be
    written (not root)."""
    path = Path(flag)
    try:
        if path.read_text().strip() != "1":
            return False
    except OSError:
        return False
    path.write_text("0")
    path.write_text("1")
    return True


def bandwidth_limit(cpus: int | None = None) -> float:
    """Cores the deadline (and real-time) tasks of this machine may reserve in all:
    `cpus` (default `os.cpu_count()`) x kernel.sched_rt_runtime_us / kernel.sched_rt_period_us
    (0.95 by default; no limit, -1: every CPU)."""
    n = cpus or os.cpu_count() or 1
    runtime = int(Path("/proc/sys/kernel/sched_rt_runtime_us").read_text())
    period = int(Path("/proc/sys/kernel/sched_rt_period_us").read_text())
    return float(n) if runtime < 0 else n * runtime / period
