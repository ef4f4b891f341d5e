"""Network model: how long moving bytes between two GPUs takes, and the links collectives run on.

A link between two replicas is chosen by where they sit: same node (intra-node link), same zone,
same region, same continent, intercontinental (`catalog.LinkClass`). Where the launcher puts two
replicas on one node (`sailor.plan.placement.rank_layout`) their link is the intra-node one. In order of
preference, the bandwidth of `flows` concurrent flows of x bytes each between two nodes comes from:
1. a measured curve (the public Sailor fits: bandwidth in GB/s of a message of x bytes =
   c0·L² + c1·L + c2, L = log2(x / 1e6), fitted on NCCL sweeps from 64 KiB to 1 GiB, the *aggregate*
   of `count` concurrent flows). It is never evaluated outside that range (x is clamped into it);
   where it is not positive there, the next source is used. A flow count that was not measured
   uses the nearest one: fewer flows get the measured per-flow rate, more flows share the aggregate
   of the largest measured count (the NIC is full);
2. a measured α–β link of our link file (`sailor profile network`), per flow count, same rule;
3. the default link of the class: the network file's classes, else the cluster spec's per-zone and
   per-class overrides, else the provider's catalog link (`catalog.Link`: one NIC per node shared by
   every flow, an optional per-flow cap; between two providers the cross-provider link of the class,
   `catalog.Clouds`). Inside a node without any of these: one direction of
   the GPU catalog's intra-node bandwidth at the share NCCL reaches of it, shared by the flows, and
   5 µs.
A transfer costs latency + flows·x / aggregate bandwidth (a measured curve already holds the
latency of the messages it was measured with). Collectives (`simulator.collectives`) use the two
parts separately: `hop_latency_s` once per ring step, `stream_time_s` for the bytes.

Our link file, its format and its readers: `perf.network_files`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

from sailor import catalog
from sailor.catalog import Link, LinkClass
from sailor.specs.cluster import ClusterSpec

SCHEMA = "sailor.network/1"
FIT_MIN_BYTES = 64 * 1024  # range of the Sailor NCCL sweeps
FIT_MAX_BYTES = 1 << 30
# Inside a node without a measurement: NVLink/PCIe peer-to-peer latency, ~5 µs (NCCL's own tuning
# table puts intra-node LL/Simple latencies at 0.6-6 µs per hop; nccl src/graph/tuning.cc).
INTRA_NODE_LATENCY_S = 5e-6
RING_MEMO_MAX = 4096  # rings `NetworkModel.ring_links` keeps (a planning call asks for ~40k on 7 zones)

Key = tuple[str, str, str, str]  # src_zone, src_gpu, dst_zone, dst_gpu


@dataclass(frozen=True)
class CollectiveCost:
    """What the communication backend adds to a collective beyond the point-to-point steps of its
    ring (`simulator.collectives`), charged once per collective call:
        T = startup_s + T_ring(links) + B / processing_bytes_per_s,
    B = the bytes one flow sends in the collective (2(D-1)/D · S/f of a ring all-reduce).
    `startup_s` (α_c, s): what a call costs before its first byte moves (the backend's dispatch and
    the members' wait for each other to enter it). `processing_bytes_per_s` (ρ): the rate of the
    per-byte work that does not overlap the transfers (copies and the reduction's sums, done on the
    CPU by gloo, step after step of its ring); None = it overlaps them.

    The default charges nothing beyond the ring: NCCL pipelines its reductions with the transfers
    in chunks, and its tuning model puts a collective's base latency at 6.6-8.4 µs for the ring
    algorithm (nccl src/graph/tuning.cc, `baseLat`), below the per-hop latencies the ring already
    charges. A measured value comes from `sailor profile network` (`runtime.netprofile.fit_collective`).
    """

    startup_s: float = 0.0
    processing_bytes_per_s: float | None = None
    backend: str = "nccl"
    """The backend measured ("nccl" or "gloo", `BACKENDS`): NCCL runs a small all-reduce as a tree
    where that is cheaper than its ring (`simulator.collectives.tree_allreduce_s`); gloo runs its
    ring whatever the size (`gloo::allreduce`'s default algorithm)."""

    def processing_s(self, flow_bytes: float) -> float:
        """Seconds of the per-byte work of one flow that sends `flow_bytes` in a collective:
        flow_bytes / processing_bytes_per_s (0 without a rate)."""
        rate = self.processing_bytes_per_s
        return flow_bytes / rate if rate else 0.0


@dataclass(frozen=True)
class CurveFit:
    """Measured bandwidth curve: GB/s = c0·L² + c1·L + c2 with L = log2(bytes / 1e6), valid on
    [FIT_MIN_BYTES, FIT_MAX_BYTES], capped at `max_bytes_per_s`."""

    c0: float
    c1: float
    c2: float
    max_bytes_per_s: float

    def bandwidth(self, nbytes: float) -> float | None:
        """Bytes/s for a message of `nbytes` (clamped into the fitted range); None where the fit is
        not positive (the caller then falls back to α–β)."""
        x = min(max(nbytes, FIT_MIN_BYTES), FIT_MAX_BYTES)
        lg = math.log2(x / 1e6)
        bw = (self.c0 * lg * lg + self.c1 * lg + self.c2) * 1e9
        if bw <= 0:
            return None
        return min(bw, self.max_bytes_per_s) if self.max_bytes_per_s > 0 else bw


def _scaled(aggregate: float, measured_flows: int, flows: int) -> float:
    """Aggregate bytes/s of `flows` flows from one measured at `measured_flows`: fewer flows get the
    measured per-flow rate, more flows share the measured aggregate (the NIC is full)."""
    return aggregate * min(flows, measured_flows) / measured_flows


@dataclass(frozen=True)
class _Route:
    """A measured curve (aggregate of `fit_flows` flows) if any, and the α–β link behind it:
    measured with `link_flows` flows, or a class default (`link_flows` None, its NIC shared)."""

    fit: CurveFit | None
    fit_flows: int
    link: Link
    link_flows: int | None

    def bytes_time(self, nbytes: float, flows: int) -> tuple[float, bool]:
        """(seconds for `flows` flows of `nbytes` bytes each without the link's latency, whether a
        curve gave it)."""
        if self.fit is not None:
            bw = self.fit.bandwidth(nbytes)
            if bw is not None:
                return flows * max(nbytes, FIT_MIN_BYTES) / _scaled(bw, self.fit_flows, flows), True
        if self.link_flows is None:
            agg = self.link.aggregate_bytes_per_s(flows)
        else:
            agg = _scaled(self.link.bandwidth_bytes_per_s, self.link_flows, flows)
        return flows * nbytes / agg, False


@dataclass
class NetworkModel:
    """Links of one cluster: measured (fits or α–β per GPU/zone pair) over class defaults.

    Attributes:
        cluster: zones -> regions, default links per class and zone (after its overrides), the
            all-reduce algorithm pin.
        fits: (src_zone, src_gpu, dst_zone, dst_gpu, flows) -> CurveFit between two nodes.
        links: same key -> Link (α–β measured by `sailor profile network`) between two nodes.
        node_links: same key -> Link measured between processes of one machine.
        intra_fits: (gpu, flows) -> CurveFit inside a node.
        class_links: link class -> Link overriding the cluster defaults.
        collective: the backend's cost per collective beyond the ring (`CollectiveCost`).
        source: where measurements came from ("defaults" when none).
    """

    cluster: ClusterSpec
    fits: dict[tuple[str, str, str, str, int], CurveFit] = field(default_factory=dict)
    links: dict[tuple[str, str, str, str, int], Link] = field(default_factory=dict)
    node_links: dict[tuple[str, str, str, str, int], Link] = field(default_factory=dict)
    intra_fits: dict[tuple[str, int], CurveFit] = field(default_factory=dict)
    class_links: dict[LinkClass, Link] = field(default_factory=dict)
    collective: CollectiveCost = CollectiveCost()
    source: str = "defaults"
    _flow_count_index: dict = field(default_factory=dict, repr=False, compare=False)
    _routes: dict = field(default_factory=dict, repr=False, compare=False)

    def link_class(self, zone_a: str, zone_b: str, same_node: bool = False) -> LinkClass:
        return LinkClass.SAME_NODE if same_node else self.cluster.prov.link_class(zone_a, zone_b)

    def default_link(self, lc: LinkClass, gpu: str, zone: str | None = None, other: str | None = None) -> Link:
        """The α–β link of a class when nothing measured applies: a measured class link (our link
        file), else the cluster spec's override (per zone for the links inside `zone`, then per
        class), else the catalog link between `zone` and `other` (across providers: the
        cross-provider link of the class, `catalog.Clouds`). Inside a node the last default is one direction
        of the GPU's intra-node link (half of the catalog's both-directions figure) at the fraction
        NCCL reaches of it (`catalog.Efficiency.intra_node`), with ~5 µs NVLink/PCIe latency."""
        if lc in self.class_links:
            return self.class_links[lc]
        inside = lc in (LinkClass.SAME_NODE, LinkClass.SAME_ZONE)
        link = self.cluster.link(lc, zone, None if inside else other)
        if link is not None:
            return link
        assert lc is LinkClass.SAME_NODE, lc
        spec = catalog.gpu(gpu)
        return Link(INTRA_NODE_LATENCY_S, spec.intra_node_bytes_per_s / 2 * spec.efficiency.intra_node)

    def _lookup(self, table: dict, key: Key, flows: int):
        """Exact flows, else the nearest measured flow count (same endpoints, either direction)."""
        index = self._flow_counts(table)
        for k in (key, (key[2], key[3], key[0], key[1])):
            if k + (flows,) in table:
                return table[k + (flows,)], flows
            counts = index.get(k)
            if counts:
                c = min(counts, key=lambda c: (abs(c - flows), c))
                return table[k + (c,)], c
        return None, None

    def _flow_counts(self, table: dict) -> dict[tuple, list[int]]:
        """Measured flow counts per endpoint pair of `table`, built once per table (the tables are
        filled when the model is loaded and not changed afterwards)."""
        cache = self._flow_count_index
        if id(table) not in cache or cache[id(table)][0] != len(table):
            index: dict[tuple, list[int]] = {}
            for (*rest, c) in table:
                index.setdefault(tuple(rest), []).append(c)
            cache[id(table)] = (len(table), index)
        return cache[id(table)][1]

    def _check_routes(self) -> None:
        """Drop the memoised routes when a table has grown since they were found."""
        sizes = (len(self.fits), len(self.links), len(self.node_links), len(self.intra_fits), len(self.class_links))
        if self._routes.get("sizes") != sizes:
            self._routes.clear()
            self._routes["sizes"] = sizes

    def ring_links(self, key: tuple, edges: Callable[[], Iterable[tuple[str, str, int, str, str, int, bool]]],
                   share: int = 1) -> tuple[float, tuple[tuple["_Route", int], ...]]:
        """For a ring's edges (sender zone, GPU, TP, receiver zone, GPU, TP, same node), each carrying
        t = max(1, min(TP)) flows per ring and `share` rings at once: (the slowest edge's
        `hop_latency_s`, the distinct (route, t) they stream over: `stream_time_s` of any edge is its
        route's `bytes_time`). Memoised under `key` (what determines the edges; `edges` lists them
        on a miss) with the routes, at most RING_MEMO_MAX rings: a full memo is emptied (a key holds
        a ring's every group, and the planner asks for tens of thousands of rings, each again only
        soon after: the collectives of one stage's sync)."""
        self._check_routes()
        memo = self._routes.setdefault("rings", {})
        if (key, share) not in memo:
            if len(memo) >= RING_MEMO_MAX:
                memo.clear()
            latency, links = 0.0, {}
            for za, ga, ta, zb, gb, tb, on_node in edges():
                t = max(1, min(ta, tb))
                route = self._route(za, ga, zb, gb, t * share, on_node)
                latency = max(latency, route.link.latency_s)
                links.setdefault((id(route), t), (route, t))
            memo[(key, share)] = (latency, tuple(links.values()))
        return memo[(key, share)]

    def _route(self, src_zone: str, src_gpu: str, dst_zone: str, dst_gpu: str, flows: int, same_node: bool) -> "_Route":
        """What moves bytes between the two GPUs' nodes: a measured curve if any, and the α–β link
        behind it (measured for this pair, else the class default). Memoised: the tables are filled
        when the model is loaded and not changed afterwards (a table that grows drops the memo)."""
        memo_key = (src_zone, src_gpu, dst_zone, dst_gpu, flows, same_node)
        self._check_routes()
        if memo_key not in self._routes:  # equal routes are one object (`ring_links` tells them apart by id)
            route = self._find_route(src_zone, src_gpu, dst_zone, dst_gpu, flows, same_node)
            self._routes[memo_key] = self._routes.setdefault(("route", route), route)
        return self._routes[memo_key]

    def _find_route(self, src_zone: str, src_gpu: str, dst_zone: str, dst_gpu: str, flows: int,
                    same_node: bool) -> "_Route":
        key = (src_zone, src_gpu, dst_zone, dst_gpu)
        if same_node:
            fit, got = (self.intra_fits.get((src_gpu, flows)), flows) if src_gpu == dst_gpu else (None, None)
            link, link_flows = self._lookup(self.node_links, key, flows)
        else:
            fit, got = self._lookup(self.fits, key, flows)
            link, link_flows = self._lookup(self.links, key, flows)
        if link is None:
            slow = min((src_gpu, dst_gpu), key=lambda g: catalog.gpu(g).intra_node_bytes_per_s)
            link = self.default_link(self.link_class(src_zone, dst_zone, same_node), slow, src_zone, dst_zone)
        return _Route(fit=fit, fit_flows=got or flows, link=link, link_flows=link_flows)

    def zone_class(self, zone: str, gpu: str) -> int:
        """What collectives and pipeline transfers among nodes of GPU type `gpu` inside `zone` read of
        the zone: its routes (measured curve and α–β link) between two of its nodes and inside one at
        every flow count up to the node size (a ring edge or a transfer carries at most a node's GPUs
        in flows), with no zone names. Pools of one class take the same time in every such collective
        and transfer; zones the model tells apart by nothing are one class. The class's number (equal
        numbers, equal classes), memoised with the routes."""
        self._check_routes()
        key = ("zone-class", zone, gpu)
        if key not in self._routes:
            links = (gpu, tuple(self._route(zone, gpu, zone, gpu, f, on)
                                for f in range(1, self.cluster.node_size(gpu) + 1) for on in (False, True)))
            numbers = self._routes.setdefault("zone-classes", {})
            self._routes[key] = numbers.setdefault(links, len(numbers))
        return self._routes[key]

    def hop_latency_s(self, src_zone: str, src_gpu: str, dst_zone: str, dst_gpu: str, *, flows: int = 1,
                      same_node: bool = False) -> float:
        """One-way latency (s) of one message between the two GPUs' nodes, paid once per ring step:
        the α of the α–β link behind the route (for a measured curve: its class's default link)."""
        return self._route(src_zone, src_gpu, dst_zone, dst_gpu, flows, same_node).link.latency_s

    def stream_time_s(self, src_zone: str, src_gpu: str, dst_zone: str, dst_gpu: str, nbytes: float, *,
                      flows: int = 1, same_node: bool = False) -> float:
        """Seconds `flows` concurrent flows take to move `nbytes` bytes each, without the per-message
        latency of an α–β link (a measured curve evaluated at `nbytes` keeps the start-up it was
        measured with). A ring adds `hop_latency_s` per step to this."""
        if nbytes <= 0:
            return 0.0
        return self._route(src_zone, src_gpu, dst_zone, dst_gpu, flows, same_node).bytes_time(nbytes, flows)[0]

    def transfer_time_s(self, src_zone: str, src_gpu: str, dst_zone: str, dst_gpu: str, nbytes: float, *,
                        flows: int = 1, same_node: bool = False) -> float:
        """Seconds for `flows` concurrent messages of `nbytes` bytes each between two nodes (or inside
        one node when `same_node`); 0 for 0 bytes.

        A measured curve already includes latency: time = max(x, 64 KiB) · flows / aggregate bw(x),
        the fit evaluated only inside its range. Otherwise α + flows·x / aggregate β of the measured
        α–β link or the class default (its NIC shared by the flows, see `catalog.Link`).
        """
        if nbytes <= 0:
            return 0.0
        route = self._route(src_zone, src_gpu, dst_zone, dst_gpu, flows, same_node)
        t, from_curve = route.bytes_time(nbytes, flows)
        return t if from_curve else route.link.latency_s + t

    def p2p_time_s(self, src_zone: str, src_gpu: str, dst_zone: str, dst_gpu: str, nbytes: float, *,
                   same_node: bool = False) -> float:
        """Seconds to send one message of `nbytes` bytes (one flow); 0 for 0 bytes."""
        return self.transfer_time_s(src_zone, src_gpu, dst_zone, dst_gpu, nbytes, same_node=same_node)


BACKENDS = ("nccl", "gloo")  # torch.distributed's backends of Sailor's runtime: CUDA devices, CPU


def backend_for(device: str) -> str:
    """The torch.distributed backend of Sailor's runtime on `device` ("cuda" or "cpu"): what every
    rank's process group is made with (`runtime.worker`, `runtime.profiler`, `runtime.netprofile`)."""
    return BACKENDS[0] if device == "cuda" else BACKENDS[1]
