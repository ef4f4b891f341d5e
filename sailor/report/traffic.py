"""Cross-zone traffic of a plan per zone pair, split by kind (pipeline p2p, gradient sync).

Built from the simulator's own terms (`link_transfer`, `stage_sync`, `tied_sync`), so the pairs add
up to `Estimate.cross_zone_bytes` (tested). A ring all-reduce's cross-zone bytes are shared equally
by the ring's cross-zone edges (every edge carries 2(D-1)/D of the gradient, `ring_egress`).
"""

from __future__ import annotations

from collections import defaultdict

from sailor.catalog import LinkClass
from sailor.plan.spec import Plan
from sailor.simulator import SimContext, Slot, link_transfer, stage_sync, tied_sync, time_options
from sailor.simulator.collectives import group_members

Pair = tuple[str, str]  # two zones, sorted


def cross_zone_traffic(plan: Plan, ctx: SimContext) -> dict[Pair, dict[str, float]]:
    """Bytes per iteration crossing zones, per zone pair: {(zone_a, zone_b): {"p2p": bytes, "sync":
    bytes, "usd": egress $}}.

    p2p: activations and gradients between consecutive stages of a pipeline (under interleaving
    between consecutive chunks, the last stage handing over to the first); sync: the gradient
    all-reduce of each stage across pipelines and the tied-embedding all-reduce; usd: those bytes at
    the egress price of the pair's link class (same region, same continent, intercontinental), so the
    pairs' $ add up to `Estimate.egress_per_iteration_usd`.
    """
    out: dict[Pair, dict[str, float]] = defaultdict(lambda: {"p2p": 0.0, "sync": 0.0, "usd": 0.0})
    mbs = plan.micro_batch_size
    slots = [[Slot(zone=r.zone, gpu=r.gpu, tp=r.tp) for r in p.replicas] for p in plan.pipelines]
    P = plan.num_stages
    for j, p in enumerate(plan.pipelines):
        for u, (_, end) in enumerate(plan.stages[:-1]):  # chunk u hands over to chunk u + 1
            a, b = slots[j][u % P], slots[j][(u + 1) % P]
            if a.zone == b.zone:
                continue
            moved = link_transfer(ctx, a, b, ctx.boundary_bytes(end, mbs))[1]
            out[_pair(a.zone, b.zone)]["p2p"] += moved * p.microbatches
        first, last = slots[j][0], slots[j][-1]
        tied_bytes = tied_sync(ctx, first, last, P)[1]
        if tied_bytes:
            out[_pair(first.zone, last.zone)]["sync"] += tied_bytes
    for i in range(P):
        groups = group_members([sl[i] for sl in slots])
        opts = time_options(plan.stage_memory(i), len(plan.pipelines))  # ZeRO moves other bytes
        moved = stage_sync(ctx, groups, plan.stage_chunks(i), opts)[1]
        if not moved:
            continue
        kinds = [m for m, _ in groups]
        edges = [(x, y) for x, y in zip(kinds, kinds[1:] + kinds[:1])
                 if ctx.network.link_class(x.zone, y.zone) not in (LinkClass.SAME_NODE, LinkClass.SAME_ZONE)]
        for x, y in edges:
            out[_pair(x.zone, y.zone)]["sync"] += moved / len(edges)
    prices = ctx.cluster.prov.egress_usd_per_gb
    for (a, b), v in out.items():
        v["usd"] = (v["p2p"] + v["sync"]) / 1e9 * prices[ctx.network.link_class(a, b)]
    return dict(out)


def _pair(a: str, b: str) -> Pair:
    return (a, b) if a <= b else (b, a)
