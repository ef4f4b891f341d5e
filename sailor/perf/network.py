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

Our link file (JSON, schema "sailor.network/1"):
  {"schema", "classes": {link_class: {"latency_s", "bandwidth_bytes_per_s", "flow_bandwidth_bytes_per_s"?}},
   "links": [{"src_zone", "src_gpu", "dst_zone", "dst_gpu", "flows", "latency_s", "bandwidth_bytes_per_s",
              "same_node"?}]}
`bandwidth_bytes_per_s` of a link entry is the aggregate of its `flows`; `same_node: true` marks a
link measured between processes of one machine (what `sailor profile network` measures).
An optional `"collective": {"startup_s", "processing_bytes_per_s"?}` is the communication backend's
cost of a collective beyond its ring's point-to-point steps (`CollectiveCost`), fitted by
`sailor profile network` on its all-reduce sweep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from sailor import catalog
from sailor.catalog import Link, LinkClass
from sailor.core.errors import SailorInputError, did_you_mean, show
from sailor.core.fileio import load_json
from sailor.core.limits import MAX_BANDWIDTH_BYTES_PER_S, MAX_GPUS_PER_NODE, MAX_SECONDS, MIN_BANDWIDTH_BYTES_PER_S
from sailor.core.schema import Checks
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


def network_for(cluster: ClusterSpec, path: str | Path | None = None) -> NetworkModel:
    """The cluster's network: class defaults, plus measurements from `path` (our link file, or a
    Sailor network folder / `multizone_bandwidths*.json` file; format detected)."""
    net = NetworkModel(cluster=cluster)
    if path is None:
        return net
    p = Path(path)
    if p.is_dir():
        files = [p / "multizone_bandwidths_het.json", p / "multizone_bandwidths.json"]
        het = next((f for f in files if f.exists()), None)
        if het is None:
            raise SailorInputError("folder holds no multizone_bandwidths_het.json or multizone_bandwidths.json",
                                   source=str(p))
        _import_sailor_multizone(net, het)
        if (p / "intra_node_bandwidths.json").exists():
            _import_sailor_intra(net, p / "intra_node_bandwidths.json")
        net.source = f"sailor:{p}"
        return net
    data = load_json(p)
    if isinstance(data, dict) and data.get("schema") == SCHEMA:
        return network_from_ours(cluster, data, str(p))
    elif isinstance(data, dict) and "schema" in data and not isinstance(data["schema"], dict):
        raise unknown_schema(data["schema"], str(p))  # a zone of a Sailor file holds a mapping, not a name
    elif isinstance(data, dict) and data:
        _import_unmarked(net, p, data)
    else:
        raise SailorInputError("not a network file", source=str(p), fix=ACCEPTED)
    net.source = str(p)
    return net


# What --network takes, said by every error about a file that is none of them.
ACCEPTED = (f"--network takes our link file with \"schema\": \"{SCHEMA}\" (`sailor profile network` writes it), a"
            " Sailor multizone_bandwidths*.json file (zone -> GPU type -> count -> ...) or a Sailor network folder")


def _import_unmarked(net: NetworkModel, path: Path, data: dict[str, Any]) -> None:
    """A file without a "schema" field, read as a Sailor bandwidth file (`_import_sailor_multizone`).
    Its errors say that the file has no schema line and what --network takes: a field of the
    published format alone would mislead the author of a link file that lost its schema line (one
    with our link file's top-level fields is told so, and to add the line)."""
    ours = [k for k in data if k in TOP_KEYS]
    if ours:
        raise SailorInputError(f"no \"schema\" field, but our link file's fields ({', '.join(ours)})", source=str(path),
                               fix=f"add \"schema\": \"{SCHEMA}\" as `sailor profile network` writes it")
    try:
        _import_sailor_multizone(net, path, data)
    except SailorInputError as e:
        inner = ": ".join(x for x in (e.field, e.message) if x)
        raise SailorInputError(f"not our link file (no \"schema\" field) and not a Sailor bandwidth file ({inner})",
                               source=str(path), fix=ACCEPTED) from None


def network_from_ours(cluster: ClusterSpec, data: dict[str, Any], source: str) -> NetworkModel:
    """The cluster's network with the measurements of our link file's content `data` (checked as
    `network_for` checks a file; `source` names it in errors)."""
    net = NetworkModel(cluster=cluster)
    _import_ours(net, data, source)
    net.source = source
    return net


def unknown_schema(schema: Any, source: str) -> SailorInputError:
    """The error for a file whose "schema" is not `SCHEMA`: another version of ours, or another
    kind of Sailor file (a profile passed as --network)."""
    fix = "measure again with `sailor profile network`, or set the schema this file follows"
    if isinstance(schema, str) and schema.startswith("sailor.profiles/"):
        fix = "that names a profile file: pass it with --profiles"
    return SailorInputError(f"unknown schema {show(schema)} (this Sailor reads {SCHEMA!r})", source=source,
                            field="schema", fix=fix)


