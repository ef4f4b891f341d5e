"""GPU and cloud catalogs: what each GPU type can do and what each zone charges.

Data lives next to this file (every figure cites its source there): `gpus.yaml` (GPU types),
`gcp.yaml` (GCP and `local`), `aws.yaml`, `azure.yaml` (providers) and `clouds.yaml` (links between
providers); this module only reads it. Lookup semantics:
- GPU types are looked up by canonical name or alias (`GH-96` -> `GH200-96`); an unknown type raises
  `SailorInputError` with a "did you mean".
- A zone belongs to exactly one region, a region to one provider and one continent (zone and region
  names are unique across providers, so a zone names its provider). An unknown zone raises.
- Prices: a cluster spec may override per GPU type or per (zone, GPU type); otherwise the provider's
  list price for the zone's region, else its provider-wide one. A GPU type with no price raises
  (never a silent zero).
- Offers (`Provider.offers`): gcp lists the zones of each GPU type (`gpu_zones`), aws and azure the
  types each region prices; a type neither lists is unknown, which any zone may offer. A cluster
  spec offering a type in a zone known not to offer it is refused, unless it prices the type in
  that zone (`ClusterSpec.check_catalog_offers`: the user knows better than this catalog).
- Several providers (`clouds`): pairs inside one provider keep its link classes, links and egress;
  pairs across providers are same_continent or intercontinental by continent, take the
  `clouds.yaml` links, and pay the sending provider's internet egress.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from importlib import resources
from typing import Literal

from sailor.core.errors import SailorInputError, unknown_name
from sailor.core.fileio import parse_yaml

Dtype = Literal["fp32", "fp16", "bf16"]


class LinkClass(str, Enum):
    """Where two GPUs sit relative to each other; decides link speed and egress price."""

    SAME_NODE = "same_node"
    SAME_ZONE = "same_zone"
    SAME_REGION = "same_region"
    SAME_CONTINENT = "same_continent"
    INTERCONTINENTAL = "intercontinental"


@dataclass(frozen=True)
class Efficiency:
    """Fractions of a GPU's datasheet figures that its kernels reach (sources in gpus.yaml): large
    GEMMs (`matmul`, of the dense peak), streaming kernels (`memory`, of the HBM bandwidth), SDPA
    flash attention (`attention`, of the dense peak) and NCCL point-to-point inside a node
    (`intra_node`, of the per-direction link bandwidth)."""

    matmul: float
    memory: float
    attention: float
    intra_node: float


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type.

    Attributes:
        name: canonical name, e.g. "A100-40".
        memory_bytes: device memory (bytes).
        peak_flop_per_s: dense peak FLOP/s per dtype; None where the dtype has no tensor-core path.
        hbm_bytes_per_s: device-memory bandwidth (bytes/s).
        gpus_per_node: GPUs in one node (TP never crosses a node).
        intra_node_bytes_per_s: GPU-to-GPU bandwidth inside a node (bytes/s, both directions added).
        framework_bytes: memory beyond tensors (CUDA context, workspaces) per GPU (bytes).
        efficiency: what its kernels reach of these figures (`Efficiency`).
    """

    name: str
    memory_bytes: int
    peak_flop_per_s: dict[str, float | None]
    hbm_bytes_per_s: float
    gpus_per_node: int
    intra_node_bytes_per_s: float
    framework_bytes: int
    efficiency: Efficiency

    def peak(self, dtype: Dtype) -> float:
        """Dense peak FLOP/s for `dtype`; falls back to fp32 where the dtype has no fast path."""
        value = self.peak_flop_per_s.get(dtype)
        return float(value) if value else float(self.peak_flop_per_s["fp32"])


