"""Gradient all-reduce across the D replicas of one stage, built from point-to-point links.

Each replica is a TP group of t GPUs on one node. With TP, a stage's gradient of S bytes is split in
t shards held by the t ranks; replicas with different TP degrees synchronise block by block at the
finest sharding. Either way each node moves its S bytes over its NIC with t concurrent flows, so a
ring step between two replicas is one transfer of S/D bytes carried by min(t_a, t_b) flows.

- flat ring (Patarasuk & Yuan 2009): 2(D-1) steps, each as slow as the slowest ring edge;
- hierarchical (multi-zone): ring reduce-scatter inside each zone, ring all-reduce of the 1/D_z
  shards across zones (one ring per shard, in parallel), ring all-gather inside each zone.
The faster of the two is taken (NCCL picks among algorithms likewise). A ring all-reduce is a
reduce-scatter followed by an all-gather (Patarasuk & Yuan 2009; Rabenseifner 2004), each taking
half of its steps, so `reduce_scatter_time_s` and `all_gather_time_s` are half the all-reduce's
(ZeRO: reduce-scatter of gradients plus all-gather of parameters in place of the all-reduce).

Inside a TP group (one node) the same rings run over the intra-node link (`tp_collective_time_s`):
an all-reduce of a tensor of n bytes takes 2(t-1) steps of n/t, an all-gather or a reduce-scatter
t-1 steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

from sailor.catalog import LinkClass
from sailor.models import Collective
from sailor.network import NetworkModel


@dataclass(frozen=True)
class Member:
    """Where one replica runs (and so how it takes part in a stage's all-reduce)."""

    zone: str
    gpu: str
    tp: int


Group = tuple[Member, int]  # a member kind and how many replicas of that kind take part


def group_members(members: list[Member]) -> list[Group]:
    """Members as (kind, count) in ring order: sorted by zone, GPU type, TP, so zones are contiguous."""
    counts: dict[Member, int] = {}
    for m in members:
        counts[m] = counts.get(m, 0) + 1
    return sorted(counts.items(), key=lambda g: (g[0].zone, g[0].gpu, g[0].tp))


def _step_time(a: Member, b: Member, chunk_bytes: float, net: NetworkModel) -> float:
    flows = max(1, min(a.tp, b.tp))
    return net.transfer_time_s(a.zone, a.gpu, b.zone, b.gpu, chunk_bytes / flows, flows=flows)


def _ring_edges(groups: list[Group]) -> set[tuple[Member, Member]]:
    """Distinct (sender, receiver) kinds of a ring laid out in group order, wrap-around included."""
    if sum(n for _, n in groups) < 2:
        return set()
    edges = {(m, m) for m, n in groups if n >= 2}
    if len(groups) >= 2:
        kinds = [m for m, _ in groups]
        edges.update(zip(kinds, kinds[1:] + kinds[:1]))
    return edges


def _ring_step(groups: list[Group], chunk_bytes: float, net: NetworkModel) -> float:
    """Seconds of one ring step (every member sends `chunk_bytes` to the next): the slowest edge."""
    edges = _ring_edges(groups)
    return max((_step_time(a, b, chunk_bytes, net) for a, b in edges), default=0.0)


def allreduce_time_s(groups: list[Group], nbytes: float, net: NetworkModel) -> float:
    """Seconds to all-reduce `nbytes` (one replica's full gradient) across the members `groups`
    (from `group_members`): min(flat ring, hierarchical by zone). 0 for a single member."""
    d = sum(n for _, n in groups)
    if d < 2 or nbytes <= 0:
        return 0.0
    flat = 2 * (d - 1) * _ring_step(groups, nbytes / d, net)
    zones = [list(g) for _, g in groupby(groups, key=lambda g: g[0].zone)]
    if len(zones) == 1:
        return flat
    sizes = [sum(n for _, n in z) for z in zones]
    intra = max(_ring_step(z, nbytes / s, net) for z, s in zip(zones, sizes))
    leaders = [(z[0][0], 1) for z in zones]
    shard = nbytes / min(sizes)
    cross = 2 * (len(zones) - 1) * _ring_step(leaders, shard / len(zones), net)
    hier = 2 * (max(sizes) - 1) * intra + cross
    return min(flat, hier)


def reduce_scatter_time_s(groups: list[Group], nbytes: float, net: NetworkModel) -> float:
    """Seconds to reduce-scatter `nbytes` (one replica's full tensor) across `groups`: the first half
    of the ring all-reduce (`allreduce_time_s`)."""
    return allreduce_time_s(groups, nbytes, net) / 2


def all_gather_time_s(groups: list[Group], nbytes: float, net: NetworkModel) -> float:
    """Seconds to all-gather `nbytes` (the full tensor, each member holding 1/D of it) across
    `groups`: the second half of the ring all-reduce (`allreduce_time_s`)."""
    return allreduce_time_s(groups, nbytes, net) / 2


RING_STEPS = {Collective.ALL_REDUCE: 2, Collective.ALL_GATHER: 1, Collective.REDUCE_SCATTER: 1}
"""Ring steps per member (x (t - 1)) of each collective."""


def tp_collective_time_s(net: NetworkModel, zone: str, gpu: str, tp: int, kind: Collective, nbytes: float) -> float:
    """Seconds of one collective over a TP group of `tp` GPUs inside one node, on the intra-node link
    (`NetworkModel` same-node link: measured intra-node fit, cluster override or catalog): a ring of
    RING_STEPS[kind]·(tp - 1) steps, each moving nbytes / tp (nbytes = the full tensor). 0 at TP 1."""
    if tp < 2 or nbytes <= 0:
        return 0.0
    step = net.transfer_time_s(zone, gpu, zone, gpu, nbytes / tp, same_node=True)
    return RING_STEPS[kind] * (tp - 1) * step


def ring_egress(groups: list[Group], nbytes: float, net: NetworkModel) -> tuple[float, float]:
    """(bytes crossing zones, egress $) per all-reduce: each ring edge between zones carries
    2(D-1)/D x nbytes (flat ring order, zones contiguous)."""
    d = sum(n for _, n in groups)
    if d < 2 or nbytes <= 0:
        return 0.0, 0.0
    per_edge = 2 * (d - 1) / d * nbytes
    moved, usd = 0.0, 0.0
    prices = net.cluster.prov.egress_usd_per_gb
    kinds = [m for m, _ in groups]
    for a, b in zip(kinds, kinds[1:] + kinds[:1]):
        if len(kinds) < 2:
            break
        lc = net.link_class(a.zone, b.zone)
        if lc not in (LinkClass.SAME_NODE, LinkClass.SAME_ZONE):
            moved += per_edge
            usd += per_edge / 1e9 * prices[lc]
    return moved, usd
