"""Gradient all-reduce across the D replicas of one stage, built from point-to-point links.

Each replica is a TP group of t GPUs on one node. With TP, a stage's gradient of S bytes is split in
t shards held by the t ranks; replicas with different TP degrees synchronise block by block at the
finest sharding. Each TP rank runs its own ring with its peers, all at once, so a ring edge between
two replicas carries f = min(t_a, t_b) concurrent flows, each moving its 1/f of the data; on a
default link those flows share the node's NIC (`catalog.Link`), on a measured curve they get what
was measured for f flows.

- ring (Patarasuk & Yuan 2009), members ordered by zone and node: 2(D-1) steps. Each step pays the
  slowest edge's one-way latency (`NetworkModel.hop_latency_s`); the bytes stream through the ring,
  each flow moving 2(D-1)/D of its data over the slowest edge (`NetworkModel.stream_time_s`: the
  link's bandwidth, or a measured curve at that size):
      T_ring = 2(D-1)·α + stream(2(D-1)/D · S/f) / η.
- hierarchical over islands (zones when the members span several, else nodes that hold several
  replicas, as `sailor.plan.placement.rank_layout` places them): ring reduce-scatter inside each island
  ((k-1) steps, each member ends with S/k), ring all-reduce of those shards across islands (one
  ring per shard, all at once; the shards of one node share its NIC), ring all-gather inside each
  island: T = 2·T_rs + T_cross.
`allreduce_time_s` takes the cheaper (`AllreduceAlgorithm.AUTO`, as NCCL picks its algorithm by a
cost model) unless the cluster spec pins one. η is the calibrated all-reduce efficiency of the GPU
type (`simulator.calibration`, 1 by default): the fraction of the point-to-point bandwidth the
collective reaches (reduction kernels, channels, the framework's copies around it); it scales the
bandwidth term only.

Latency matters as it does on real rings: a 32-member ring pays 62 hop latencies, so at 500 µs per
hop a message whose streaming takes ~31 ms loses half its bandwidth, where at 20 µs it loses 4 %.
A ring all-reduce is a reduce-scatter followed by an all-gather (Patarasuk & Yuan 2009;
Rabenseifner 2004), each taking half of its steps and bytes (`simulator.terms.collective_s`; ZeRO:
reduce-scatter of gradients plus all-gather of parameters in place of the all-reduce).

Expert parallelism's all-to-all (`all_to_all_time_s`) is no ring: every member sends its share to
every other at once, over its own intra-node link to the members on its node and over the node's
shared links to the rest; the slowest member sets the time.

Inside a TP group (one node) the same rings run over the intra-node link (`tp_collective_time_s`):
an all-reduce of a tensor of n bytes takes 2(t-1) steps of n/t, an all-gather or a reduce-scatter
t-1 steps.

The backend adds to every collective call what its links do not (`perf.network.CollectiveCost`,
measured by `sailor profile network`; nothing by default, as for NCCL): a start-up α_c once per
call (`terms.collective_s`, `tp_collective_time_s`) and, for each flow, its bytes B at the
processing rate ρ of the work that does not overlap the transfers (gloo's copies and sums on the
CPU), in every ring phase:
    T = α_c + T_ring + B / ρ,  B = 2(D-1)/D · S/f for a ring all-reduce.
gloo on the testbed's links (two ranks, 64 KiB-4 MiB, quiet machine) took a fixed ~2 ms per call
and 1.27x the bytes' time on a 300 Mbit/s link but 1.03-1.09x on a 50 Mbit/s one: the same
absolute per-byte cost on both, so a rate beside the link's, not a fraction of its bandwidth.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

from sailor.catalog import LinkClass
from sailor.model.spec import Collective
from sailor.perf.network import CollectiveCost, NetworkModel
from sailor.simulator.traffic import Crossing
from sailor.specs.cluster import AllreduceAlgorithm


@dataclass(frozen=True)
class Member:
    """Where one replica runs (and so how it takes part in a stage's all-reduce).

    `node` names the machine (`sailor.plan.placement.RankInfo.node`); None = a node of its own, shared with no
    other member (what the planner assumes before placement). `node_cut`, before placement only: the
    replica's pipeline is cut between nodes before it (`sailor.plan.spec.Replica.node_cut`), which
    the placement reads; placed members have it False. Hashed once, when made (the planner's memo
    keys hold many), to the value the dataclass's own hash of its fields gives."""

    zone: str
    gpu: str
    tp: int
    node: str | None = None
    node_cut: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.zone, self.gpu, self.tp, self.node, self.node_cut)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # rebuilt from its fields: another process hashes strings its own way
        return Member, (self.zone, self.gpu, self.tp, self.node, self.node_cut)


