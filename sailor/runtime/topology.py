"""Plan -> rank roles and process groups: the one place the runtime derives communication from a Plan.

Torch-free and pure, so it is tested without any process group. Ranks come from
`sailor.plan.placement.rank_layout` (order: pipeline, stage, TP rank). For every rank this module gives:

- its TP group (the ranks of its replica, in TP-rank order);
- its layer chunks (`Plan.stage_chunks`: one range, several under interleaved 1F1B) and its pipeline
  links. An activation crosses the boundary between replica A (stage i, TP a) and replica B (stage
  i+1, TP b) of one pipeline scattered (`plan.comms.boundary_pieces`, Megatron-LM's scatter-gather
  generalised to a != b): A's TP rank s sends only its 1/a slice of it, cut into the pieces that B's
  ranks need, and B's TP rank r receives its 1/b slice from the one or more A ranks that hold parts
  of it, then all-gathers the rest over its TP group (`runtime.pipeline`); every byte crosses once.
  The gradient flows back over the same pairs with the same slices, so `bwd_send_to` is
  `fwd_recv_from` and `bwd_recv_from` is `fwd_send_to`. Under interleaving the last stage also hands
  its chunks' outputs to the first stage (chunk c of stage p-1 feeds chunk c+1 of stage 0), by the
  same rule: the neighbours are stages i-1 and i+1 modulo p, and `runtime.pipeline` knows from the
  chunk which transfers an op makes.
- its stage's memory options (`stage_memory`, the runtime's one reader of `Plan.memory`; the schedule's is
  `schedule.runtime_schedule`);
- its gradient-sync groups. A stage's replicas may have different TP degrees, so a sharded parameter
  is split into `L = lcm(TP degrees of the stage's replicas)` equal *blocks* (the finest sharding).
  Block k is held, in a replica of TP degree t, by TP rank `k // (L / t)`; its group is those D
  ranks, one per pipeline. Replicated parameters (norms, row-parallel biases, position table) are
  held by every rank of the stage: their group is all of them (each rank weighs its copy by 1/t).
- its expert parallelism (`plan.experts`): its EP rank, the experts it holds, the all-to-all group
  (the ranks of its own TP rank in the replicas of its EP group, by EP rank) and the sync groups of
  its experts' parameters, which are those above restricted to the pipelines at its EP rank in every
  EP group (`expert_block_groups`, `expert_stage_group`; `sync_groups` picks by parameter name). With
  EP 1 the all-to-all group is the rank alone and the expert groups are the stage's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from sailor.plan.comms import boundary_pieces
from sailor.plan.experts import StageExperts
from sailor.plan.placement import rank_layout
from sailor.plan.spec import Plan, StageMemory

Ranks = tuple[int, ...]  # global ranks, in a fixed order


class Link(NamedTuple):
    """One peer across a stage boundary and the slice [lo, hi) of the activation (or its gradient)
    exchanged with it, as fractions of the tensor flattened in sequence-major (T, B, h) order."""

    rank: int
    lo: Fraction
    hi: Fraction


@dataclass(frozen=True)
class RankRole:
    """Everything one rank needs to know about its place in the plan."""

    rank: int
    pipeline: int
    stage: int
    tp_rank: int
    tp: int
    chunks: tuple[tuple[int, int], ...]  # half-open layer ranges in layer order (one unless interleaved)
    num_stages: int
    num_pipelines: int
    microbatches: int  # this pipeline's micro-batches per step
    first_sample: int  # index in the global batch of this pipeline's first sample
    tp_group: Ranks  # the ranks of this replica, by TP rank
    # Pipeline links (module docstring), ordered by slice; empty where there is no neighbour stage.
    fwd_recv_from: tuple[Link, ...]  # ranks sending this rank its slice of the input activation
    fwd_send_to: tuple[Link, ...]  # ranks this rank sends slices of its output activation to
    bwd_recv_from: tuple[Link, ...]  # ranks sending this rank its slice of its output's gradient
    bwd_send_to: tuple[Link, ...]  # ranks this rank sends slices of its input's gradient to
    sync_blocks: int  # L: blocks per sharded parameter in this stage (lcm of its TP degrees)
    block_groups: tuple[Ranks, ...]  # sync group of each block this rank holds (L / tp of them, in order)
    stage_group: Ranks  # every rank holding this stage (sync group of replicated parameters)
    memory: StageMemory  # this stage's memory options (`stage_memory`)
    experts: StageExperts  # this stage's expert parallelism (`Plan.stage_experts`)
    ep_rank: int  # this replica's EP rank in its EP group (0 with EP 1)
    ep_group: Ranks  # the all-to-all group: this TP rank of each replica of the EP group, by EP rank
    expert_block_groups: tuple[Ranks, ...]  # like `block_groups`, for routed experts' parameters
    expert_stage_group: Ranks  # like `stage_group`, for routed experts' parameters

    def sync_groups(self, name: str) -> tuple[Ranks, tuple[Ranks, ...]]:
        """(group of a replicated parameter, groups of the blocks of a sharded one) for canonical
        parameter `name`: the expert groups for a routed expert's (`mlp.experts.<j>.`), else the
        stage's."""
        if ".mlp.experts." in name:
            return self.expert_stage_group, self.expert_block_groups
        return self.stage_group, self.block_groups

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True)
class Topology:
    """The roles of all ranks of a plan, and the process groups they need."""

    world_size: int
    roles: tuple[RankRole, ...]  # indexed by global rank

    def stage_memory(self, stage: int) -> StageMemory:
        """The memory options of stage `stage` (every rank of a stage has the same)."""
        return next(r.memory for r in self.roles if r.stage == stage)

    def groups(self) -> list[Ranks]:
        """Every distinct group of two or more ranks, in one deterministic order (all ranks must
        create torch groups in the same order)."""
        return self._distinct(lambda r: (r.tp_group, *r.block_groups, r.stage_group, r.ep_group,
                                         *r.expert_block_groups, r.expert_stage_group))

    def sync_groups(self) -> list[Ranks]:
        """The groups of two or more ranks that gradients are reduced in (`RankRole.sync_groups` of
        every parameter: the buckets' groups, `runtime.buckets`), in `groups`' order."""
        return self._distinct(lambda r: (*r.block_groups, r.stage_group, *r.expert_block_groups,
                                         r.expert_stage_group))

    def _distinct(self, of) -> list[Ranks]:
        """The distinct groups of two or more ranks among `of(role)` over every role, sorted by
        (size, ranks)."""
        seen = dict.fromkeys(g for r in self.roles for g in of(r) if len(g) > 1)
        return sorted(seen, key=lambda g: (len(g), g))


