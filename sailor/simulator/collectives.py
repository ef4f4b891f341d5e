"""Gradient all-reduce across the D replicas of one stage, built from point-to-point links.

Each replica is a TP group of t GPUs on one node. With TP, a stage's gradient of S bytes is split in
t shards held by the t ranks; replicas with different TP degrees synchronise block by block at the
finest sharding. Either way each node moves its S bytes over its NIC with t concurrent flows, so a
ring step between two replicas is one transfer of S/D bytes carried by min(t_a, t_b) flows.

- flat ring (Patarasuk & Yuan 2009): 2(D-1) steps, each as slow as the slowest ring edge;
- hierarchical (multi-zone): ring reduce-scatter inside each zone, ring all-reduce of the 1/D_z
  shards across zones (one ring per shard, in parallel), ring all-gather inside each zone.
The faster of the two is taken (NCCL picks among algorithms likewise).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

from sailor.catalog import LinkClass
from sailor.network import NetworkModel


@dataclass(frozen=True)
class Member:
    """One replica taking part in a stage's all-reduce."""

    zone: str
    gpu: str
    tp: int
    node: str


def _step_time(a: Member, b: Member, chunk_bytes: float, net: NetworkModel) -> float:
    flows = max(1, min(a.tp, b.tp))
    return net.transfer_time_s(a.zone, a.gpu, b.zone, b.gpu, chunk_bytes / flows, flows=flows,
                               same_node=a.node == b.node)


def _ring_step(members: list[Member], chunk_bytes: float, net: NetworkModel) -> float:
    """Seconds of one ring step (every member sends `chunk_bytes` to the next)."""
    n = len(members)
    if n < 2:
        return 0.0
    return max(_step_time(members[k], members[(k + 1) % n], chunk_bytes, net) for k in range(n))


def _ring_order(members: list[Member]) -> list[Member]:
    return sorted(members, key=lambda x: (x.zone, x.node))


def allreduce_time_s(members: list[Member], nbytes: float, net: NetworkModel) -> float:
    """Seconds to all-reduce `nbytes` (one replica's full gradient) across `members`: min(flat ring,
    hierarchical by zone). 0 for a single member."""
    d = len(members)
    if d < 2 or nbytes <= 0:
        return 0.0
    ring = _ring_order(members)
    flat = 2 * (d - 1) * _ring_step(ring, nbytes / d, net)
    zones = [list(g) for _, g in groupby(ring, key=lambda x: x.zone)]
    if len(zones) == 1:
        return flat
    dz_max = max(len(z) for z in zones)
    dz_min = min(len(z) for z in zones)
    intra = max(_ring_step(z, nbytes / len(z), net) for z in zones)
    leaders = [z[0] for z in zones]
    shard = nbytes / dz_min
    cross = 2 * (len(zones) - 1) * _ring_step(leaders, shard / len(zones), net)
    hier = 2 * (dz_max - 1) * intra + cross
    return min(flat, hier)


def ring_egress(members: list[Member], nbytes: float, net: NetworkModel) -> tuple[float, float]:
    """(bytes crossing zones, egress $) per all-reduce: each ring edge between zones carries
    2(D-1)/D x nbytes (flat ring order, zones contiguous)."""
    d = len(members)
    if d < 2 or nbytes <= 0:
        return 0.0, 0.0
    ring = _ring_order(members)
    per_edge = 2 * (d - 1) / d * nbytes
    moved, usd = 0.0, 0.0
    prices = net.cluster.prov.egress_usd_per_gb
    for k in range(d):
        a, b = ring[k], ring[(k + 1) % d]
        lc = net.link_class(a.zone, b.zone, a.node == b.node)
        if lc not in (LinkClass.SAME_NODE, LinkClass.SAME_ZONE):
            moved += per_edge
            usd += per_edge / 1e9 * prices[lc]
    return moved, usd