Group = tuple[Member, int]  # a member kind and how many replicas of that kind take part


def ring_key(group: Group) -> tuple[str, str, str, int]:
    """Where a group sits in ring order: (zone, node, GPU type, TP), so zones and the replicas of one
    node are contiguous (a member without a node first in its zone)."""
    m = group[0]
    return m.zone, m.node or "", m.gpu, m.tp


def group_members(members: list[Member]) -> list[Group]:
    """Members as (kind, count) in ring order (`ring_key`)."""
    return sorted(Counter(members).items(), key=ring_key)


def same_node(a: Member, b: Member) -> bool:
    """True when both members sit on one named node."""
    return a.node is not None and a.node == b.node


def _edge_kinds(groups: list[Group]) -> set[tuple[str, str, int, str, str, int, bool]]:
    """Distinct (sender zone, GPU, TP, receiver zone, GPU, TP, same node) of the edges of a ring
    laid out in group order, wrap-around included: edges that differ only in which nodes they join
    cost the same, so each kind is looked up once."""
    if sum(n for _, n in groups) < 2:
        return set()
    out = {(m.zone, m.gpu, m.tp, m.zone, m.gpu, m.tp, m.node is not None) for m, n in groups if n >= 2}
    if len(groups) >= 2:
        ends = [(m.zone, m.gpu, m.tp) for m, _ in groups]
        nodes = [m.node for m, _ in groups]
        out.update((*a, *b, na is not None and na == nb)
                   for a, b, na, nb in zip(ends, ends[1:] + ends[:1], nodes, nodes[1:] + nodes[:1]))
    return out


@dataclass(frozen=True)
class Ring:
    """What the seconds of a ring phase read of its members, without the bytes: the slowest edge's
    one-way latency and the distinct (route, t) its edges stream over, t = max(1, min(TP)) flows per
    ring (`NetworkModel.ring_links`), the finest TP degree among the members (the edge whose flows
    carry the most bytes each), `share` such rings leaving the sender's node at once, and the
    backend's cost per collective (`NetworkModel.collective`)."""

    latency_s: float
    links: tuple
    finest: int
    share: int
    cost: CollectiveCost

    @classmethod
    def of(cls, groups: list[Group], net: NetworkModel, share: int = 1) -> "Ring":
        """The ring over `groups` (ring order): its latency and routes once per ring and share
        (`NetworkModel.ring_links`: a ring of many zones has as many edge kinds, over a few
        distinct routes)."""
        latency, links = net.ring_links(tuple(groups), lambda: _edge_kinds(groups), share)
        return cls(latency, links, max(1, min(m.tp for m, _ in groups)), share, net.collective)

    def phase_s(self, nbytes: float, *, steps: int, fraction: float, efficiency: float) -> float:
        """Seconds of `steps` ring steps in which each member streams `fraction` x `nbytes` split over
        its edge's t flows (one per TP rank of the finer replica), while `share` such rings, each with
        its own `nbytes`, leave the sender's node at once: share x t flows of fraction x nbytes / t
        each on the edge's link. Steps x slowest hop latency + slowest edge's streaming / η + the
        backend's processing of each flow's bytes (`CollectiveCost.processing_s`, the flows of one
        edge and of the `share` rings each in a process of its own)."""
        if nbytes <= 0:
            return 0.0
        stream = max((route.bytes_time(fraction * nbytes / t, t * self.share)[0] for route, t in self.links),
                     default=0.0)
        return steps * self.latency_s + stream / efficiency + self.cost.processing_s(fraction * nbytes / self.finest)

    def allreduce_s(self, members: int, nbytes: float, efficiency: float) -> float:
        """Seconds of a flat ring all-reduce of `nbytes` (one replica's gradient) over this ring of
        `members` replicas: 2(D-1) steps, each member streaming 2(D-1)/D of the bytes."""
        if members < 2:
            return 0.0
        return self.phase_s(nbytes, steps=2 * (members - 1), fraction=2 * (members - 1) / members,
                            efficiency=efficiency)


