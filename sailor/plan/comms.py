"""NCCL communicators each rank of a plan opens, and the device memory their buffers take.

Communicators of the rank at TP rank r of stage i in pipeline j (TP degree t; `runtime.topology` and
`runtime.groups` make them; a group of one rank opens none, equal member sets are one group):
- the world: 1 (the step's statistics all-reduce and the global gradient norm, `step_allreduce_bytes`);
- its TP group: 1 when t > 1;
- gradient sync: the stage group (every rank holding stage i, for replicated parameters) when it has
  two or more members, plus its block groups (one rank per pipeline holding the same block of the
  stage's finest sharding L = lcm of the stage's TP degrees; the rank holds L / t blocks) when the
  plan has two or more pipelines and they differ from the stage group;
- pipeline point-to-point: one 2-rank communicator per channel (source, destination, kind), kind
  being the activation or its gradient, so that every transfer stream progresses on its own
  (NCCL matches by order per communicator and ignores tags). Activations cross a stage boundary
  scattered (`boundary_pieces`): towards a neighbour stage of TP degree u, TP rank r of a replica
  of TP degree t exchanges with the u-ranks whose slice of the activation overlaps its own, one
  channel each way (activation one way, its gradient the other); interleaved schedules wrap round
  from the last stage to the first.

Memory per communicator (NCCL user guide, "Environment Variables": NCCL_BUFFSIZE, default 4 MiB,
"the size of the buffer used by NCCL when communicating data between pairs of GPUs"; one buffer per
connection and direction, and a connection per channel and peer, NCCL_MIN_NCHANNELS /
NCCL_MAX_NCHANNELS):

    bytes = NCCL_BUFFSIZE x 2 (send and receive) x channels x peers,   peers = min(2, n - 1)

with n the communicator's ranks (a ring's two neighbours, one for two ranks) and channels =
`CHANNELS` = 2, the fewest NCCL runs a ring with; NVLink machines open more (up to 32 on H100), so the
figure is a floor: 32 MiB for a collective communicator, 16 MiB for a 2-rank one. The catalog's
`framework_bytes` (CUDA context and kernels) leaves these buffers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from sailor.plan.spec import Plan

NCCL_BUFFSIZE = 4 * 2**20  # bytes; NCCL's default (module docstring)
CHANNELS = 2
STAGE_FIELDS = ("forward_s", "backward_s", "wait_s", "sync_update_s", "sync_exposed_s")
"""The timings each stage reports per step in the world's statistics all-reduce (`runtime.worker`,
`step_allreduce_bytes`)."""
STEP_ELEMENT_BYTES = 8  # both world all-reduces carry float64 elements (`step_allreduce_bytes`)


def step_statistics_elements(num_stages: int, pipelines: int, world_size: int) -> int:
    """Elements of the step's statistics vector (`runtime.worker.run_steps`): 1 + P·k + D + 2·W, the
    stop request, k = len(STAGE_FIELDS) timings per stage, each pipeline's loss and each rank's two
    byte counts sent across stage boundaries; P = `num_stages`, D = `pipelines`, W = `world_size`."""
    return 1 + num_stages * len(STAGE_FIELDS) + pipelines + 2 * world_size


def step_allreduce_bytes(num_stages: int, pipelines: int, world_size: int) -> tuple[int, int]:
    """(bytes, bytes) of the two all-reduces over every rank of the world that the runtime runs once
    per training step, in their order: the gradient norm's (`runtime.zero.ShardedAdamW.clip`), a
    SUM of one 0-d float64 tensor (each rank's squared norm of its owned gradient) after the gradient
    sync and before the update; the step's statistics (`runtime.worker.run_steps`), a MAX of the
    float64 vector of `step_statistics_elements` after the update."""
    return STEP_ELEMENT_BYTES, STEP_ELEMENT_BYTES * step_statistics_elements(num_stages, pipelines, world_size)


@dataclass(frozen=True)
class Communicators:
    """Communicator member counts of one rank, by purpose (each entry: one communicator's ranks)."""

    world: tuple[int, ...]
    tp: tuple[int, ...]
    sync: tuple[int, ...]
    p2p: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.world) + len(self.tp) + len(self.sync) + len(self.p2p)

    @property
    def bytes(self) -> float:
        """NCCL buffer bytes of all of them (module docstring)."""
        return float(sum(communicator_bytes(n) for n in (*self.world, *self.tp, *self.sync, *self.p2p)))


def boundary_pieces(a: int, b: int) -> list[tuple[int, int, Fraction, Fraction]]:
    """Who sends which slice of an activation across a stage boundary from a replica of TP degree `a`
    to one of TP degree `b` (scatter-gather, Narayanan et al., SC'21 §4.1, generalised to a != b).

    The activation, flattened in sequence-major order ((T, B, h), Megatron-LM's layout), is cut into
    L = lcm(a, b) equal pieces. Piece k is sent by sending TP rank k // (L / a), which thereby sends
    its own 1/a of the tensor, to receiving TP rank k // (L / b), which thereby receives its own 1/b
    slice and all-gathers the rest over its TP group; every byte crosses once. The gradient travels
    back over the same pairs with the same slices. Returns (s, r, lo, hi) for every pair (s, r) that
    shares a slice, [lo, hi) as fractions of the tensor, ordered by lo: a + b - gcd(a, b) pairs.
    Raises ValueError unless a, b >= 1."""
    if a < 1 or b < 1:
        raise ValueError(f"TP degrees must be >= 1, got {a} and {b}")
    L = math.lcm(a, b)
    out: list[tuple[int, int, Fraction, Fraction]] = []
    for k in range(L):
        s, r = k // (L // a), k // (L // b)
        if out and out[-1][:2] == (s, r):
            out[-1] = (s, r, out[-1][2], Fraction(k + 1, L))
        else:
            out.append((s, r, Fraction(k, L), Fraction(k + 1, L)))
    return out


def communicator_bytes(n: int) -> int:
    """NCCL buffer bytes of one communicator of `n` ranks (module docstring); 0 for one rank."""
    return NCCL_BUFFSIZE * 2 * CHANNELS * min(2, n - 1) if n > 1 else 0


_StageGroup = tuple[int, int, int]
"""(pipelines, ranks, finest sharding L) of one stage: what its ranks' gradient-sync communicators
depend on beyond their own replica (`_stage_group`)."""


def _stage_group(plan: Plan, stage: int) -> _StageGroup:
    """(pipelines D, ranks holding the stage = the sum of its TP degrees, L = lcm of its TP degrees)
    of stage `stage` of `plan`."""
    tps = [p.replicas[stage].tp for p in plan.pipelines]
    return len(tps), sum(tps), math.lcm(*tps)


def _neighbour_tps(plan: Plan, pipeline: int, stage: int) -> tuple[int | None, int | None]:
    """TP degrees of the replicas replica (`pipeline`, `stage`) exchanges activations with: (the one
    it receives from, the one it sends to), None where there is none (the first and last stage, but
    interleaved schedules wrap round)."""
    reps = plan.pipelines[pipeline].replicas
    P, wrap = len(reps), plan.virtual_stages > 1 and len(reps) > 1
    before = reps[(stage - 1) % P].tp if stage > 0 or wrap else None
    after = reps[(stage + 1) % P].tp if stage < P - 1 or wrap else None
    return before, after


@lru_cache(maxsize=None)
def _pieces_per_rank(a: int, b: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(pieces each sending TP rank of `a` sends, pieces each receiving TP rank of `b` receives) of
    `boundary_pieces(a, b)`: the peers each rank has across that boundary."""
    sends, receives = [0] * a, [0] * b
    for s, r, _, _ in boundary_pieces(a, b):
        sends[s] += 1
        receives[r] += 1
    return tuple(sends), tuple(receives)


def _communicators(world: int, group: _StageGroup, t: int, neighbours: tuple[int | None, int | None],
                   tp_rank: int) -> Communicators:
    """The communicators of TP rank `tp_rank` of a replica of TP `t` in a plan of `world` ranks, its
    stage's `_stage_group` and its `_neighbour_tps` (module docstring)."""
    pipes, stage_members, finest = group
    sync: list[int] = [stage_members] if stage_members > 1 else []
    if pipes > 1 and not (finest == 1 and pipes == stage_members):
        sync += [pipes] * (finest // t)  # one block group per block held, one rank per pipeline
    # the u-ranks whose slice overlaps this rank's (`boundary_pieces`), one channel each way
    before, after = neighbours
    p2p = 0
    if before is not None:  # this rank receives activations from them
        p2p += 2 * _pieces_per_rank(before, t)[1][tp_rank]
    if after is not None:  # this rank sends activations to them
        p2p += 2 * _pieces_per_rank(t, after)[0][tp_rank]
    return Communicators(world=(world,) if world > 1 else (), tp=(t,) if t > 1 else (), sync=tuple(sync),
                         p2p=(2,) * p2p)


def rank_communicators(plan: Plan, pipeline: int, stage: int, tp_rank: int) -> Communicators:
    """The communicators of the rank at (`pipeline`, `stage`, `tp_rank`) of `plan` (module docstring)."""
    t = plan.pipelines[pipeline].replicas[stage].tp
    return _communicators(plan.world_size, _stage_group(plan, stage), t, _neighbour_tps(plan, pipeline, stage), tp_rank)


def _replica_bytes(world: int, group: _StageGroup, t: int, neighbours: tuple[int | None, int | None]) -> float:
    """The most NCCL buffer bytes any of the `t` ranks of a replica holds (`_communicators`' arguments)."""
    return max(_communicators(world, group, t, neighbours, r).bytes for r in range(t))


def plan_nccl_bytes(plan: Plan) -> list[list[float]]:
    """The most NCCL buffer bytes any rank of each replica of `plan` holds, [pipeline][stage], in
    O(pipelines x stages):
    the world size and each stage's `_stage_group` counted once, and each (stage, TP, neighbours' TP)
    priced once."""
    world = plan.world_size
    groups = [_stage_group(plan, i) for i in range(plan.num_stages)]
    priced: dict[tuple, float] = {}
    out = []
    for j, p in enumerate(plan.pipelines):
        row = []
        for i, r in enumerate(p.replicas):
            key = (i, r.tp, _neighbour_tps(plan, j, i))
            if key not in priced:
                priced[key] = _replica_bytes(world, groups[i], r.tp, key[2])
            row.append(priced[key])
        out.append(row)
    return out


def uniform_nccl_bytes(tp: int, stage: int, num_stages: int, replicas: int, interleaved: bool = False) -> float:
    """NCCL buffer bytes of a rank of a plan whose `replicas` pipelines all run stage `stage` (of
    `num_stages`) at TP `tp` (what the planner knows before it has a plan; equal to
    `plan_nccl_bytes` for such a plan)."""
    world = tp * num_stages * replicas
    n = [world] if world > 1 else []
    n += [tp] if tp > 1 else []
    n += [tp * replicas] if tp * replicas > 1 else []
    n += [replicas] if replicas > 1 and tp > 1 else []
    wrap = interleaved and num_stages > 1
    n += [2] * (2 * (stage > 0 or wrap) + 2 * (stage < num_stages - 1 or wrap))
    return float(sum(communicator_bytes(k) for k in n))
