"""Regions the planner's model tells apart by their zones' names alone, and the memo keys that let
them share what the search computes.

A cluster over every zone of a cloud holds many regions whose zones offer the same GPUs at the same
prices over the same default links (the allzones row of `benchmarks/planner_scale.py`: 30 of its 32
regions, 3 zones each). Two regions are *alike* when, their zones sorted by name and paired rank by
rank, every figure the gradient sync and the pipelines' curves read of a zone or of a pair of zones
is equal (`_region_signature`): the GPUs offered and their prices, the link class, egress price and
default links (each GPU type, between two nodes and inside one) of every ordered pair of zones, each
zone's class (`NetworkModel.zone_class`), and no measured route touches a zone of either (a
measured table names its zones; such a region is alike no other).

Renaming the zones of a plan inside one region to their ranks' zones in an alike region (the
*canonical* region: the first alike one, regions by name) then changes nothing the sync computes:
routes, link classes and egress prices are equal pair by pair; ring order sorts members by zone
and then by node, whose name is "<zone>/<gpu>/<index>" (`plan.placement`), so a rank-preserving
renaming keeps the order; and zone names are otherwise only compared for equality. A plan over
several regions is not renamed (a renaming is an isomorphism of one region only). The same holds
for what a pipeline's closed-form curve reads of its zones: stage times (TP collectives and ZeRO-3
gathers inside a zone), transfers between its stages and their egress.
"""

from __future__ import annotations

import dataclasses

from sailor.catalog import LinkClass
from sailor.simulator import SimContext, Slot


def canonical_zones(ctx: SimContext) -> dict[str, tuple[str, str]]:
    """zone -> (its region, the zone of the same rank in the canonical region alike its own; itself
    when no region before is alike). Memoised for the planning call."""
    key = "canonical zones"
    if key not in ctx.memo:
        prov = ctx.cluster.prov
        by_region: dict[str, list[str]] = {}
        for z in sorted(ctx.cluster.zones):
            by_region.setdefault(prov.region(z), []).append(z)
        first: dict[tuple, list[str]] = {}
        out: dict[str, tuple[str, str]] = {}
        for region, zones in sorted(by_region.items()):
            rep = first.setdefault(_region_signature(ctx, zones), zones)
            out.update((z, (region, r)) for z, r in zip(zones, rep))
        ctx.memo[key] = out
    return ctx.memo[key]


def _region_signature(ctx: SimContext, zones: list[str]) -> tuple:
    """What the sync and the curves read of a region's zones (sorted by name), without their names
    (module docstring); a region with a measured route gets its zone names, alike no other."""
    net, cluster = ctx.network, ctx.cluster
    measured = {k[0] for t in (net.fits, net.links, net.node_links) for k in t} | {
        k[2] for t in (net.fits, net.links, net.node_links) for k in t}
    if measured & set(zones):
        return ("measured", tuple(zones))
    gpus = cluster.gpu_types()
    offers = tuple(tuple(sorted((g, n, cluster.price(z, g), net.zone_class(z, g))
                                for g, n in cluster.zones[z].items() if n > 0)) for z in zones)
    pairs = []
    for a in zones:
        for b in zones:
            lc = net.link_class(a, b)
            pairs.append((lc, cluster.prov.egress_between(a, b, lc),
                          tuple(net.default_link(c, g, a, b) for g in gpus for c in (lc, LinkClass.SAME_NODE))))
    return len(zones), offers, tuple(pairs)


def canonical_zones_of(ctx: SimContext, zones: tuple[str, ...]) -> tuple[str, ...]:
    """`zones` (a pipeline's, stage by stage) renamed to their canonical zones when all lie in one
    region (module docstring), else `zones` itself: a memo key under which alike regions share a
    pipeline's curve (`kinds.make_kinds`)."""
    canon = canonical_zones(ctx)
    if len({canon[z][0] for z in zones}) != 1:
        return zones
    return tuple(canon[z][1] for z in zones)


def canonical_used(ctx: SimContext, used: tuple[tuple[tuple[Slot, ...], int], ...]) -> tuple:
    """`used` ((slots, count) per kind) with every zone renamed to its canonical zone when all its
    slots sit in one region (module docstring), else `used` itself: a memo key under which alike
    regions share a sync."""
    canon = canonical_zones(ctx)
    if len({canon[s.zone][0] for slots, _ in used for s in slots}) != 1:
        return used
    renamed = ctx.memo.setdefault("canonical slots", {})  # one object per renamed slot
    tuples = ctx.memo.setdefault("canonical slot tuples", {})  # and per renamed pipeline: the keys share them

    def rename(s: Slot) -> Slot:
        if s not in renamed:
            renamed[s] = dataclasses.replace(s, zone=canon[s.zone][1])
        return renamed[s]

    def rename_all(slots: tuple[Slot, ...]) -> tuple[Slot, ...]:
        out = tuple(map(rename, slots))
        return tuples.get(out) or tuples.setdefault(out, out)

    return tuple((rename_all(slots), n) for slots, n in used)
