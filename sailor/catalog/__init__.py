"""GPU and cloud catalogs: what each GPU type can do and what each zone charges.

Data lives in `gpus.yaml` and `gcp.yaml` next to this file (every figure cites its source there);
this module only reads it. Lookup semantics:
- GPU types are looked up by canonical name or alias (`GH-96` -> `GH200-96`); an unknown type raises
  `SailorInputError` with a "did you mean".
- A zone belongs to exactly one region; a region to one continent. An unknown zone raises.
- Prices: a cluster spec may override per GPU type or per (zone, GPU type); otherwise the provider's
  list price, the same in every zone. A GPU type with no price raises (never a silent zero).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from importlib import resources
from typing import Literal

import yaml

from sailor.core.errors import SailorInputError, unknown_name

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
    """A cloud (or `local`): zones by region, list prices, egress prices and default links."""

    name: str
    zone_region: dict[str, str]
    region_continent: dict[str, str]
    prices_usd_per_gpu_hour: dict[str, float]
    egress_usd_per_gb: dict[LinkClass, float]
    links: dict[LinkClass, Link]

    def region(self, zone: str) -> str:
        """The region of `zone`; raises SailorInputError for an unknown zone."""
        if isinstance(zone, str) and zone in self.zone_region:
            return self.zone_region[zone]
        raise unknown_name(f"{self.name} zone", zone, self.zone_region)

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


def _load_yaml(name: str) -> dict:
    return yaml.safe_load(resources.files(__package__).joinpath(name).read_text(encoding="utf-8"))


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


@functools.cache
def _providers() -> dict[str, Provider]:
    raw = _load_yaml("gcp.yaml")
    assert raw["schema"] == 1
    out = {}
    for name, d in raw["providers"].items():
        zone_region = {z: r for r, rd in d["regions"].items() for z in rd["zones"]}
        out[name] = Provider(
            name=name,
            zone_region=zone_region,
            region_continent={r: rd["continent"] for r, rd in d["regions"].items()},
            prices_usd_per_gpu_hour={k: float(v) for k, v in d["prices_usd_per_gpu_hour"].items()},
            egress_usd_per_gb={LinkClass(k): float(v) for k, v in d["egress_usd_per_gb"].items()},
            links={LinkClass(k): _link(v) for k, v in d["links"].items()},
        )
    return out


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
    """The provider named `name` ("gcp" or "local"); raises SailorInputError if unknown."""
    if isinstance(name, str) and name in _providers():
        return _providers()[name]
    raise unknown_name("provider", name, _providers())


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