def ring_allreduce_s(groups: list[Group], nbytes: float, net: NetworkModel, *, efficiency: float = 1.0,
                     share: int = 1) -> float:
    """Seconds of a flat ring all-reduce of `nbytes` (one replica's gradient) over `groups`."""
    d = sum(n for _, n in groups)
    if d < 2:
        return 0.0
    return Ring.of(groups, net, share).allreduce_s(d, nbytes, efficiency)


def _islands(groups: list[Group]) -> list[list[Group]] | None:
    """Members split for a hierarchical all-reduce: by zone when they span several, else by node
    when some node holds several replicas (a member without a node is an island of its own); None
    when neither splits them."""
    zones = [list(g) for _, g in groupby(groups, key=lambda g: g[0].zone)]
    if len(zones) > 1:
        return zones
    named = [list(g) for node, g in groupby((g for g in groups if g[0].node is not None), key=lambda g: g[0].node)]
    alone = [[(m, 1)] for m, n in groups if m.node is None for _ in range(n)]
    if any(sum(n for _, n in isl) > 1 for isl in named) and len(named) + len(alone) > 1:
        return named + alone
    return None


@dataclass(frozen=True)
class Hierarchy:
    """The rings of a hierarchical all-reduce over islands (module docstring), without the bytes:
    (ring, members k) of each kind of island of k > 1 members (islands of the same members on other
    nodes, or in zones of one class, `NetworkModel.zone_class`, reduce alike: each kind once), the
    fewest members of an island (the shard each crosses with), and the ring across the islands'
    leaders with its members."""

    islands: tuple[tuple[Ring, int], ...]
    smallest: int
    cross: Ring
    leaders: int

    @classmethod
    def of(cls, groups: list[Group], net: NetworkModel) -> "Hierarchy | None":
        """The hierarchy of `groups` (ring order); None when the members form a single island."""
        islands = _islands(groups)
        if islands is None:
            return None
        sizes = [sum(n for _, n in isl) for isl in islands]
        alike = {}  # an island of one GPU type reads only the links of its zone's class
        for isl, k in zip(islands, sizes):
            if k > 1:
                one = len({m.gpu for m, _ in isl}) == 1
                where = net.zone_class(isl[0][0].zone, isl[0][0].gpu) if one else isl[0][0].zone
                alike.setdefault((where, tuple((m.gpu, m.tp, n, m.node is not None) for m, n in isl)), (isl, k))
        # one ring per shard across islands; a node island's shards all leave through its NIC
        leaders = [isl[0][0] for isl in islands]
        share = min(sizes) if all(m.node is not None for m in leaders) and len({m.zone for m in leaders}) == 1 else 1
        return cls(tuple((Ring.of(isl, net), k) for isl, k in alike.values()), min(sizes),
                   Ring.of([(m, 1) for m in leaders], net, share), len(leaders))

    def allreduce_s(self, nbytes: float, efficiency: float) -> float:
        """Seconds of reduce-scatter inside the islands, all-reduce of the shards across them,
        all-gather inside them: 2·T_rs + T_cross."""
        rs = max((ring.phase_s(nbytes, steps=k - 1, fraction=(k - 1) / k, efficiency=efficiency)
                  for ring, k in self.islands), default=0.0)
        return 2 * rs + self.cross.allreduce_s(self.leaders, nbytes / self.smallest, efficiency)


