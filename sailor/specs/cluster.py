"""The cluster spec: which GPUs can be had where, at what price, over which links.

A frozen pydantic model with `extra="forbid"` (a misspelt field is an error); read it with
`sailor.specs.load_cluster`, which raises `SailorInputError` naming file and field.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field, model_validator

from sailor import catalog
from sailor.core.errors import SailorInputError, show
from sailor.core.limits import (MAX_BANDWIDTH_BYTES_PER_S, MAX_GPUS_PER_NODE, MAX_GPUS_PER_ZONE,
                                MAX_PRICE_USD_PER_GPU_HOUR, MAX_SECONDS, MIN_BANDWIDTH_BYTES_PER_S)
from sailor.core.schema import SPEC_CONFIG, Real, Whole


class LinkOverride(BaseModel):
    """A default link replaced by the user (see `catalog.Link`): latency (s), the NIC's bandwidth
    that all concurrent flows share (bytes/s) and optionally what one flow reaches (bytes/s)."""

    model_config = SPEC_CONFIG
    latency_s: Real(0, MAX_SECONDS)
    bandwidth_bytes_per_s: Real(MIN_BANDWIDTH_BYTES_PER_S, MAX_BANDWIDTH_BYTES_PER_S)
    flow_bandwidth_bytes_per_s: Real(MIN_BANDWIDTH_BYTES_PER_S, MAX_BANDWIDTH_BYTES_PER_S) | None = None

    def link(self) -> catalog.Link:
        return catalog.Link(self.latency_s, self.bandwidth_bytes_per_s, self.flow_bandwidth_bytes_per_s)



class AllreduceAlgorithm(str, Enum):
    """How gradient all-reduces are modelled (`simulator.collectives`): `auto` takes the cheaper of
    a flat ring and a hierarchical one (inside each zone, or each node, first), as NCCL picks its
    algorithm by its own cost model; `ring` and `hierarchical` pin one."""

    AUTO = "auto"
    RING = "ring"
    HIERARCHICAL = "hierarchical"



# Link classes a cluster spec may set per zone: inside one node, and between two nodes of the zone.
ZONE_LINK_CLASSES = (catalog.LinkClass.SAME_NODE, catalog.LinkClass.SAME_ZONE)



class ClusterSpec(BaseModel):
    """GPUs that can be had now, per zone and GPU type, with prices and network overrides.

    `provider` is one catalog provider (gcp, aws, azure, local) or the list of clouds the cluster
    spans, the first the primary (`catalog.Clouds`): every zone must be one of theirs.
    `prices` maps GPU type -> $/GPU-hour, or zone -> {GPU type -> $/GPU-hour}; anything not given is
    the provider's list price for the zone's region. `network` maps a link class (same_node, same_zone,
    same_region, same_continent, intercontinental; pairs across providers included) to a
    `LinkOverride`: latency, the bandwidth of one node's NIC in one direction that all its concurrent
    flows share, and what one flow reaches (e.g. a DGX A100
    between nodes: eight 200 Gb/s HDR InfiniBand adapters, one per GPU, ~21 GB/s each with GPUDirect
    RDMA: bandwidth 168e9, flow_bandwidth 21e9; inside it 300 GB/s of NVLink per GPU and direction,
    of which NCCL reaches ~65 %). `zone_network` does the same per zone for the links inside it
    (same_node: a fast link inside a node, same_zone: a slower one between its nodes), which wins
    over `network`. `allreduce` pins the all-reduce algorithm. Counts, node sizes and prices are
    bounded by `sailor.core.limits`. A GPU type offered in a zone that the catalog says does not
    offer it (`catalog.Provider.offers`) is refused unless `prices` gives its price in that zone
    (`check_catalog_offers`, by `load_cluster`). A `zone_network` entry or a per-zone price for a
    zone or GPU type nothing offers, or a `gpus_per_node` entry for a GPU type no zone offers, would
    never be used:
    `check_offered` refuses them (`load_cluster` against
    `zones`; `sailor run` and `replay`, whose trace replaces `zones`, against the trace).
    """

    model_config = SPEC_CONFIG

    provider: str | tuple[str, ...] = Field(default="gcp", description="gcp | aws | azure | local, or the list of"
                                            " clouds the cluster spans, e.g. [gcp, aws] (the first is the primary).")
    zones: dict[str, dict[str, Whole(0, MAX_GPUS_PER_ZONE)]] = Field(description="zone -> GPU type -> GPUs available now.")
    gpus_per_node: dict[str, Whole(1, MAX_GPUS_PER_NODE)] = Field(default_factory=dict,
                                                                  description="GPU type -> GPUs per node (default: catalog).")
    prices: dict[str, Real(0, MAX_PRICE_USD_PER_GPU_HOUR) | dict[str, Real(0, MAX_PRICE_USD_PER_GPU_HOUR)]] = Field(
        default_factory=dict, description="$/GPU-hour overrides.")
    network: dict[catalog.LinkClass, LinkOverride] = Field(default_factory=dict)
    zone_network: dict[str, dict[catalog.LinkClass, LinkOverride]] = Field(
        default_factory=dict, description="zone -> {same_node | same_zone -> link}: links inside one zone.")
    allreduce: AllreduceAlgorithm = Field(default=AllreduceAlgorithm.AUTO,
                                          description="auto (cheaper of ring and hierarchical), ring or hierarchical.")

    @model_validator(mode="before")
    @classmethod
    def _canonical_names(cls, data: Any) -> Any:
        """Map GPU aliases to canonical names and check zones, types and counts."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        data["provider"] = _provider_names(data.get("provider", "gcp"))
        names = data["provider"] if isinstance(data["provider"], tuple) else (data["provider"],)
        prov = _located(lambda: catalog.clouds(names), "provider")
        zones = data.get("zones")
        if isinstance(zones, dict):
            out = {}
            for zone, gpus in zones.items():
                _located(lambda: _zone_region(prov, zone), f"zones.{zone}")
                if not isinstance(gpus, dict):
                    raise SailorInputError("expected a mapping of GPU type to count", field=f"zones.{zone}")
                counts = {}
                for g, n in gpus.items():
                    name = _located(lambda: catalog.canonical_gpu(g), f"zones.{zone}.{g}")
                    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_GPUS_PER_ZONE:
                        raise SailorInputError(f"GPU count must be a whole number >= 0 and <= {MAX_GPUS_PER_ZONE},"
                                               f" got {show(n)}", field=f"zones.{zone}.{g}")
                    counts[name] = counts.get(name, 0) + n  # an alias and its name add up
                out[zone] = counts
            data["zones"] = out
        gpn = data.get("gpus_per_node")
        if isinstance(gpn, dict):
            data["gpus_per_node"] = _canonical_keys(gpn, "gpus_per_node", catalog.canonical_gpu)
        prices = data.get("prices")
        if isinstance(prices, dict):
            canon: dict[str, Any] = {}
            for k, v in prices.items():
                if isinstance(v, dict):
                    _located(lambda: _zone_region(prov, k), f"prices.{k}")  # a per-zone price names a zone
                    canon[k] = _canonical_keys(v, f"prices.{k}", catalog.canonical_gpu)
                else:
                    canon.update(_canonical_keys({k: v}, "prices", catalog.canonical_gpu, taken=canon))
            data["prices"] = canon
        return data

    @model_validator(mode="after")
    def _check(self) -> "ClusterSpec":
        for zone, gpus in self.zones.items():
            for g, n in gpus.items():
                if n > 0:  # every GPU on offer needs a price (never a silent zero)
                    _located(lambda: self.price(zone, g), f"zones.{zone}.{g}")
        for zone, links in self.zone_network.items():
            _located(lambda: _zone_region(self.prov, zone), f"zone_network.{zone}")
            for lc in links:
                if lc not in ZONE_LINK_CLASSES:
                    raise SailorInputError(f"a zone sets only the links inside it, not {lc.value!r}",
                                           field=f"zone_network.{zone}.{lc.value}",
                                           fix="same_node or same_zone; set links between zones under network")
        return self

    def check_offered(self, offered: dict[str, dict[str, int]] | None = None, *, by: str = "the cluster") -> None:
        """Refuse settings for what `offered` (zone -> GPU type -> count; a listed pair counts even
        at 0; default: this spec's `zones`) never offers, which would be ignored without a word: a
        `zone_network` entry for a zone it does not list, a per-zone price (`prices.<zone>`) for such
        a zone or for a GPU type it does not list in that zone, a `gpus_per_node` entry for a GPU
        type it lists in no zone. `by` names what offers, for the message ("the cluster", "the trace
        t.json"). A flat price (`prices.<GPU type>`) may name any type: it reads as a price list.

        Raises:
            SailorInputError: naming the field (`zone_network.<zone>`, `prices.<zone>[.<GPU type>]`,
                `gpus_per_node.<GPU type>`).
        """
        offered = self.zones if offered is None else offered
        zones = ", ".join(sorted(offered)) or "none"
        for field, zone, what in ([(f"zone_network.{z}", z, "these links") for z in self.zone_network]
                                  + [(f"prices.{z}", z, "these prices") for z, v in self.prices.items()
                                     if isinstance(v, dict)]):
            if zone not in offered:
                raise SailorInputError(f"{by} offers no GPUs in zone {zone!r} (its zones: {zones}), so {what} would"
                                       " never be used", field=field,
                                       fix="remove the entry, or offer GPUs there")
        for zone, prices in self.prices.items():
            for g in prices if isinstance(prices, dict) else ():
                if g not in offered[zone]:
                    listed = ", ".join(sorted(offered[zone])) or "no GPU type"
                    raise SailorInputError(f"{by} offers no {g} in zone {zone!r} (it lists {listed} there), so this"
                                           " price would never be used", field=f"prices.{zone}.{g}",
                                           fix="remove the price, or offer that GPU type there")
        types = {g for gpus in offered.values() for g in gpus}
        for g in self.gpus_per_node:
            if g not in types:
                listed = ", ".join(sorted(types)) or "none"
                raise SailorInputError(f"{by} offers no {g} in any zone (its GPU types: {listed}), so this node size"
                                       " would never be used", field=f"gpus_per_node.{g}",
                                       fix="remove the entry, or offer that GPU type in a zone")

    # ---- lookups ---------------------------------------------------------------------------
    @property
    def providers(self) -> tuple[str, ...]:
        """The providers the cluster spans (one name for most clusters)."""
        return (self.provider,) if isinstance(self.provider, str) else tuple(self.provider)

    @property
    def prov(self) -> catalog.Provider | catalog.Clouds:
        """Zones, link classes, egress and default links of the cluster's provider(s)."""
        return _clouds_of(self.providers)

    def node_size(self, gpu: str) -> int:
        """GPUs per node of type `gpu` here (spec override, else catalog)."""
        g = catalog.canonical_gpu(gpu)
        return self.gpus_per_node.get(g) or catalog.gpu(g).gpus_per_node

    def price(self, zone: str, gpu: str) -> float:
        """$/GPU-hour of `gpu` in `zone`: the spec's price for the zone, else its flat price, else
        the list price. Raises SailorInputError when none is known (saying so when the catalog
        knows that the zone does not offer the type, `check_catalog_offers`)."""
        g = catalog.canonical_gpu(gpu)
        mine = self._zone_price(zone, g)
        if mine is not None:
            return mine
        flat = self.prices.get(g)
        if isinstance(flat, (int, float)):
            return float(flat)
        listed = self.prov.price(zone, g)
        if listed is None:
            self.check_catalog_offers(zone, g)
            raise SailorInputError(f"no list price for GPU type {g!r} at provider {self.prov.provider_of(zone).name!r}"
                                   f" in zone {zone!r}", fix="give one in the cluster spec under prices")
        return listed

    def check_catalog_offers(self, zone: str, gpu: str) -> None:
        """Refuse GPU type `gpu` in `zone` when the catalog knows the zone does not offer it
        (`catalog.Provider.offers`) and `prices` does not price it in that zone (the user's word
        that it does: the catalog may lag what a zone rents). `load_cluster` checks each type
        offered in `zones`, an availability trace each it offers; a spec built in code is not.

        Raises:
            SailorInputError: naming what the zone offers and the nearest zones offering `gpu`.
        """
        g = catalog.canonical_gpu(gpu)
        where = self.prov.provider_of(zone)
        if self._zone_price(zone, g) is None and where.offers(zone, g) is False:
            raise not_offered(where, zone, g)

    def _zone_price(self, zone: str, g: str) -> float | None:
        """$/GPU-hour the spec gives canonical GPU type `g` in `zone` (`prices.<zone>.<g>`), or None."""
        zone_prices = self.prices.get(zone)
        return float(zone_prices[g]) if isinstance(zone_prices, dict) and g in zone_prices else None

    def available(self, zone: str, gpu: str) -> int:
        """GPUs of type `gpu` available in `zone` (0 if none listed)."""
        return self.zones.get(zone, {}).get(catalog.canonical_gpu(gpu), 0)

    def gpu_types(self) -> list[str]:
        """GPU types with at least one GPU available somewhere, sorted."""
        return sorted({g for z in self.zones.values() for g, n in z.items() if n > 0})

    def total_gpus(self) -> int:
        return sum(n for z in self.zones.values() for n in z.values())

    def link(self, link_class: catalog.LinkClass, zone: str | None = None,
             other: str | None = None) -> catalog.Link | None:
        """Default link of a class after the spec's overrides: `zone_network[zone]` (links inside
        `zone`), then `network`, then the catalog link: between `zone` and `other` when both are
        given (across providers, the cross-provider link of the class), else of `zone`'s provider,
        else of the primary provider. On provider local every process shares one machine, so a
        `same_node` override stands for every class it does not override. None for same_node when
        neither the spec nor the provider gives one (the GPU catalog's intra-node bandwidth applies)."""
        if zone is not None and link_class in self.zone_network.get(zone, {}):
            return self.zone_network[zone][link_class].link()
        same_node = catalog.LinkClass.SAME_NODE
        for lc in (link_class, same_node) if self.provider == "local" else (link_class,):
            if lc in self.network:
                return self.network[lc].link()
        if zone is not None:
            return self.prov.link_between(zone, other if other is not None else zone, link_class)
        return self.prov.links.get(link_class)

    def with_zones(self, zones: dict[str, dict[str, int]]) -> "ClusterSpec":
        """A copy with other availability, validated again."""
        return ClusterSpec.model_validate({**self.model_dump(mode="json"), "zones": zones})

    def to_dict(self) -> dict[str, Any]:
        provider = self.provider if isinstance(self.provider, str) else list(self.provider)
        return self.model_dump(mode="json", exclude_defaults=True) | {"provider": provider}