@dataclass(frozen=True)
class Link:
    """A link between two nodes (or two GPUs of one node): one NIC per node whose bandwidth all
    concurrent flows share, and an optional cap on what one flow reaches.

    time(k flows of x bytes each) = latency_s + k·x / min(k · flow_bandwidth_bytes_per_s,
    bandwidth_bytes_per_s): k flows over one NIC take k times one flow once the NIC is the
    bottleneck (8 flows of x take 8x the time of one flow of x when one flow fills the NIC).

    Attributes:
        latency_s: one-way latency per message (s), paid once per transfer and per ring hop.
        bandwidth_bytes_per_s: the NIC (or NVLink/PCIe inside a node), shared by all flows.
        flow_bandwidth_bytes_per_s: most one flow reaches (a single TCP/NCCL connection seldom
            fills a cloud NIC); None = one flow can fill the NIC.
    """

    latency_s: float
    bandwidth_bytes_per_s: float
    flow_bandwidth_bytes_per_s: float | None = None

    def aggregate_bytes_per_s(self, flows: int = 1) -> float:
        """Bytes/s that `flows` concurrent flows reach together: min(flows x per-flow cap, NIC)."""
        cap = self.flow_bandwidth_bytes_per_s
        return self.bandwidth_bytes_per_s if cap is None else min(flows * cap, self.bandwidth_bytes_per_s)

    def time_s(self, nbytes: float, flows: int = 1) -> float:
        """Seconds for `flows` concurrent transfers of `nbytes` bytes each (0 bytes cost nothing)."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + flows * nbytes / self.aggregate_bytes_per_s(flows)


@dataclass(frozen=True)
class Provider:
    """A cloud (or `local`): zones by region, list prices, egress prices and default links.

    Attributes:
        name: "gcp", "aws", "azure" or "local".
        zone_region: zone -> its region; region_continent: region -> continent (one vocabulary for
            every provider, so regions of two providers compare).
        prices_usd_per_gpu_hour: GPU type -> $/GPU-hour in every zone (empty where prices are per region).
        region_prices: region -> GPU type -> $/GPU-hour there (wins over the provider-wide price).
        gpu_zones: GPU type -> the zones known to offer it (types absent: unknown, any zone may).
        egress_usd_per_gb: $/GB per link class between two zones of this provider.
        internet_egress_usd_per_gb: $/GB of a byte leaving this provider (to another provider).
        links: default link per class between two nodes of this provider.
    """

    name: str
    zone_region: dict[str, str]
    region_continent: dict[str, str]
    prices_usd_per_gpu_hour: dict[str, float]
    egress_usd_per_gb: dict[LinkClass, float]
    links: dict[LinkClass, Link]
    region_prices: dict[str, dict[str, float]] = field(default_factory=dict)
    gpu_zones: dict[str, frozenset[str]] = field(default_factory=dict)
    internet_egress_usd_per_gb: float = 0.0

    @property
    def providers(self) -> tuple[str, ...]:
        """The providers this view spans: this one."""
        return (self.name,)

    def region(self, zone: str) -> str:
        """The region of `zone`; raises SailorInputError for an unknown zone."""
        if isinstance(zone, str) and zone in self.zone_region:
            return self.zone_region[zone]
        if isinstance(zone, str) and zone in self.region_continent:  # a region where a zone belongs
            zones = sorted(z for z, r in self.zone_region.items() if r == zone)
            raise SailorInputError(f"{zone!r} is a {self.name} region, not a zone",
                                   fix=f"name one of its zones: {', '.join(zones)}")
        raise unknown_name(f"{self.name} zone", zone, self.zone_region, known=_zones_in_short((self,)))

    def provider_of(self, zone: str) -> Provider:
        """The provider of `zone` (this one); raises SailorInputError for an unknown zone."""
        self.region(zone)
        return self

    def link_class(self, zone_a: str, zone_b: str) -> LinkClass:
        """Link class between two different nodes in `zone_a` and `zone_b`."""
        if zone_a == zone_b:
            return LinkClass.SAME_ZONE
        ra, rb = self.region(zone_a), self.region(zone_b)
        if ra == rb:
            return LinkClass.SAME_REGION
        if self.region_continent[ra] == self.region_continent[rb]:
            return LinkClass.SAME_CONTINENT
        return LinkClass.INTERCONTINENTAL

    def price(self, zone: str, gpu_name: str) -> float | None:
        """List $/GPU-hour of canonical GPU type `gpu_name` in `zone`: the zone's region price, else
        the provider-wide one; None when neither lists it. Raises SailorInputError for an unknown zone."""
        listed = self.region_prices.get(self.region(zone), {})
        return listed.get(gpu_name, self.prices_usd_per_gpu_hour.get(gpu_name))

    def offers(self, zone: str, gpu_name: str) -> bool | None:
        """Whether `zone` offers canonical GPU type `gpu_name`: from `gpu_zones`, else from the region
        prices (a region lists what it rents); None when the catalog does not say."""
        if gpu_name in self.gpu_zones:
            return zone in self.gpu_zones[gpu_name]
        if self.region_prices:
            return gpu_name in self.region_prices.get(self.region(zone), {})
        return None

    def offered_in(self, zone: str) -> list[str]:
        """The canonical GPU types `zone` is known to offer (`offers` True), sorted."""
        return [g for g in gpu_names() if self.offers(zone, g)]

    def zones_offering(self, gpu_name: str) -> list[str]:
        """The zones known to offer canonical GPU type `gpu_name` (`offers` True), sorted."""
        return sorted(z for z in self.zone_region if self.offers(z, gpu_name))

    def egress_between(self, src_zone: str, dst_zone: str, link_class: LinkClass) -> float:
        """$/GB of bytes sent from `src_zone` to `dst_zone`, whose nodes are `link_class` apart."""
        return self.egress_usd_per_gb[link_class]

    def link_between(self, zone_a: str, zone_b: str, link_class: LinkClass) -> Link | None:
        """Default link of class `link_class` between nodes in `zone_a` and `zone_b` (None for
        same_node when the provider has none: the GPU catalog's intra-node link applies)."""
        return self.links.get(link_class)


@dataclass(frozen=True)
class Clouds:
    """Several providers seen as one: a cluster spanning clouds (the same interface as `Provider`).

    Zones and regions are unique across the catalog, so each zone names its provider. Two zones of
    one provider use that provider's classes, egress and links; two zones of different providers are
    same_continent or intercontinental by their regions' continents, linked by `cross_links`
    (clouds.yaml), and a byte between them costs the sending provider's internet egress (ingress is
    free). Provider-wide attributes (`links`, `egress_usd_per_gb`, `prices_usd_per_gpu_hour`) are the
    first member's: the cluster's primary provider.
    """

    members: tuple[Provider, ...]
    cross_links: dict[LinkClass, Link]

    @property
    def name(self) -> str:
        return "+".join(p.name for p in self.members)

    @property
    def providers(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.members)

    @functools.cached_property
    def zone_region(self) -> dict[str, str]:
        return {z: r for p in self.members for z, r in p.zone_region.items()}

    @functools.cached_property
    def region_continent(self) -> dict[str, str]:
        return {r: c for p in self.members for r, c in p.region_continent.items()}

    @functools.cached_property
    def _owner(self) -> dict[str, Provider]:
        return {z: p for p in self.members for z in p.zone_region}

    @property
    def links(self) -> dict[LinkClass, Link]:
        return self.members[0].links

    @property
    def egress_usd_per_gb(self) -> dict[LinkClass, float]:
        return self.members[0].egress_usd_per_gb

    @property
    def prices_usd_per_gpu_hour(self) -> dict[str, float]:
        return self.members[0].prices_usd_per_gpu_hour

    def provider_of(self, zone: str) -> Provider:
        """The member provider of `zone`; raises SailorInputError for a zone none of them has."""
        if isinstance(zone, str) and zone in self._owner:
            return self._owner[zone]
        raise unknown_name(f"{self.name} zone", zone, self._owner, known=_zones_in_short(self.members))

    def region(self, zone: str) -> str:
        return self.provider_of(zone).region(zone)

    def link_class(self, zone_a: str, zone_b: str) -> LinkClass:
        pa, pb = self.provider_of(zone_a), self.provider_of(zone_b)
        if pa is pb:
            return pa.link_class(zone_a, zone_b)
        same = self.region_continent[self.region(zone_a)] == self.region_continent[self.region(zone_b)]
        return LinkClass.SAME_CONTINENT if same else LinkClass.INTERCONTINENTAL

    def price(self, zone: str, gpu_name: str) -> float | None:
        return self.provider_of(zone).price(zone, gpu_name)

    def offers(self, zone: str, gpu_name: str) -> bool | None:
        return self.provider_of(zone).offers(zone, gpu_name)

    def egress_between(self, src_zone: str, dst_zone: str, link_class: LinkClass) -> float:
        sender, receiver = self.provider_of(src_zone), self.provider_of(dst_zone)
        if sender is receiver:
            return sender.egress_between(src_zone, dst_zone, link_class)
        return sender.internet_egress_usd_per_gb

    def link_between(self, zone_a: str, zone_b: str, link_class: LinkClass) -> Link | None:
        pa, pb = self.provider_of(zone_a), self.provider_of(zone_b)
        if pa is pb:
            return pa.link_between(zone_a, zone_b, link_class)
        return self.cross_links.get(link_class)


MAX_ZONES_LISTED = 12  # an unknown zone's error lists every known zone up to this many (local: 1; gcp: 97)


def _zones_in_short(members: Iterable[Provider]) -> str | None:
    """What an unknown zone's error says of the known ones when there are too many to list on one
    line: how many, and the first zone of each provider (None: few enough to list them all)."""
    members = tuple(members)
    count = sum(len(p.zone_region) for p in members)
    if count <= MAX_ZONES_LISTED:
        return None
    names = [p.name for p in members]
    names = f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]
    return f"known: {count} zones of {names}, e.g. {', '.join(next(iter(p.zone_region)) for p in members)}"


