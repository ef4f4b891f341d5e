"""Reading a network file into a `NetworkModel` (`network_for`): our link file, or the public Sailor
network folder / `multizone_bandwidths*.json` file (format detected), every field checked.

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

from pathlib import Path
from typing import Any

from sailor import catalog
from sailor.catalog import Link, LinkClass
from sailor.core.errors import SailorInputError, did_you_mean, show
from sailor.core.fileio import load_json
from sailor.core.limits import MAX_BANDWIDTH_BYTES_PER_S, MAX_GPUS_PER_NODE, MAX_SECONDS, MIN_BANDWIDTH_BYTES_PER_S
from sailor.core.schema import Checks
from sailor.perf.network import BACKENDS, SCHEMA, CollectiveCost, CurveFit, NetworkModel
from sailor.specs.cluster import ClusterSpec

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