def _canonical_keys(d: dict[Any, Any], field: str, canonical, taken: dict[str, Any] | None = None) -> dict[str, Any]:
    """`d` with its GPU-type keys made canonical; two keys naming one GPU type (an alias and its
    name) are an error, not a silent choice of one."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = _located(lambda: canonical(k), f"{field}.{k}")
        if name in out or (taken is not None and name in taken):
            raise SailorInputError(f"{name} is given twice (as {show(k)} and under another name)", field=f"{field}.{k}")
        out[name] = v
    return out



def _located(fn, field: str):
    try:
        return fn()
    except SailorInputError as e:
        raise e.located(field_prefix=field) from None



def local_cluster(processes: int) -> ClusterSpec:
    """The `local` provider with `processes` CPU 'GPUs' in zone `local`, all on one node."""
    return ClusterSpec(provider="local", zones={"local": {"cpu": processes}}, gpus_per_node={"cpu": max(processes, 1)})



@functools.cache
def _clouds_of(names: tuple[str, ...]) -> catalog.Provider | catalog.Clouds:
    """`catalog.clouds` of a spec's providers, looked up once per set of them (the catalog is read
    once per process; the planner asks for a cluster's providers at every ring edge it prices)."""
    return catalog.clouds(names)


def _provider_names(value: Any) -> Any:
    """The `provider` field as given: one name (a list of one is that name) or a tuple of several;
    anything else is left for pydantic to refuse."""
    if isinstance(value, (list, tuple)):
        return value[0] if len(value) == 1 and isinstance(value[0], str) else tuple(value)
    return value


