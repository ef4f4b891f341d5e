"""Phase 1 of the planner's search: the option table of a (P, micro-batch, partition, memory) family
and the pipeline kinds built from it.

A stage *option* is an entry of the table, opaque to the search: the GPU type and TP degree of one
replica, the GPUs it takes, its forward and backward seconds per micro-batch, and the fewest
data-parallel replicas with which its memory fits (1 unless ZeRO shards what does not fit
otherwise). The stages' memory options (recomputation, ZeRO, SP: `plan.spec.StageMemory`, one per stage,
the same on every replica of a stage as the plan format has them) belong to the family.

A pipeline *kind* is one option and one zone per stage, and where it is cut between nodes (if
anywhere): its pipelines are identical under the simulator's model (every transfer runs where the
block placement puts its two stages, `kind_boundaries`), so a plan is
a count vector over kinds plus each pipeline's share of the batch. A kind's closed-form `Curve`
comes from the simulator's own building blocks (`stage_time` per replica under the stage's memory
options, `pipeline_arrays` for the transfers, `simulator.schedule.closed_form_1f1b` called on all
kinds of a family at once), so planner and simulator agree. Under ZeRO a kind's optimizer step (and
under ZeRO-3 its weight gathers) depend on the plan's number of pipelines D: a kind built without D
holds lower bounds over every D it can run with (gathers at its `min_replicas`, the optimizer step at
one replica per micro-batch), and `Kind.at(D)` is exact for D, as `simulate` times it.

Kinds of a family, by what they mix:
- `homogeneous_kinds`: one (GPU type, zone), a TP template over the stages (`space.pareto_templates`),
  also cut between nodes into segments (`node_cut_variants`: the pipeline cut a slow inter-node link
  calls for, `plan.placement`);
- `memory_mixed_kinds`: one zone, a base GPU type, and a helper type on the stages the base cannot
  hold (and, as variants, on the first and/or the last stage: a big-memory GPU where memory forces
  it);
- spanning kinds (stages in several zones or regions) are built by `geo.build_spanning`;
- `all_kinds`: every option and zone per stage, and the cuts of `node_cut_variants` (the exact mode
  on small clusters).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from sailor.plan.placement import same_node_boundaries
from sailor.plan.spec import StageMemory
from sailor.planner.alike import canonical_zones_of
from sailor.planner.space import Memory, Option, Partition, pareto_templates, stage_options
from sailor.simulator import SimContext, Slot, optimizer_s, pipeline_arrays, stage_time, time_options
from sailor.simulator.schedule import closed_form_1f1b

Pool = tuple[str, str]  # (zone, GPU type)
# a pipeline to build a kind of: per stage a zone and an option, and (optional, else none) whether
# the pipeline is cut between nodes before the stage (`plan.placement`)
Spec = tuple[tuple[str, ...], tuple[Option, ...]] | tuple[tuple[str, ...], tuple[Option, ...], tuple[bool, ...]]


Table = list[list[Option]]  # per stage, the feasible options


def option_table(ctx: SimContext, gpus: list[str], partition: Partition, mbs: int, microbatches: int,
                 memory: Memory) -> Table:
    """Per stage, every option of the GPU types `gpus` that fits in memory under the stages' memory
    options (`space.stage_options`: H1 TP within a node, H2 memory with min(P - i, microbatches)
    micro-batches in flight, from `min_replicas` replicas on)."""
    table: Table = [[] for _ in partition]
    for g in gpus:
        for i, opts in enumerate(stage_options(ctx, g, partition, mbs, microbatches, memory)):
            table[i] += opts
    return table


@dataclass(frozen=True)
class Curve:
    """Closed-form time of one pipeline for m micro-batches: A = fill_s (m = 1), B = two_s (m = 2),
    t = period_s per further micro-batch (seconds; affine from m = 2 on under 1F1B)."""

    fill_s: float
    two_s: float
    period_s: float

    def time_s(self, m: int) -> float:
        return self.fill_s if m == 1 else self.two_s + (m - 2) * self.period_s

    def cap(self, tau: float) -> int:
        """Most micro-batches one pipeline finishes within tau seconds (0 if not even one)."""
        eps = 1e-12 * max(1.0, abs(tau))
        if tau < self.fill_s - eps:
            return 0
        if tau < self.two_s - eps:
            return 1
        return 2 + math.floor((tau - self.two_s) / self.period_s + 1e-9)


@dataclass(frozen=True)
class Kind(Curve):
    """Identical pipelines: per stage an option and a zone, under the family's memory options.
    Seconds, $/hour, $ per micro-batch."""

    zones: tuple[str, ...] = ()
    options: tuple[Option, ...] = ()
    memory: tuple[StageMemory, ...] = ()
    gpus: int = 0                  # G_k, GPUs of one pipeline
    use: tuple[tuple[Pool, int], ...] = ()  # GPUs of one pipeline per (zone, GPU type)
    usd_per_hour: float = 0.0
    optimizer_s: float = 0.0       # slowest optimizer step among its stages
    egress_usd_per_mb: float = 0.0  # p2p egress of one micro-batch (activations and gradients across zones)
    min_replicas: int = 1          # fewest pipelines of the whole plan with which every stage fits (ZeRO)
    replicas: int | None = None    # the D its constants are exact for; None: lower bounds over D
    slots: tuple[Slot, ...] = field(default=(), compare=False, repr=False)

    def slot(self, stage: int) -> Slot:
        return self.slots[stage]

    def fits(self, free: dict[Pool, int]) -> int:
        """How many pipelines of this kind the free GPUs hold."""
        return min(free.get(p, 0) // n for p, n in self.use)

    @property
    def depends_on_replicas(self) -> bool:
        return any(m.zero for m in self.memory)

    @property
    def cuts(self) -> tuple[bool, ...]:
        """Per stage, whether the pipeline is cut between nodes before it (`plan.placement`)."""
        return tuple(s.node_cut for s in self.slots)

    @property
    def spec(self) -> Spec:
        """(zones, options, cuts): what `make_kinds` builds this kind from."""
        return self.zones, self.options, self.cuts

    def at(self, ctx: SimContext, partition: Partition, mbs: int, replicas: int) -> "Kind":
        """This kind with constants exact for a plan of `replicas` pipelines."""
        if not self.depends_on_replicas or self.replicas == replicas:
            return self
        return make_kinds(ctx, [self.spec], partition, mbs, self.memory, replicas)[0]


def make_kind(ctx: SimContext, zones: tuple[str, ...], options: tuple[Option, ...], partition: Partition, mbs: int,
              memory: Memory) -> Kind:
    """The kind with stage i on options[i] in zones[i] (memoised in the context, one planning call)."""
    return make_kinds(ctx, [(zones, options)], partition, mbs, memory)[0]


def make_kinds(ctx: SimContext, specs: list[Spec], partition: Partition,
               mbs: int, memory: Memory, replicas: int | None = None) -> list[Kind]:
    """Kinds for many (zones, options[, cuts]) at once under the stages' memory options, exact for a
    plan of `replicas` pipelines or (None) lower bounds over D (module docstring); their curves from
    one batched call of the closed form (arrays (kinds, P)). Memoised in the context per family, with
    the curves (`forget_kinds` drops a family's). A pipeline cut between nodes differs from its uncut twin (the
    same zones and options) only in which transfers cross nodes, so what the cuts do not change
    (stage times, optimizer step, pools, price, the transfer over each boundary inside a node and
    between two) is computed once per twin; a curve and egress once per family for the kinds
    of one pool class (`pool_class`: pools whose zones' links are alike) or zones (those of an alike
    region, `alike.canonical_zones_of`), options and cuts, and without ZeRO-3 for every D."""
    specs = [sp if len(sp) == 3 and any(sp[2]) else (sp[0], sp[1], ()) for sp in specs]  # no cut: ()
    memory_id = memory_number(ctx, memory)
    cache = ctx.memo.setdefault(("kinds", partition, mbs, memory_id), {})  # this family's (`forget_kinds`)
    keys = [(z, o, c, replicas) for z, o, c in specs]
    out: list[Kind | None] = [cache.get(k) for k in keys]
    todo = [j for j, k in enumerate(out) if k is None]
    if not todo:
        return out  # type: ignore[return-value]
    P = len(partition)
    most = ctx.job.global_batch_size // mbs
    made: dict[tuple[str, str, int, bool], Slot] = ctx.memo.setdefault("kind slots", {})  # one object per slot

    def slots_of(zones: tuple[str, ...], options: tuple[Option, ...], cuts: tuple[bool, ...]) -> tuple[Slot, ...]:
        where = [(z, o.gpu, o.tp, bool(cuts and cuts[i])) for i, (z, o) in enumerate(zip(zones, options))]
        return tuple(made.get(w) or made.setdefault(w, Slot(zone=w[0], gpu=w[1], tp=w[2], node_cut=w[3]))
                     for w in where)

    twins = list(dict.fromkeys(specs[j][:2] for j in todo))  # (zones, options) of the kinds to build
    twin_of = {tw: r for r, tw in enumerate(twins)}
    plain = [slots_of(zones, options, ()) for zones, options in twins]  # each twin's slots without cuts
    need = [max(o.min_replicas for o in options) for _, options in twins]
    rows = [twin_of[specs[j][:2]] for j in todo]
    slots = [plain[r] if not specs[j][2] else slots_of(*specs[j]) for r, j in zip(rows, todo)]
    # a kind's curve and egress are those of every kind with its cuts, options and, for a kind in one
    # pool, pool class (`pool_class`; else its zones, renamed alike in alike regions,
    # `alike.canonical_zones_of`), at any D unless a stage gathers ZeRO-3 weights
    # (the only D its stage times read): computed for the first of them, memoised for the others
    # with the family's kinds (`forget_kinds` drops both)
    where = [pool_class(ctx, *tw) or (canonical_zones_of(ctx, tw[0]), tw[1]) for tw in twins]
    curve_d = replicas if any(m.zero >= 3 for m in memory) else None
    known = ctx.memo.setdefault(("kind curves", partition, mbs, memory_id), {})
    curve_keys = [(where[r], specs[j][2], curve_d) for r, j in zip(rows, todo)]
    first: dict[tuple, int] = {}
    build = [q for q, k in enumerate(curve_keys) if k not in known and first.setdefault(k, q) == q]
    curves: dict[int, tuple[float, float, float, float]] = {}  # build position -> (fill, two, period, egress $)
    if build:
        at_d = {d: [time_options(m, replicas or d) for m in memory] for d in {need[rows[q]] for q in build}}
        times = {r: [stage_time(ctx, plain[r][i], mbs, *partition[i], at_d[need[r]][i]) for i in range(P)]
                 for r in dict.fromkeys(rows[q] for q in build)}
        f = np.array([[t.forward_s for t in times[rows[q]]] for q in build])   # (built kinds, P)
        b = np.array([[t.backward_s for t in times[rows[q]]] for q in build])
        links: dict[tuple[int, int, bool], tuple[float, float]] = {}  # (twin, boundary, on one node) -> boundary

        def link(r: int, i: int, on: bool) -> tuple[float, float]:
            if (r, i, on) not in links:  # the transfer reads where the ends sit, not the cut flags
                links[(r, i, on)] = boundary(ctx, plain[r][i], plain[r][i + 1], partition[i], partition[i + 1], mbs, on)
            return links[(r, i, on)]

        edges = [[link(rows[q], i, on) for i, on in enumerate(kind_boundaries(ctx, slots[q]))] for q in build]
        c = np.array([[x for x, _ in row] for row in edges]).reshape(len(build), P - 1)
        t1, t2, t3 = (np.atleast_1d(closed_form_1f1b(f, b, c, m)) for m in (1, 2, 3))
        for x, q in enumerate(build):
            curves[q] = (float(t1[x]), float(t2[x]), float(t3[x] - t2[x]), sum(u for _, u in edges[x]))
            known[curve_keys[q]] = curves[q]
    steps = [time_options(mem, replicas or most) for mem in memory]
    shared: dict[int, tuple] = {}  # twin -> (GPUs, use, $/hour, optimizer s)
    for q, (r, j) in enumerate(zip(rows, todo)):
        zones, options, _ = specs[j]
        if r not in shared:
            use: dict[Pool, int] = {}
            for z, o in zip(zones, options):
                use[(z, o.gpu)] = use.get((z, o.gpu), 0) + o.gpus
            shared[r] = (sum(o.gpus for o in options), tuple(sorted(use.items())),
                         sum(n * pool_price(ctx, p) for p, n in use.items()), kind_optimizer_s(ctx, plain[r], partition, steps))
        gpus, use_, usd, opt = shared[r]
        fill, two, period, egress = curves[q] if q in curves else known[curve_keys[q]]
        kind = Kind(fill_s=fill, two_s=two, period_s=period, zones=zones, options=options, memory=memory, gpus=gpus,
                    use=use_, usd_per_hour=usd, optimizer_s=opt, egress_usd_per_mb=egress, min_replicas=need[r],
                    replicas=replicas, slots=slots[q])
        cache[keys[j]] = kind
        out[j] = kind
    return out  # type: ignore[return-value]


def memory_number(ctx: SimContext, memory: Memory) -> int:
    """A family's memory options as a number for memo keys (equal options, equal numbers), looked up
    once per call site: hashing the options is slow (pydantic models)."""
    numbers = ctx.memo.setdefault("memory numbers", {})
    return numbers.setdefault(memory, len(numbers))


def forget_kinds(ctx: SimContext, partition: Partition, mbs: int, memory: Memory) -> None:
    """Drop the memoised kinds of the family (partition, mbs, memory) (`make_kinds`, every D) and
    their curves, once the search is done with it: each family builds about a thousand kinds and
    almost none is asked for again, so kept until the end of the planning call they would hold most
    of its memory (over 100 MB on the 10zones scenario of `benchmarks/planner_scale.py`; the curves
    alone some 250 MB on its us12 row). Kinds asked for again later are built again, equal (a curve
    is the same closed form of the same stage times, whichever kinds it is computed with)."""
    memory_id = ctx.memo.get("memory numbers", {}).get(memory)
    if memory_id is not None:
        ctx.memo.pop(("kinds", partition, mbs, memory_id), None)
        ctx.memo.pop(("kind curves", partition, mbs, memory_id), None)


def pool_class(ctx: SimContext, zones: tuple[str, ...], options: tuple[Option, ...]) -> tuple | None:
    """What a pipeline's stage times and transfers read of where it runs, when all its stages are in
    one (zone, GPU type) pool: that pool's zone class (`NetworkModel.zone_class`: the routes inside a
    node and between two nodes of the zone, all that TP collectives, ZeRO-3 gathers and transfers
    inside one zone read; nothing inside a zone pays egress) with the options; None for a pipeline
    over several pools (its transfers between two GPU types or zones read routes the class leaves
    out). Pipelines of one class have equal stage times and transfers (`make_kinds`)."""
    z, g = zones[0], options[0].gpu
    if any(x != z for x in zones) or any(o.gpu != g for o in options):
        return None
    return ctx.network.zone_class(z, g), options


def pool_price(ctx: SimContext, pool: Pool) -> float:
    """$/GPU-hour of a (zone, GPU type) pool (`ClusterSpec.price`, memoised in the context)."""
    key = ("price", pool)
    if key not in ctx.memo:
        ctx.memo[key] = ctx.cluster.price(*pool)
    return ctx.memo[key]


def block_key(ctx: SimContext, slots: tuple[Slot, ...]) -> tuple:
    """What the launcher's block placement (`plan.placement.node_blocks`) reads of a pipeline's
    slots: per slot its GPU type, TP and cut, and whether it is in the previous slot's (zone, GPU
    type) pool; never a zone's name. Pipelines of one key have the same blocks, so it is the memo key
    of what the blocks give (`kind_boundaries`, `engine._node_group_unit`): a search meets hundreds
    of thousands of slot tuples and a few tens of thousands of keys. Each slot's entry is one object
    per value (memoised in the context), so a key costs a pointer per stage."""
    made = ctx.memo.setdefault("block slots", {})
    out = []
    for j, s in enumerate(slots):
        x = (s.gpu, s.tp, s.node_cut, j > 0 and s.zone == slots[j - 1].zone and s.gpu == slots[j - 1].gpu)
        out.append(made.get(x) or made.setdefault(x, x))
    return tuple(out)


def kind_boundaries(ctx: SimContext, slots: tuple[Slot, ...]) -> tuple[bool, ...]:
    """Per stage boundary of a pipeline on these slots: whether the launcher's block placement puts
    both stages on one node (`plan.placement.same_node_boundaries`, with the slots' cuts: the same
    for every pipeline of a kind, wherever it lands). Memoised per `block_key`."""
    key = ("kind boundaries", block_key(ctx, slots))
    if key not in ctx.memo:
        ctx.memo[key] = same_node_boundaries([(s.zone, s.gpu, s.tp) for s in slots], ctx.cluster.node_size,
                                             [s.node_cut for s in slots])
    return ctx.memo[key]


def boundary(ctx: SimContext, a: Slot, b: Slot, stage_a: tuple[int, int], stage_b: tuple[int, int], mbs: int,
             on_node: bool = False) -> tuple[float, float]:
    """(transfer seconds, egress $) per micro-batch between two consecutive stages, from the
    simulator's `pipeline_arrays` on that pair, over the intra-node link when `on_node` (both on one
    node, `kind_boundaries`), else between two nodes of their zones (memoised: kinds share their
    boundaries; a transfer does not depend on the stages' memory options)."""
    key = ("boundary", a, b, stage_a, stage_b, mbs, on_node)
    if key not in ctx.memo:
        if on_node:
            a, b = (dataclasses.replace(s, node="boundary") for s in (a, b))
        _, _, c, _, usd = pipeline_arrays(ctx, [a, b], [stage_a, stage_b], mbs)
        ctx.memo[key] = (float(c[0]), usd)
    return ctx.memo[key]


def kind_optimizer_s(ctx: SimContext, slots: tuple[Slot, ...], partition: Partition, steps: list) -> float:
    """Seconds of the slowest stage's optimizer step of a pipeline on these slots, `steps` the stages'
    `time_options` at the plan's D (ZeRO >= 1 splits the step over D), as `Kind.optimizer_s` holds it."""
    return max(_optimizer(ctx, sl, stage, st) for sl, stage, st in zip(slots, partition, steps))


def _optimizer(ctx: SimContext, slot: Slot, stage: tuple[int, int], opts) -> float:
    key = ("optimizer", slot.gpu, slot.tp, stage, opts)
    if key not in ctx.memo:
        ctx.memo[key] = optimizer_s(ctx, slot, *stage, opts)
    return ctx.memo[key]


def segment_cuts(widths: tuple[int, ...], segments: int) -> tuple[bool, ...]:
    """Per stage, whether a pipeline of these stage widths (GPUs) cut into `segments` contiguous
    segments of about equal GPUs is cut before it: cut k (1 <= k < segments) before the first stage
    whose preceding GPUs reach k/segments of the pipeline's (at least one stage per segment).
    Example: widths 1, 1, 1, 1 in 2 segments -> cut before stage 2."""
    P, total = len(widths), sum(widths)
    cuts = [False] * P
    before, i = 0, 0  # GPUs of stages 0..i-1
    for k in range(1, segments):
        i += 1
        before += widths[i - 1]
        while i < P - (segments - k) and before * segments < k * total:
            before += widths[i]
            i += 1
        cuts[i] = True
    return tuple(cuts)


def node_cut_variants(ctx: SimContext, specs: list[Spec]) -> list[Spec]:
    """Pipelines cut between nodes (`plan.placement`): for each spec whose stages are all in one
    (zone, GPU type) pool and whose block placement keeps some boundary inside a node, the same
    stages cut into c = 2..P segments of about equal GPUs (`segment_cuts`), each variant that cuts
    a boundary the blocks keep inside a node, once. Such a pipeline pays the inter-node link for its
    activations at the cuts, and its stages' replicas share nodes: their gradient all-reduce stays on
    the intra-node link, where the uncut pipelines' would cross nodes."""
    out: list[Spec] = []
    seen: set = set()
    for zones, options, *_ in specs:
        if len(options) < 2 or len({(z, o.gpu) for z, o in zip(zones, options)}) > 1:
            continue
        inside = same_node_boundaries([(z, o.gpu, o.tp) for z, o in zip(zones, options)], ctx.cluster.node_size)
        if not any(inside):
            continue
        widths = tuple(o.tp for o in options)
        for c in range(2, len(options) + 1):
            cuts = segment_cuts(widths, c)
            if any(cut and on for cut, on in zip(cuts[1:], inside)) and (zones, options, cuts) not in seen:
                seen.add((zones, options, cuts))
                out.append((zones, options, cuts))
    return out


def by_gpu(table: Table, gpu: str) -> list[list[Option]]:
    """The table restricted to one GPU type."""
    return [[o for o in stage if o.gpu == gpu] for stage in table]


def homogeneous_kinds(ctx: SimContext, table: Table, free: dict[Pool, int], partition: Partition, mbs: int,
                      memory: Memory) -> list[Kind]:
    """Single-zone, single-GPU-type kinds: every pool and every template of its GPU type that fits,
    and those cut between nodes (`node_cut_variants`)."""
    specs = []
    for g in sorted({o.gpu for stage in table for o in stage}):
        tmpls = pareto_templates(by_gpu(table, g))
        for (z, gg), n in sorted(free.items()):
            if gg == g:
                specs += [((z,) * len(t), t) for t in tmpls if sum(o.gpus for o in t) <= n]
    return make_kinds(ctx, specs + node_cut_variants(ctx, specs), partition, mbs, memory)


def memory_mixed_kinds(ctx: SimContext, table: Table, free: dict[Pool, int], partition: Partition, mbs: int,
                       memory: Memory) -> list[Kind]:
    """Single-zone kinds of two GPU types where memory forces it: a base type on every stage it can
    hold, a helper type on the stages it cannot (variants also move the first stage, the last, or
    both to the helper). The base's options follow its Pareto templates over the stages it keeps; a
    helper stage takes the helper's option with the fewest GPUs that is no slower than the template's
    slowest stage (else its fastest)."""
    P = len(partition)
    specs: list[tuple[tuple[str, ...], tuple[Option, ...]]] = []
    for z in sorted({z for z, _ in free}):
        here = sorted(g for (zz, g), n in free.items() if zz == z and n > 0)
        for base, helper in itertools.permutations(here, 2):
            mine, theirs = by_gpu(table, base), by_gpu(table, helper)
            missing = {i for i in range(P) if not mine[i]}
            if not missing or len(missing) == P:
                continue
            for extra in ((), (0,), (P - 1,), (0, P - 1)):
                on_helper = missing | set(extra)
                kept = [i for i in range(P) if i not in on_helper]
                if not kept or any(not theirs[i] for i in on_helper):
                    continue
                for tmpl in pareto_templates([mine[i] for i in kept]):
                    picks: list[Option | None] = [None] * P
                    for i, o in zip(kept, tmpl):
                        picks[i] = o
                    theta = max(o.time_s for o in tmpl)
                    for i in on_helper:
                        ok = [o for o in theirs[i] if o.time_s <= theta]
                        picks[i] = min(ok, key=lambda o: (o.gpus, o.time_s)) if ok else min(theirs[i], key=lambda o: o.time_s)
                    specs.append(((z,) * P, tuple(picks)))
    specs = list(dict.fromkeys(specs))  # the first of equal picks, in order
    return [k for k in make_kinds(ctx, specs, partition, mbs, memory) if k.fits(free) >= 1]


def all_kinds(ctx: SimContext, table: Table, free: dict[Pool, int], partition: Partition, mbs: int,
              memory: Memory, limit: int) -> list[Kind] | None:
    """Every kind (an option and a zone per stage) whose pipeline fits the free GPUs, and those of one
    pool cut between nodes (`node_cut_variants`); None when there would be more than `limit`
    option-zone sequences to look at."""
    per_stage = [[(z, o) for o in stage for (z, g), n in sorted(free.items()) if g == o.gpu and n >= o.gpus]
                 for stage in table]
    if math.prod(len(s) for s in per_stage) > limit:
        return None
    specs = []
    for combo in itertools.product(*per_stage):
        need: dict[Pool, int] = {}
        for z, o in combo:
            need[(z, o.gpu)] = need.get((z, o.gpu), 0) + o.gpus
        if all(free.get(p, 0) >= n for p, n in need.items()):
            specs.append((tuple(z for z, _ in combo), tuple(o for _, o in combo)))
    return make_kinds(ctx, specs + node_cut_variants(ctx, specs), partition, mbs, memory)