@dataclass(frozen=True)
class AllreduceRings:
    """An all-reduce over some groups without its bytes: the flat ring over its `members` replicas,
    the hierarchy (None for a single island; not built where `algorithm` pins the ring) and the
    algorithm (`allreduce_time_s`). Built once, timed for any bytes (`time_s`):
    `simulator.terms.collective_s` keeps one per shape of groups."""

    members: int
    ring: Ring
    hierarchy: Hierarchy | None
    algorithm: AllreduceAlgorithm

    @classmethod
    def of(cls, groups: list[Group], net: NetworkModel,
           algorithm: AllreduceAlgorithm | None = None) -> "AllreduceRings":
        """The rings of an all-reduce over `groups` (from `group_members`) under `algorithm` (default: the
        cluster spec's `allreduce`)."""
        algorithm = net.cluster.allreduce if algorithm is None else algorithm
        hierarchy = None if algorithm is AllreduceAlgorithm.RING else Hierarchy.of(groups, net)
        return cls(sum(n for _, n in groups), Ring.of(groups, net), hierarchy, algorithm)

    def time_s(self, nbytes: float, efficiency: float = 1.0) -> float:
        """Seconds to all-reduce `nbytes` (one replica's full gradient): the ring or the hierarchical
        algorithm, the cheaper unless `algorithm` pins one; 0 for a single member or no bytes."""
        if self.members < 2 or nbytes <= 0:
            return 0.0
        ring = self.ring.allreduce_s(self.members, nbytes, efficiency)
        if self.hierarchy is None:
            return ring
        hier = self.hierarchy.allreduce_s(nbytes, efficiency)
        return hier if self.algorithm is AllreduceAlgorithm.HIERARCHICAL else min(ring, hier)


def allreduce_time_s(groups: list[Group], nbytes: float, net: NetworkModel, *, efficiency: float = 1.0,
                     algorithm: AllreduceAlgorithm | None = None) -> float:
    """Seconds to all-reduce `nbytes` (one replica's full gradient) across the members `groups`
    (from `group_members`): the ring or the hierarchical algorithm, the cheaper unless `algorithm`
    (default: the cluster spec's `allreduce`) pins one (`AllreduceRings`). 0 for a single member.

    Args:
        efficiency: η in (0, 1], the fraction of the links' bandwidth reached (module docstring).
    """
    d = sum(n for _, n in groups)
    if d < 2 or nbytes <= 0:
        return 0.0
    return AllreduceRings.of(groups, net, algorithm).time_s(nbytes, efficiency)


def tree_allreduce_s(groups: list[Group], nbytes: float, net: NetworkModel) -> float:
    """Seconds of NCCL's tree all-reduce of `nbytes` over `groups` (from `group_members`), the
    algorithm NCCL takes for small messages across nodes: a chain through the ranks of each node and
    a binary tree over the N nodes, the bytes reduced up it and broadcast down:
        T = 2·((r - 1)·h_node + ⌈log2 N⌉·h),
    r the most members on one node, h_node one message of `nbytes` between two of them (the slowest
    such link: latency + streaming), h the same between two nodes (the slowest pair of the members'
    (zone, GPU type)s). NCCL's tuning model prices the tree's latency so (nccl src/graph/tuning.cc,
    `ncclTopoTuneModel`: baseLat + 2·((nRanks/nNodes - 1)·intraLat + log2(nNodes)·interLat)); the
    bytes of a small message move in one chunk per hop. Members without a node are a node each; no
    backend cost (`CollectiveCost`) is added. 0 for a single member."""
    per_node: Counter[str] = Counter()
    kinds: dict[tuple[str, str], int] = {}  # (zone, GPU type) -> nodes of it
    alone = 0
    for m, n in groups:
        if m.node is None:
            alone += n
            kinds[(m.zone, m.gpu)] = kinds.get((m.zone, m.gpu), 0) + n
        else:
            kinds.setdefault((m.zone, m.gpu), 0)
            if per_node[m.node] == 0:
                kinds[(m.zone, m.gpu)] += 1
            per_node[m.node] += n
    nodes = len(per_node) + alone
    r = max(per_node.values(), default=1)
    if nodes + r < 3:  # a single member
        return 0.0

    def hop(a: tuple[str, str], b: tuple[str, str], on_node: bool) -> float:
        return (net.hop_latency_s(*a, *b, same_node=on_node)
                + net.stream_time_s(*a, *b, nbytes, same_node=on_node))

    inside = max((hop((m.zone, m.gpu), (m.zone, m.gpu), True) for m, _ in groups
                  if m.node is not None and per_node[m.node] > 1), default=0.0)
    between = max((hop(a, b, False) for a in kinds for b in kinds if a != b or kinds[a] > 1), default=0.0)
    return 2.0 * ((r - 1) * inside + math.ceil(math.log2(nodes)) * between)


