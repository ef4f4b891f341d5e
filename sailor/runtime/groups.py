"""Create the torch process groups a topology needs (the one place groups are made).

`create_groups`: the collective groups (TP, gradient sync); `create_channel_groups`: one 2-rank group
per pipeline channel (`messages.Channel`: ordered pair of ranks and kind), so that under NCCL every
transfer stream that must progress on its own has its own communicator and CUDA stream (torch 2.13
`ProcessGroupNCCL` runs each communicator's work on a stream of its own). Every rank creates every
group, in one global order (`dist.new_group` is collective over the world); with a device bound at
`init_process_group(device_id=...)` torch creates NCCL communicators eagerly there, at start-up.
torch's NCCL backend gives single sends and receives a communicator of their own per pair of ranks,
made at the first one (`ProcessGroupNCCL::pointToPoint`, key `getKeySendRecv`), and making it blocks
both hosts until both arrive; so `create_channel_groups` also sends one element over every channel,
each rank through its own channels in the one sorted order. That order cannot deadlock: the smallest
channel not yet connected has both its ranks waiting at it, each being done with all smaller ones.

`create_sync_lanes`: under gloo, each gradient-sync group gets GLOO_SYNC_LANES - 1 more groups of the
same ranks, its *lanes*, which the optimizer issues its bucket reductions on in turn
(`grad_sync.Lanes`). A gloo group has one TCP connection per pair of ranks and two worker threads;
its all-reduces, one after another over that connection, carried the testbed's 400 Mbit/s
cross-zone link at about half its rate during the step's gradient sync (its counters sampled every
20 ms: 25-30 MB/s each way of 50, the two directions taking turns), for sailor's per-layer buckets
and for DDP's 25 MB ones alike (`benchmarks/runtime_overhead.py --testbed`, README "Runtime"). Lanes
keep several reductions moving at once over their own connections and threads, as NCCL's socket
transport opens several sockets per peer for the same reason (NCCL environment variables,
`NCCL_SOCKET_NTHREADS`, `NCCL_NSOCKS_PERTHREAD`); NCCL groups get no lanes. Every member issues the
same reductions on a group in the same order (`grad_sync` module docstring), and `Lanes` picks the
lane from that order alone, so each lane also sees one order on every member.

`ignore_tags` (`SAILOR_IGNORE_TAGS=1`): every point-to-point tag becomes 0, so gloo, which matches a
pair's messages by tag, matches them in posting order as NCCL does (NCCL ignores tags: torch's
`isend` docstring, "tag is not supported with the NCCL backend"). The CPU tests run the runtime so.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from sailor.runtime.messages import Channel, plan_channels
from sailor.runtime.topology import Ranks, Topology

IGNORE_TAGS_ENV = "SAILOR_IGNORE_TAGS"


def create_groups(topology: Topology, timeout: timedelta) -> dict[Ranks, dist.ProcessGroup]:
    """Every group of `topology.groups()`, created collectively by all ranks in the same order;
    returns those this rank belongs to, keyed by their rank tuple. Collectives in them time out after
    `timeout`."""
    me = dist.get_rank()
    mine = {}
    for ranks in topology.groups():
        group = dist.new_group(list(ranks), timeout=timeout)
        if me in ranks:
            mine[ranks] = group
    return mine


GLOO_SYNC_LANES = 4  # groups per gradient-sync group under gloo (module docstring)


def create_sync_lanes(topology: Topology, groups: dict[Ranks, dist.ProcessGroup],
                      timeout: timedelta) -> dict[Ranks, tuple[dist.ProcessGroup, ...]]:
    """Under gloo, for every gradient-sync group of `topology` (`Topology.sync_groups`) this rank
    belongs to: (its group in `groups`, then GLOO_SYNC_LANES - 1 new groups of the same ranks), the
    new ones created collectively by all ranks in one order; {} under any other backend (module
    docstring). Collectives in them time out after `timeout`."""
    if dist.get_backend() != dist.Backend.GLOO:
        return {}
    me = dist.get_rank()
    mine = {}
    for ranks in topology.sync_groups():
        extra = [dist.new_group(list(ranks), timeout=timeout) for _ in range(GLOO_SYNC_LANES - 1)]
        if me in ranks:
            mine[ranks] = (groups[ranks], *extra)
    return mine


def create_channel_groups(topology: Topology, timeout: timedelta,
                          device: torch.device | None = None) -> dict[Channel, dist.ProcessGroup]:
    """One 2-rank group per channel of the plan (`messages.plan_channels`, sorted), created by all
    ranks in that order, then connected (one float32 element from src to dst on `device`, default
    CPU; module docstring); returns this rank's channels (it sends or receives on them). A transfer
    that hangs fails after `timeout` (the group's timeout: gloo's wait, NCCL's watchdog)."""
    me = dist.get_rank()
    mine = {}
    for ch in plan_channels(topology):
        group = dist.new_group([ch.src, ch.dst], timeout=timeout)
        if me in (ch.src, ch.dst):
            mine[ch] = group
    probe = torch.zeros(1, device=device or torch.device("cpu"))
    for ch, group in mine.items():  # in sorted order
        if ch.src == me:
            dist.send(probe, ch.dst, group=group)
        else:
            dist.recv(probe, ch.src, group=group)
    return mine


def _untagged(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(tensor, *args, **kwargs):  # (tensor, peer, group, tag, ...) as in torch 2.13
        if len(args) >= 3:
            args = (*args[:2], 0, *args[3:])
        if "tag" in kwargs:
            kwargs["tag"] = 0
        return fn(tensor, *args, **kwargs)
    call.untagged = True
    return call


def ignore_tags() -> bool:
    """When `SAILOR_IGNORE_TAGS=1`, make every point-to-point call of this process (`isend`, `irecv`,
    `send`, `recv`, and `batch_isend_irecv` through them) use tag 0 (module docstring); returns
    whether it did. Patches `torch.distributed` and `torch.distributed.distributed_c10d` in place,
    once."""
    if os.environ.get(IGNORE_TAGS_ENV) != "1":
        return False
    for name in ("isend", "irecv", "send", "recv"):
        fn = getattr(c10d, name)
        if not getattr(fn, "untagged", False):
            wrapped = _untagged(fn)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)
    return True