def _load_yaml(name: str) -> dict:
    """A catalog file, read by the rules of user files (`core.fileio`): a `.nan` price, a key given
    twice, is an error naming the file and field, not a silent NaN or a silent choice of one."""
    return parse_yaml(resources.files(__package__).joinpath(name).read_text(encoding="utf-8"),
                      f"sailor/catalog/{name}")


@functools.cache
def _gpu_table() -> tuple[dict[str, GpuSpec], dict[str, str]]:
    raw = _load_yaml("gpus.yaml")
    assert raw["schema"] == 1
    gpus: dict[str, GpuSpec] = {}
    aliases: dict[str, str] = {}
    defaults = raw["efficiency_defaults"]
    for name, d in raw["gpus"].items():
        gpus[name] = GpuSpec(
            name=name,
            memory_bytes=int(float(d["memory_bytes"])),
            peak_flop_per_s={k: (float(v) if v is not None else None) for k, v in d["peak_flop_per_s"].items()},
            hbm_bytes_per_s=float(d["hbm_bytes_per_s"]),
            gpus_per_node=int(d["gpus_per_node"]),
            intra_node_bytes_per_s=float(d["intra_node_bytes_per_s"]),
            framework_bytes=int(float(d["framework_bytes"])),
            efficiency=Efficiency(**{k: float(v) for k, v in (defaults | d.get("efficiency", {})).items()}),
        )
        for alias in d.get("aliases", []):
            aliases[alias] = name
    return gpus, aliases