RING_STEPS = {Collective.ALL_REDUCE: 2, Collective.ALL_GATHER: 1, Collective.REDUCE_SCATTER: 1}
"""Ring steps per member (x (t - 1)) of each collective."""


def tp_collective_time_s(net: NetworkModel, zone: str, gpu: str, tp: int, kind: Collective, nbytes: float) -> float:
    """Seconds of one collective over a TP group of `tp` GPUs inside one node, on the intra-node link
    (`NetworkModel` same-node link: measured intra-node fit, cluster override or catalog): a ring of
    k = RING_STEPS[kind]·(tp - 1) steps, each moving nbytes / tp (nbytes = the full tensor), plus
    the backend's cost of one call (`NetworkModel.collective`):
        T = startup_s + k · transfer(nbytes / tp) + k · (nbytes / tp) / processing_bytes_per_s.
    0 at TP 1."""
    if tp < 2 or nbytes <= 0:
        return 0.0
    steps = RING_STEPS[kind] * (tp - 1)
    step = net.transfer_time_s(zone, gpu, zone, gpu, nbytes / tp, same_node=True)
    return net.collective.startup_s + steps * step + net.collective.processing_s(steps * nbytes / tp)


@dataclass(frozen=True)
class RingEdges:
    """The edges between zones of a flat ring (ring order, zones contiguous: an edge inside a zone
    pays nothing) without its bytes: `fraction` = 2(D-1)/D, the share of a replica's bytes each edge
    carries in an all-reduce, and per edge a -> b (a's sends) the zones and the $/GB a's provider
    charges for their link class (across providers: a's internet egress,
    `catalog.Clouds.egress_between`). Built once, priced for any bytes: `simulator.sync.stage_sync`
    keeps one per shape of groups."""

    fraction: float
    edges: tuple[tuple[str, str, float], ...]

    @classmethod
    def of(cls, groups: list[Group], net: NetworkModel) -> "RingEdges":
        """The edges between zones of the ring over `groups`; none for fewer than two members or a
        single zone."""
        d = sum(n for _, n in groups)
        if d < 2 or len({m.zone for m, _ in groups}) == 1:
            return cls(0.0, ())
        prov = net.cluster.prov
        zones = [z for z, _ in groupby(m.zone for m, _ in groups)]
        edges = []
        for a, b in zip(zones, zones[1:] + zones[:1]):
            lc = net.link_class(a, b)
            if lc not in (LinkClass.SAME_NODE, LinkClass.SAME_ZONE):
                edges.append((a, b, prov.egress_between(a, b, lc)))
        return cls(2 * (d - 1) / d, tuple(edges))

    def crossings(self, nbytes: float) -> list[Crossing]:
        """Each edge's crossing in one all-reduce of `nbytes`: fraction x nbytes, at its $/GB."""
        if nbytes <= 0:
            return []
        per_edge = self.fraction * nbytes
        return [Crossing.between(a, b, per_edge, per_edge / 1e9 * usd_per_gb) for a, b, usd_per_gb in self.edges]

    def egress(self, nbytes: float) -> tuple[float, float]:
        """(bytes crossing zones, egress $) of one all-reduce of `nbytes`: the totals of `crossings`,
        added in their order (`traffic.totals`), without making them."""
        moved, usd = 0.0, 0.0
        if nbytes > 0:
            per_edge = self.fraction * nbytes
            for _, _, usd_per_gb in self.edges:
                moved += per_edge
                usd += per_edge / 1e9 * usd_per_gb
        return moved, usd