def _zone_region(prov: catalog.Provider | catalog.Clouds, zone: Any) -> str:
    """The region of `zone` among the cluster's providers; the error for a zone of another
    catalogued provider says which one to add."""
    try:
        return prov.region(zone)
    except SailorInputError as e:
        other = catalog.zone_provider(zone) if isinstance(zone, str) else None
        if other is None or other in prov.providers:
            raise
        raise SailorInputError(f"{zone!r} is a zone of provider {other}, which this cluster does not name",
                               fix=f"provider: [{', '.join(prov.providers + (other,))}]") from e


def not_offered(prov: catalog.Provider, zone: str, gpu: str,
                otherwise: str | None = "if yours does, give its price there under prices.{zone}.{gpu}") -> SailorInputError:
    """The error for GPU type `gpu` in a `zone` of `prov` that the catalog says lacks it: what the
    zone offers, and up to three zones that offer the type, nearest first (the zone's region, then
    its continent; one zone per other region); `otherwise` (formatted with zone and gpu) ends the fix
    (a cluster file's: price it; None where no other way exists, e.g. a testbed's node)."""
    region = prov.region(zone)
    continent = prov.region_continent[region]
    near: list[str] = []
    regions: set[str] = set()
    for z in sorted(prov.zones_offering(gpu), key=lambda z: (prov.region(z) != region,
                                                              prov.region_continent[prov.region(z)] != continent, z)):
        if prov.region(z) not in regions or prov.region(z) == region:
            near.append(z)
            regions.add(prov.region(z))
        if len(near) == 3:
            break
    here = ", ".join(prov.offered_in(zone)) or "none of the catalog's GPU types"
    fix = [f"use a zone that does, e.g. {', '.join(near)}"] if near else []
    fix += [otherwise.format(zone=zone, gpu=gpu)] if otherwise else []
    return SailorInputError(f"{prov.name} does not offer {gpu} in zone {zone!r} (it offers {here} there)",
                            fix="; or, ".join(fix) or None)
