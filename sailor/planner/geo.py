"""Where a plan may put its GPUs: scopes (one region, or all of them) and pipelines that span zones
and regions.

Scopes. A plan's data-parallel traffic crosses what its pipelines span: the search runs each region
on its own (the published planner's H5: data parallelism stays in one region) and, when there are
several, all regions together, so that data parallelism across regions is considered, and taken only
where the simulator says it wins. Zones of one scope are pooled in one search (H6), each zone keeping
its own GPUs, prices and links.

Spanning pipelines. When the GPUs left in single zones cannot make up a pipeline (a model too large
for a zone or a region, or GPUs left over after packing whole pipelines), `build_spanning` lays
pipelines out stage by stage over the free GPUs: each stage goes to the nearest pool (same zone and
GPU type as the previous stage, then same zone, same region, same continent, elsewhere) that can hold
one of its options, taking the option with the fewest GPUs that is no slower than a target θ (else
the fastest that fits). Transfers between stages in different zones or regions are priced on their
links and with egress (`simulator.pipeline_arrays`), like everything else in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from sailor.catalog import LinkClass
from sailor.planner.kinds import Kind, Pool, Table, make_kind
from sailor.planner.space import Memory, Option, Partition
from sailor.simulator import SimContext

_DISTANCE = {LinkClass.SAME_NODE: 0, LinkClass.SAME_ZONE: 0, LinkClass.SAME_REGION: 1,
             LinkClass.SAME_CONTINENT: 2, LinkClass.INTERCONTINENTAL: 3}


@dataclass(frozen=True)
class Scope:
    """The pools a plan may use: one region's (`name` = the region) or every region's ("all regions")."""

    name: str
    pools: frozenset[Pool]

    def free(self, free: dict[Pool, int]) -> dict[Pool, int]:
        return {p: n for p, n in free.items() if p in self.pools}


def free_pools(ctx: SimContext) -> dict[Pool, int]:
    """GPUs offered per (zone, GPU type) pool, the pools with none left out."""
    return {(z, g): n for z, gpus in ctx.cluster.zones.items() for g, n in gpus.items() if n > 0}


def scopes(ctx: SimContext) -> list[Scope]:
    """Each region with GPUs, then all of them together when there are several."""
    by_region: dict[str, set[Pool]] = {}
    for zone in sorted(ctx.cluster.zones):
        for g, n in ctx.cluster.zones[zone].items():
            if n > 0:
                by_region.setdefault(ctx.cluster.prov.region(zone), set()).add((zone, g))
    out = [Scope(r, frozenset(p)) for r, p in sorted(by_region.items())]
    if len(out) > 1:
        out.append(Scope("all regions", frozenset().union(*(s.pools for s in out))))
    return out


def _pick(option_lists: list[Option], room: int, theta: float) -> tuple[bool, Option] | None:
    """(meets θ, option) for one stage on a pool with `room` free GPUs: the fewest GPUs meeting θ,
    else the fastest that fits; None if none fits."""
    fit = [o for o in option_lists if o.gpus <= room]
    if not fit:
        return None
    ok = [o for o in fit if o.time_s <= theta]
    if ok:
        return True, min(ok, key=lambda o: (o.gpus, o.time_s))
    return False, min(fit, key=lambda o: (o.time_s, o.gpus))


def build_spanning(ctx: SimContext, table: Table, free: dict[Pool, int], partition: Partition, mbs: int,
                   memory: Memory, theta: float, limit: int) -> list[Kind]:
    """Up to `limit` pipelines laid out stage by stage over `free` (see the module docstring), in the
    order built; stops at the first pipeline the GPUs left cannot hold. Does not change `free`."""
    left = dict(free)
    out: list[Kind] = []
    net = ctx.network
    while len(out) < limit:
        zones: list[str] = []
        opts: list[Option] = []
        taken: list[tuple[Pool, int]] = []
        prev: Pool | None = None
        for stage in table:
            best = None
            for pool in sorted(left):
                z, g = pool
                got = _pick([o for o in stage if o.gpu == g], left[pool], theta)
                if got is None:
                    continue
                meets, opt = got
                dist = 0 if prev is None else _DISTANCE[net.link_class(prev[0], z)]
                rank = (dist, not meets, prev is not None and pool != prev, -left[pool], pool)
                if best is None or rank < best[0]:
                    best = (rank, pool, opt)
            if best is None:
                break
            _, pool, opt = best
            left[pool] -= opt.gpus
            taken.append((pool, opt.gpus))
            zones.append(pool[0])
            opts.append(opt)
            prev = pool
        if len(opts) < len(table):
            break
        out.append(make_kind(ctx, tuple(zones), tuple(opts), partition, mbs, memory))
    return out


def spanning_thetas(table: Table, count: int = 5) -> list[float]:
    """Targets θ for `build_spanning`: `count` values spread over the distinct option times, from the
    fastest (most GPUs per stage) to the slowest (fewest)."""
    times = sorted({o.time_s for stage in table for o in stage})
    if len(times) <= count:
        return times
    return [times[round(j * (len(times) - 1) / (count - 1))] for j in range(count)]