def ring_crossings(groups: list[Group], nbytes: float, net: NetworkModel) -> list[Crossing]:
    """The edges between zones of a flat ring over `groups` (ring order, zones contiguous) in one
    all-reduce of `nbytes`: each edge a -> b carries 2(D-1)/D x nbytes, priced by a's provider for its
    link class (`RingEdges`). Empty for fewer than two members, no bytes or a single zone."""
    return RingEdges.of(groups, net).crossings(nbytes)


def ring_egress(groups: list[Group], nbytes: float, net: NetworkModel) -> tuple[float, float]:
    """(bytes crossing zones, egress $) per all-reduce: the totals of `ring_crossings`."""
    return RingEdges.of(groups, net).egress(nbytes)


def all_to_all_time_s(net: NetworkModel, members: Sequence[Member], nbytes: float, shares: Sequence[float]) -> float:
    """Seconds of one all-to-all among `members` (an EP group's replicas, in EP-rank order) in which
    each TP rank of member j sends nbytes x shares[q] to the same TP rank of every other member q
    (each TP rank runs its own all-to-all among equal TP ranks, `runtime.moe`), all at once:

        T = startup_s + max_j max(T_node(j), T_out(j))
        T_node(j) = transfer(sum of j's bytes to the members on its node)  over the intra-node link
        T_out(j)  = transfer(F flows of B / F bytes)  over the slowest link from j's node to another
                    member's, F = k·t·(members off the node) flows leaving the node at once,
                    B = their bytes (k members of the group on j's node, t TP ranks each)

    The intra-node part goes over each GPU's own link (one flow, as the TP rings of
    `tp_collective_time_s`), the rest shares the node's links with every flow that leaves it
    (`catalog.Link`: the NIC divided among its flows), so a group spanning a slow link is charged
    that link for all of its off-node bytes. 0 for fewer than two members or no bytes."""
    if len(members) < 2 or nbytes <= 0:
        return 0.0
    worst = 0.0
    for j, src in enumerate(members):
        near = [q for q, m in enumerate(members) if q != j and same_node(src, m)]
        far = [q for q, m in enumerate(members) if q != j and not same_node(src, m)]
        t_node = net.transfer_time_s(src.zone, src.gpu, src.zone, src.gpu, sum(nbytes * shares[q] for q in near),
                                     same_node=True)
        t_out = 0.0
        if far:
            k = 1 + len(near)
            flows = k * src.tp * len(far)
            per_flow = k * src.tp * sum(nbytes * shares[q] for q in far) / flows
            t_out = max(net.transfer_time_s(src.zone, src.gpu, members[q].zone, members[q].gpu, per_flow, flows=flows)
                        for q in far)
        worst = max(worst, t_node, t_out)
    return net.collective.startup_s + worst


def all_to_all_crossings(net: NetworkModel, members: Sequence[Member], nbytes: float,
                         shares: Sequence[float]) -> list[Crossing]:
    """The bytes between zones of one all-to-all of `all_to_all_time_s` (same arguments): per
    ordered pair j -> q of members in different zones, its t TP ranks' nbytes x shares[q], priced
    by j's provider for the pair's link class (`catalog.Clouds.egress_between`)."""
    prov = net.cluster.prov
    out = []
    for j, src in enumerate(members):
        for q, dst in enumerate(members):
            if q == j or src.zone == dst.zone:
                continue
            lc = net.link_class(src.zone, dst.zone)
            if lc in (LinkClass.SAME_NODE, LinkClass.SAME_ZONE):
                continue
            moved = src.tp * nbytes * shares[q]
            out.append(Crossing.between(src.zone, dst.zone, moved, moved / 1e9 * prov.egress_between(src.zone, dst.zone, lc)))
    return out
