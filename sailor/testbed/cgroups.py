"""A testbed's cpu cgroups (cgroup v1): one per node, one per rank with its device class's quota,
and one for every rank's communication threads (`create_cgroups`); moving ranks and their
communication threads into them as they start, and giving each rank's compute thread its device's
speed as a deadline reservation (`place_ranks`, `testbed.deadline`: torchrun's ranks and a live
pool's processes, called by the stand-in ssh; `sailor profile`'s ranks, by `testbed.profile`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from sailor.runtime.epochs import AGENT_SLOTS_ENV, SLOT_ENV
from sailor.runtime.post_thread import THREAD_NAME
from sailor.testbed import deadline, net
from sailor.testbed.spec import TestbedSpec
from sailor.testbed.state import NodeState, TestbedState


def write_cgroup(path: str, key: str, value: str | int) -> None:
    Path(path, key).write_text(str(value))


COMM_SHARES = 262144
"""cpu.shares of the `comm-threads` cgroup inside the testbed's: the kernel's largest weight
(MAX_SHARES, 1 << 18, kernel/sched/sched.h), against the nodes' 1024 each, so that a
communication thread woken by its socket takes a core from the nodes' other threads at once."""

TESTBED_SHARES = 10240
"""cpu.shares of a testbed's own cgroup: ten ordinary tasks' weight against every other runnable
task of the machine (1024 each; under CFS group scheduling the whole testbed is one entity). The
ranks' compute does not need it (each compute thread runs under its deadline reservation,
`testbed.deadline`), its communication threads do: with the default 1024 a testbed counted as one
task (at load 20 each of its 6 ranks ran 50 ms per second where its quota allowed 300, before the
reservations). It was the kernel's largest weight (262144) until that starved the kernel's own
threads (softirq and workqueue workers, 1024 each) whenever threads of the testbed kept a core
busy: the kernel reported "workqueue lockup" on both CPUs for 33-86 s while a 4-rank interleaved
run of `benchmarks/testbed.py` hung until its 2-minute timeout (2026-12-05; gloo's socket loop
polls in a busy loop while a posting thread holds the pair's lock, `runtime.post_thread`, and the
softirq work that moves the veths' packets waits in such a worker when it is deferred)."""


def create_cgroups(spec: TestbedSpec, state: TestbedState) -> None:
    """The testbed's cgroup (weight TESTBED_SHARES) with one child per node, and below it one child
    per rank (`r0`, `r1`, ...) with its device class's per-rank quota: a rank waiting for a transfer
    does not lend its share to the other ranks of its node (the stand-in ssh moves each rank into its
    own, `place_ranks`). The node's own cgroup has no quota: what else runs there (torchrun's agent,
    `sailor profile network --hosts`, `testbed exec`) is the host's CPU work, not its device's.
    Beside the nodes, `comm-threads` (`comm_cgroup`) holds every communication thread under the
    shared `comm_cpu_quota` (no limit without one), weighing COMM_SHARES against the nodes'
    1024 each: a collective's thread woken by its socket takes a core from a rank's compute at once,
    as a GPU's transfers never wait for its kernels. With the default weight it waited its turn
    among the nodes' ranks; measured on the 2-core build machine, `benchmarks/testbed.py` (quiet,
    fresh profiles, 2026-12-05): exposed gradient sync predicted / measured 0.015 / 0.030 s
    (planner), 0.039 / 0.047 (dp_fast), 0.013 / 0.023 (pp_node) before; 0.022 / 0.029, 0.044 /
    0.044, 0.015 / 0.020 with it; TP 2 in a node (per-layer all-reduces through these threads)
    −31.9 % before, −0.8 % with it."""
    os.mkdir(state.names.cgroup)
    write_cgroup(state.names.cgroup, "cpu.shares", TESTBED_SHARES)
    for n, ns in zip(spec.nodes, state.nodes):
        _make_cgroup(ns.cgroup, None, spec)
        for k in range(n.ranks):
            _make_cgroup(rank_cgroup(ns, k), spec.devices[n.device].cpu_quota, spec)
    _make_cgroup(comm_cgroup(state.nodes[0]), spec.comm_cpu_quota, spec)
    write_cgroup(comm_cgroup(state.nodes[0]), "cpu.shares", COMM_SHARES)


def _make_cgroup(path: str, cores: float | None, spec: TestbedSpec) -> None:
    """A cpu cgroup at `path` with a quota of `cores` per CFS period (`TestbedSpec.period_us`; None:
    no quota)."""
    os.mkdir(path)
    if cores is not None:
        write_cgroup(path, "cpu.cfs_period_us", spec.period_us(cores))
        write_cgroup(path, "cpu.cfs_quota_us", net.cpu_quota_us(cores, spec.period_us(cores)))


def rank_cgroup(node: NodeState, slot: int) -> str:
    """The cgroup of the rank on device `slot` of `node`."""
    return f"{node.cgroup}/r{slot}"


def rank_cgroups(node: NodeState) -> list[str]:
    """The rank cgroups of `node` (`rank_cgroup` of each of its slots), in slot order."""
    return sorted((str(p) for p in Path(node.cgroup).glob("r[0-9]*")), key=lambda p: int(p.rsplit("/r", 1)[1]))