def stage_memory(plan: Plan, stage: int) -> StageMemory:
    """The memory options of stage `stage` as the runtime applies them: the runtime's one reader of
    `Plan.memory` (the worker, the tied-embedding transfers and the checks take them from here or
    from `RankRole.memory`)."""
    return plan.stage_memory(stage)


def derive_topology(plan: Plan) -> Topology:
    """Roles of all ranks of `plan` (see the module docstring). Asserts the invariants: each rank
    appears once, TP groups partition the world, each block group has one rank per pipeline."""
    layout = rank_layout(plan, {r.gpu: plan.world_size for p in plan.pipelines for r in p.replicas})
    replica: dict[tuple[int, int], list[int]] = {}  # (pipeline, stage) -> ranks by TP rank
    for info in layout:
        replica.setdefault((info.pipeline, info.stage), []).append(info.rank)
    num_stages, num_pipes = plan.num_stages, len(plan.pipelines)
    # Finest sharding of each stage and, per block, the ranks (one per pipeline) that hold it.
    finest = [math.lcm(*(p.replicas[i].tp for p in plan.pipelines)) for i in range(num_stages)]
    block_group = {(i, k): tuple(replica[(j, i)][k // (finest[i] // p.replicas[i].tp)]
                                 for j, p in enumerate(plan.pipelines))
                   for i in range(num_stages) for k in range(finest[i])}
    stage_group = {i: tuple(r for j in range(num_pipes) for r in replica[(j, i)]) for i in range(num_stages)}
    # Expert parallelism: the pipelines at each EP rank of stage i (one per EP group), and the groups
    # of the experts' blocks and whole parameters among those pipelines' replicas.
    experts = [plan.stage_experts(i) for i in range(num_stages)]
    at_ep_rank = {(i, q): [j for j in range(num_pipes) if experts[i].ep_rank(j) == q]
                  for i in range(num_stages) for q in range(experts[i].ep)}
    expert_block = {(i, q, k): tuple(replica[(j, i)][k // (finest[i] // plan.pipelines[j].replicas[i].tp)]
                                     for j in at_ep_rank[(i, q)])
                    for (i, q) in at_ep_rank for k in range(finest[i])}
    expert_stage = {(i, q): tuple(r for j in at_ep_rank[(i, q)] for r in replica[(j, i)]) for (i, q) in at_ep_rank}
    first = [0]
    for p in plan.pipelines:
        first.append(first[-1] + p.microbatches * plan.micro_batch_size)

    roles = []
    wrap = plan.virtual_stages > 1  # interleaved: stage p-1 feeds stage 0 between chunks
    for info in layout:
        i, j, t = info.stage, info.pipeline, info.tp_rank
        prev = replica.get((j, (i - 1) % num_stages)) if i > 0 or wrap else None
        nxt = replica.get((j, (i + 1) % num_stages)) if i < num_stages - 1 or wrap else None
        blocks_per_rank = finest[i] // info.tp
        ex = experts[i]
        q, first_pipe = ex.ep_rank(j), j - ex.ep_rank(j)  # EP rank, the EP group's first pipeline
        mine = range(t * blocks_per_rank, (t + 1) * blocks_per_rank)
        links_in = tuple(Link(prev[s], lo, hi) for s, r, lo, hi in boundary_pieces(len(prev), info.tp)
                         if r == t) if prev else ()
        links_out = tuple(Link(nxt[r], lo, hi) for s, r, lo, hi in boundary_pieces(info.tp, len(nxt))
                          if s == t) if nxt else ()
        roles.append(RankRole(
            rank=info.rank, pipeline=j, stage=i, tp_rank=t, tp=info.tp, chunks=plan.stage_chunks(i),
            num_stages=num_stages, num_pipelines=num_pipes, microbatches=plan.pipelines[j].microbatches,
            first_sample=first[j], tp_group=tuple(replica[(j, i)]),
            fwd_recv_from=links_in, fwd_send_to=links_out, bwd_recv_from=links_out, bwd_send_to=links_in,
            sync_blocks=finest[i],
            block_groups=tuple(block_group[(i, k)] for k in mine),
            stage_group=stage_group[i], memory=stage_memory(plan, i), experts=ex, ep_rank=q,
            ep_group=tuple(replica[(first_pipe + e, i)][t] for e in range(ex.ep)),
            expert_block_groups=tuple(expert_block[(i, q, k)] for k in mine), expert_stage_group=expert_stage[(i, q)]))

    assert [r.rank for r in roles] == list(range(plan.world_size))
    assert sorted(x for g in replica.values() for x in g) == list(range(plan.world_size))
    assert all(len(g) == num_pipes for g in block_group.values())
    for r in roles:  # every link has its twin at the other end, with the same slice
        for d in r.fwd_send_to:
            assert Link(r.rank, d.lo, d.hi) in roles[d.rank].fwd_recv_from, (r.rank, d)
        for s in r.bwd_send_to:
            assert Link(r.rank, s.lo, s.hi) in roles[s.rank].bwd_recv_from, (r.rank, s)
    return Topology(world_size=plan.world_size, roles=tuple(roles))