MAX_FIT_COEFFICIENT = 1e6  # GB/s per log2 unit: |c| above it gives bandwidths past 1 PB/s inside the fit range


def _leaf(v: Any, c: Checks, where: str) -> CurveFit:
    """A Sailor fit `[[c0, c1, c2], max_bytes_per_s]` (coefficients finite and at most
    MAX_FIT_COEFFICIENT in size, the cap >= 0)."""
    coeffs, mx = c.sequence(v, where, "[[c0, c1, c2], max_bytes_per_s]", min_len=2, max_len=2)
    c0, c1, c2 = (c.number(x, f"{where}.0.{k}", lo=-MAX_FIT_COEFFICIENT, hi=MAX_FIT_COEFFICIENT) for k, x in
                  enumerate(c.sequence(coeffs, f"{where}.0", "[c0, c1, c2]", min_len=3, max_len=3)))
    return CurveFit(c0, c1, c2, c.number(mx, f"{where}.1", lo=0, hi=MAX_BANDWIDTH_BYTES_PER_S, unit="bytes/s"))


def _import_sailor_multizone(net: NetworkModel, path: Path, data: Any = None) -> None:
    """[send_zone][send_gpu][send_count][recv_zone][recv_gpu][recv_count] = [[c0,c1,c2], max_bw].
    We keep entries with send_count == recv_count (both nodes run the same number of flows); GPU
    types we do not catalogue are skipped. Every level is checked (mappings with string keys, counts
    whole numbers, leaves finite)."""
    c = Checks(str(path))
    data = data if data is not None else load_json(path)
    form = "zone -> GPU type -> count -> zone -> GPU type -> count -> [[c0, c1, c2], max_bytes_per_s]"
    for sz, by_gpu in c.mapping(data, "", form).items():
        for sg, by_cnt in c.mapping(by_gpu, sz, "GPU type -> count -> ...").items():
            g1 = catalog.known_gpu(sg)
            for cnt, by_rz in c.mapping(by_cnt, f"{sz}.{sg}", "count -> zone -> ...").items():
                flows = c.whole_key(cnt, f"{sz}.{sg}.{cnt}", lo=1, hi=MAX_GPUS_PER_NODE)
                for rz, by_rg in c.mapping(by_rz, f"{sz}.{sg}.{cnt}", "zone -> GPU type -> ...").items():
                    for rg, by_rc in c.mapping(by_rg, f"{sz}.{sg}.{cnt}.{rz}", "GPU type -> count -> fit").items():
                        where = f"{sz}.{sg}.{cnt}.{rz}.{rg}"
                        g2 = catalog.known_gpu(rg)
                        for rc, leaf in c.mapping(by_rc, where, "count -> fit").items():
                            c.whole_key(rc, f"{where}.{rc}", lo=1, hi=MAX_GPUS_PER_NODE)
                            fit = _leaf(leaf, c, f"{where}.{rc}")
                            if g1 is not None and g2 is not None and rc == cnt:
                                net.fits[(sz, g1, rz, g2, flows)] = fit


def _import_sailor_intra(net: NetworkModel, path: Path) -> None:
    """[gpu][count] = [[c0, c1, c2], max_bw] inside one node (unknown GPU types skipped)."""
    c = Checks(str(path))
    for g, by_cnt in c.mapping(load_json(path), "", "GPU type -> count -> [[c0, c1, c2], max_bytes_per_s]").items():
        gpu = catalog.known_gpu(g)
        for cnt, leaf in c.mapping(by_cnt, g, "count -> fit").items():
            flows = c.whole_key(cnt, f"{g}.{cnt}", lo=1, hi=MAX_GPUS_PER_NODE)
            fit = _leaf(leaf, c, f"{g}.{cnt}")
            if gpu is not None:
                net.intra_fits[(gpu, flows)] = fit


def _link(v: Any, c: Checks, where: str) -> Link:
    """{latency_s, bandwidth_bytes_per_s, flow_bandwidth_bytes_per_s?} (and, in `links`, its
    endpoints) as a Link, each in range."""
    c.mapping(v, where, "latency_s and bandwidth_bytes_per_s")
    for key in ("latency_s", "bandwidth_bytes_per_s"):
        if key not in v:
            raise c.error("missing field", f"{where}.{key}")
    flow = v.get("flow_bandwidth_bytes_per_s")
    return Link(c.number(v["latency_s"], f"{where}.latency_s", lo=0, hi=MAX_SECONDS, unit="seconds"),
                c.number(v["bandwidth_bytes_per_s"], f"{where}.bandwidth_bytes_per_s", lo=MIN_BANDWIDTH_BYTES_PER_S,
                         hi=MAX_BANDWIDTH_BYTES_PER_S, unit="bytes/s"),
                None if flow is None else c.number(flow, f"{where}.flow_bandwidth_bytes_per_s",
                                                   lo=MIN_BANDWIDTH_BYTES_PER_S, hi=MAX_BANDWIDTH_BYTES_PER_S,
                                                   unit="bytes/s"))