def rank_slot(environ: dict[str, str]) -> int | None:
    """The device index on its node of the rank with environment `environ` (torchrun sets
    LOCAL_RANK; where the node runs several agents, each lists its own devices in
    `epochs.AGENT_SLOTS_ENV`, `sailor.launch.common`, on every device; a live pool's process has
    its slot, `epochs.SLOT_ENV`); None for a process that is not a rank."""
    if environ.get(SLOT_ENV, "").isdigit():
        return int(environ[SLOT_ENV])
    local = environ.get("LOCAL_RANK", "")
    if not local.isdigit() or "TORCHELASTIC_RUN_ID" not in environ:
        return None
    visible = [d for d in environ.get(AGENT_SLOTS_ENV, "").split(",") if d.strip()]
    if not visible:
        return int(local)
    return int(visible[int(local)]) if int(local) < len(visible) and visible[int(local)].strip().isdigit() else None


def quota_cores(cgroup: str) -> float | None:
    """Cores per CFS period the cpu cgroup `cgroup` allows (cpu.cfs_quota_us over cpu.cfs_period_us);
    None without a quota. Raises OSError when the cgroup is gone."""
    quota = int(Path(cgroup, "cpu.cfs_quota_us").read_text())
    return None if quota < 0 else quota / int(Path(cgroup, "cpu.cfs_period_us").read_text())


REFUSED_LINE = "testbed: reservation refused"
"""How the line `reserve` prints where the kernel refuses a reservation begins."""


def reserve(tid: int, cgroup: str) -> None:
    """Give thread `tid` its rank cgroup `cgroup`'s quota as a deadline reservation
    (`deadline.set_deadline`), where the quota is under one core (a full core needs none). Where
    the kernel refuses, the rank keeps its CFS quota alone, and one line on stderr says so. Raises
    OSError when the thread or the cgroup is gone."""
    cores = quota_cores(cgroup)
    if cores is None or cores >= 1:
        return
    try:
        deadline.set_deadline(tid, cores)
    except OSError as e:
        if not Path(f"/proc/{tid}").exists():
            raise
        print(f"{REFUSED_LINE}: rank thread {tid} keeps its CFS quota alone ({e})", file=sys.stderr, flush=True)


def reserved_threads(cgroups: Iterable[str]) -> list[int]:
    """The threads of `cgroups` (cgroup folders; those gone are skipped) under SCHED_DEADLINE."""
    out = []
    for cg in cgroups:
        try:
            tids = Path(cg, "tasks").read_text().split()
        except OSError:
            continue
        for tid in tids:
            try:
                if deadline.is_deadline(int(tid)):
                    out.append(int(tid))
            except OSError:
                continue
    return out


def comm_cgroup(node: NodeState) -> str:
    """The cgroup of the communication threads of every rank of `node`'s testbed (one for all nodes;
    node names cannot hold '-', so it never meets a node's cgroup)."""
    return f"{os.path.dirname(node.cgroup)}/comm-threads"


PLACE_EVERY_S = 0.1  # how often `place_ranks` is called while ranks start (the stand-in ssh, `testbed.profile`)

COMM_THREADS = ("gloo", "pt_gloo", "pt_tcpstore", "pt_nccl", THREAD_NAME)
"""Name prefixes (`/proc/TID/comm`) of the threads that communicate: torch.distributed's, gloo's
socket loop (`gloo_tcp_loop`), ProcessGroupGloo's work threads (`pt_gloo_runloop`), the rendezvous
store's loop (`pt_tcpstore_uv`), and the runtime's own that posts the pipeline's point-to-point
transfers on CPU (`runtime.post_thread`: gloo writes a send's bytes from the thread that posts it).
Every other thread of a rank (Python's, torch's compute threads) computes, under its device's quota."""


def torchrun_slot(pid: str) -> int | None:
    """The device index on its node of process `pid` when torchrun started it as a rank (`rank_slot`
    of its environment), else None. Raises OSError when the process is gone."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return rank_slot(dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e))


def place_ranks(node: NodeState, slot_of: Callable[[str], int | None] = torchrun_slot) -> int:
    """Move every rank found directly in `node`'s cgroup into its rank cgroup (`slot_of(pid)`, the
    rank's device index on the node, None for a process that is not a rank: by default torchrun's
    ranks, `torchrun_slot`), and every communication thread (`COMM_THREADS`) of the node's processes
    into `comm_cgroup`, so a device's quota throttles its compute and not its transfers (testbed
    file, `comm_cpu_quota`); how many ranks were moved. A moved rank's main thread, which computes,
    gets its rank cgroup's quota as a deadline reservation (`reserve`) where no thread of that cgroup
    holds one yet: one reservation per device, so the testbed never reserves more than `up` admitted
    (`host.check_cores`). A second rank placed on a busy device (`testbed.profile`: the 2·TP ranks of
    the stage pass's cost outnumber a node's ranks from TP 2 on) shares its cgroup's CFS quota; with
    a reservation each, a TP-2 profiling round asked for more than the kernel's 1.9 cores and it
    refused 2-3 ranks per profile at random, measured or busy (2026-12-05). Processes and threads
    that end meanwhile are skipped; threads a rank starts later (a new process group) are found on
    the next call."""
    moved = 0
    for pid in Path(node.cgroup, "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError, ValueError):
            slot = slot_of(pid)
            if slot is not None and os.path.isdir(rank_cgroup(node, slot)):
                write_cgroup(rank_cgroup(node, slot), "cgroup.procs", pid)
                moved += 1
                if not reserved_threads([rank_cgroup(node, slot)]):  # one reservation per device
                    reserve(int(pid), rank_cgroup(node, slot))
    comm = comm_cgroup(node)
    for folder in [Path(node.cgroup), *Path(node.cgroup).glob("r*")]:
        with contextlib.suppress(OSError):
            for tid in Path(folder, "tasks").read_text().split():
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{tid}/comm").read_text().startswith(COMM_THREADS) and os.path.isdir(comm):
                        write_cgroup(comm, "tasks", tid)
    return moved