def _link(v: dict) -> Link:
    flow = v.get("flow_bandwidth_bytes_per_s")
    return Link(float(v["latency_s"]), float(v["bandwidth_bytes_per_s"]), float(flow) if flow is not None else None)


PROVIDER_FILES = ("gcp.yaml", "aws.yaml", "azure.yaml")  # each: schema 1, providers: {name: ...}


@functools.cache
def _providers() -> dict[str, Provider]:
    out: dict[str, Provider] = {}
    for file in PROVIDER_FILES:
        raw = _load_yaml(file)
        assert raw["schema"] == 1, file
        for name, d in raw["providers"].items():
            out[name] = _provider(name, d)
    _check_unique(out.values())
    return out


def _provider(name: str, d: dict) -> Provider:
    regions = d["regions"]
    return Provider(
        name=name,
        zone_region={z: r for r, rd in regions.items() for z in rd["zones"]},
        region_continent={r: rd["continent"] for r, rd in regions.items()},
        prices_usd_per_gpu_hour={k: float(v) for k, v in d.get("prices_usd_per_gpu_hour", {}).items()},
        egress_usd_per_gb={LinkClass(k): float(v) for k, v in d["egress_usd_per_gb"].items()},
        links={LinkClass(k): _link(v) for k, v in d["links"].items()},
        region_prices={r: {canonical_gpu(g): float(v) for g, v in rd.get("prices", {}).items()}
                       for r, rd in regions.items() if rd.get("prices")},
        gpu_zones={canonical_gpu(g): frozenset(zs) for g, zs in d.get("gpu_zones", {}).items()},
        internet_egress_usd_per_gb=float(d["internet_egress_usd_per_gb"]),
    )


def _check_unique(providers: Iterable[Provider]) -> None:
    """Every zone and every region belongs to one provider (a zone names its provider); a zone of
    `gpu_zones` is one of the provider's. Raises ValueError naming the duplicate (a catalog bug)."""
    seen: dict[str, str] = {}
    for p in providers:
        for name in set(p.zone_region) | set(p.region_continent):
            if seen.setdefault(name, p.name) != p.name:
                raise ValueError(f"catalog: {name!r} is a zone or region of both {seen[name]} and {p.name}")
        for g, zones in p.gpu_zones.items():
            if not zones <= set(p.zone_region):
                raise ValueError(f"catalog: {p.name} gpu_zones.{g} names zones it lacks: {sorted(zones - set(p.zone_region))}")