# The keys of our link file (module docstring; `sailor profile network` adds the measured sweep);
# any other is refused rather than ignored.
TOP_KEYS = ("schema", "source", "device", "versions", "date", "classes", "links", "sweep", "allreduce", "collective")
COLLECTIVE_KEYS = ("startup_s", "processing_bytes_per_s", "backend", "fit_relative_error")
BACKENDS = ("nccl", "gloo")  # torch.distributed's backends of Sailor's runtime: CUDA devices, CPU


def backend_for(device: str) -> str:
    """The torch.distributed backend of Sailor's runtime on `device` ("cuda" or "cpu"): what every
    rank's process group is made with (`runtime.worker`, `runtime.profiler`, `runtime.netprofile`)."""
    return BACKENDS[0] if device == "cuda" else BACKENDS[1]
LINK_KEYS = ("src_zone", "src_gpu", "dst_zone", "dst_gpu", "flows", "latency_s", "bandwidth_bytes_per_s", "same_node")


def _import_ours(net: NetworkModel, data: dict[str, Any], source: str) -> None:
    c = Checks(source)
    c.known_keys(data, "", TOP_KEYS)
    classes = c.mapping(data.get("classes") or {}, "classes", "link class -> link")
    links = c.sequence(data.get("links") or [], "links", "links")
    for name, v in classes.items():
        if name not in {lc.value for lc in LinkClass}:
            raise c.error(f"unknown link class {show(name)}", f"classes.{name}",
                          fix=f"one of {', '.join(lc.value for lc in LinkClass)}")
        net.class_links[LinkClass(name)] = _link(v, c, f"classes.{name}")
        c.known_keys(v, f"classes.{name}", ("latency_s", "bandwidth_bytes_per_s", "flow_bandwidth_bytes_per_s"))
    for k, v in enumerate(links):
        where = f"links.{k}"
        c.known_keys(c.mapping(v, where, ", ".join(LINK_KEYS)), where, LINK_KEYS)
        for key in ("src_zone", "src_gpu", "dst_zone", "dst_gpu"):
            if key not in v:
                raise c.error("missing field", f"{where}.{key}")
        link = _link(v, c, where)
        gpus = [_gpu(v[key], c, f"{where}.{key}") for key in ("src_gpu", "dst_gpu")]
        on_node = v.get("same_node", False)
        if not isinstance(on_node, bool):
            raise c.error("must be true or false", f"{where}.same_node")
        key = (_zone(v["src_zone"], c, f"{where}.src_zone", net.cluster), gpus[0],
               _zone(v["dst_zone"], c, f"{where}.dst_zone", net.cluster), gpus[1],
               c.whole(v.get("flows", 1), f"{where}.flows", lo=1, hi=MAX_GPUS_PER_NODE))
        table = net.node_links if on_node else net.links
        if key in table:
            raise c.error("a second link for the same endpoints and flows", where)
        table[key] = link
    if data.get("collective") is not None:
        net.collective = _collective(data["collective"], c)


def _collective(v: Any, c: Checks) -> CollectiveCost:
    """`{"startup_s", "processing_bytes_per_s"?, "backend"? (default nccl)}` as a CollectiveCost (`fit_relative_error`, the
    fit's own figure, is kept in the file for the reader only)."""
    c.known_keys(c.mapping(v, "collective", "startup_s and processing_bytes_per_s"), "collective", COLLECTIVE_KEYS)
    if "startup_s" not in v:
        raise c.error("missing field", "collective.startup_s")
    rate = v.get("processing_bytes_per_s")
    backend = v.get("backend", "nccl")
    if backend not in BACKENDS:
        raise c.error(f"unknown backend {show(backend)}", "collective.backend", fix=" or ".join(BACKENDS))
    return CollectiveCost(
        c.number(v["startup_s"], "collective.startup_s", lo=0, hi=MAX_SECONDS, unit="seconds"),
        None if rate is None else c.number(rate, "collective.processing_bytes_per_s", lo=MIN_BANDWIDTH_BYTES_PER_S,
                                           hi=MAX_BANDWIDTH_BYTES_PER_S, unit="bytes/s"), backend)


def _zone(name: Any, c: Checks, where: str, cluster: ClusterSpec) -> str:
    """A link's zone: one of the cluster's, or of its provider's (a file measured over more zones than
    this cluster uses is fine). Any other would never be looked up: the link would be silently unused."""
    zone = c.name(name, where, "a zone")
    known = set(cluster.zones) | set(cluster.prov.zone_region)
    if zone not in known:
        raise c.error(f"unknown zone {show(zone)}: neither the cluster nor its provider ({cluster.prov.name}) has it",
                      where, fix=did_you_mean(zone, known) or f"the cluster's zones: {', '.join(sorted(cluster.zones))}")
    return zone


def _gpu(name: Any, c: Checks, where: str) -> str:
    try:
        return catalog.canonical_gpu(name)
    except SailorInputError as e:
        raise e.located(source=c.source, field_prefix=where) from None