@functools.cache
def _cross_links() -> dict[LinkClass, Link]:
    raw = _load_yaml("clouds.yaml")
    assert raw["schema"] == 1
    return {LinkClass(k): _link(v) for k, v in raw["cross_provider"]["links"].items()}


def gpu_names() -> list[str]:
    """Canonical names of all catalogued GPU types."""
    return sorted(_gpu_table()[0])


def canonical_gpu(name: str) -> str:
    """Canonical GPU name for `name` or an alias; raises SailorInputError if unknown."""
    gpus, aliases = _gpu_table()
    if not isinstance(name, str):
        raise unknown_name("GPU type", name, list(gpus) + list(aliases))
    if name in gpus:
        return name
    if name in aliases:
        return aliases[name]
    raise unknown_name("GPU type", name, list(gpus) + list(aliases))


def known_gpu(name: str) -> str | None:
    """Canonical GPU name for `name` or an alias, or None when the catalog does not have it (for
    foreign files that list GPU types we cannot plan for)."""
    try:
        return canonical_gpu(name)
    except SailorInputError:
        return None


def gpu(name: str) -> GpuSpec:
    """The catalog entry for a GPU type (name or alias); raises SailorInputError if unknown."""
    return _gpu_table()[0][canonical_gpu(name)]


def provider(name: str) -> Provider:
    """The provider named `name` ("gcp", "aws", "azure" or "local"); raises SailorInputError if unknown."""
    if isinstance(name, str) and name in _providers():
        return _providers()[name]
    raise unknown_name("provider", name, _providers())


def provider_names() -> list[str]:
    """Names of the catalogued providers (`local` included)."""
    return list(_providers())


def clouds(names: Iterable[str]) -> Provider | Clouds:
    """The providers `names` seen as one: the `Provider` itself for one name, else a `Clouds`.
    Raises SailorInputError for an unknown name, a name given twice, none at all, or `local` (one
    machine) mixed with a cloud."""
    names = tuple(names)
    for n in names:
        provider(n)
    if not names or len(set(names)) != len(names):
        raise SailorInputError(f"providers must be distinct and at least one, got {list(names)}",
                               fix=f"e.g. [gcp, aws]; known: {', '.join(provider_names())}")
    if len(names) == 1:
        return provider(names[0])
    if "local" in names:
        raise SailorInputError("provider local (this machine) cannot be combined with a cloud",
                               fix="give local alone, or clouds only")
    return _clouds(names)


@functools.cache
def _clouds(names: tuple[str, ...]) -> Clouds:
    return Clouds(members=tuple(provider(n) for n in names), cross_links=_cross_links())


def zone_provider(zone: str) -> str | None:
    """The provider whose catalog has `zone`, or None (for hints: "that is an aws zone")."""
    for p in _providers().values():
        if zone in p.zone_region:
            return p.name
    return None


def known_zones() -> set[str]:
    """Every zone of every provider of the catalog (`local` included)."""
    return {z for p in _providers().values() for z in p.zone_region}


def list_price(provider_name: str, gpu_name: str) -> float:
    """List $/GPU-hour of `gpu_name` at `provider_name`; raises SailorInputError when not listed."""
    prov = provider(provider_name)
    g = canonical_gpu(gpu_name)
    if g not in prov.prices_usd_per_gpu_hour:
        raise SailorInputError(f"no list price for GPU type {g!r} at provider {prov.name!r}",
                               fix="give one in the cluster spec under prices")
    return prov.prices_usd_per_gpu_hour[g]


DEVICES = ("cpu", "cuda")  # what the runtime trains on: gloo on this machine's CPU, or NCCL on GPUs


def check_device(device: str, gpus: Iterable[str] = (), *, what: str = "", cpu_runs_any: bool = False) -> None:
    """Raise SailorInputError (naming --device) unless `device` is one of DEVICES and can train GPU
    types `gpus`: cuda never runs GPU type cpu (this machine's processes), and cpu runs only GPU type
    cpu unless `cpu_runs_any` (a gloo test run of a GPU plan). `what` says whose GPU types they are
    in the message, e.g. "the plan runs on" or "the trace offers"."""
    if device not in DEVICES:
        raise SailorInputError(f"unknown device {device!r}", source="--device", fix="cpu or cuda")
    for g in sorted(set(gpus)):
        if (g == "cpu") != (device == "cpu") and not (device == "cpu" and cpu_runs_any):
            raise SailorInputError(f"{what} GPU type {g}, which --device {device} cannot train on", source="--device",
                                   fix="cpu for GPU type cpu, cuda for GPUs")
