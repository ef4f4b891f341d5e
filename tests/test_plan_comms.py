"""NCCL communicators per rank and their buffer memory (`sailor.plan.comms`), by hand."""

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sailor.plan.comms import (
    CHANNELS,
    NCCL_BUFFSIZE,
    boundary_pieces,
    communicator_bytes,
    plan_nccl_bytes,
    rank_communicators,
    uniform_nccl_bytes,
)
from sailor.plan.placement import rank_layout
from sailor.plan.spec import Plan

MIB = 2**20


def _rep(stage, tp, gpu="A100-40"):
    return {"stage": stage, "gpu": gpu, "zone": "us-central1-a", "tp": tp}


# The README's plan: an A100 pipeline at TP 4 / 4 and a V100 pipeline at TP 4 / 2, 14 ranks.
MIXED = Plan.model_validate({"micro_batch_size": 4, "stages": [[0, 7], [7, 26]], "pipelines": [
    {"microbatches": 160, "replicas": [_rep(0, 4), _rep(1, 4)]},
    {"microbatches": 96, "replicas": [_rep(0, 4, "V100-16"), _rep(1, 2, "V100-16")]}]})


def test_buffer_bytes_per_communicator():
    assert (NCCL_BUFFSIZE, CHANNELS) == (4 * MIB, 2)
    assert communicator_bytes(1) == 0
    assert communicator_bytes(2) == 16 * MIB  # 4 MiB x send/recv x 2 channels x 1 peer
    assert communicator_bytes(8) == 32 * MIB  # a ring: 2 peers


def test_mixed_tp_plan_by_hand():
    # V100 stage 1, TP rank 0 (TP 2): world 14, TP 2, stage group 4 + 2 = 6, L = lcm(4, 2) = 4 so
    # 4 / 2 = 2 block groups of one rank per pipeline; from stage 0 (TP 4) its half of the activation
    # comes in two quarters, from TP ranks 0 and 1, and its gradient's quarters go back to them:
    # 4 channels.
    c = rank_communicators(MIXED, 1, 1, 0)
    assert (c.world, c.tp, c.sync, c.p2p) == ((14,), (2,), (6, 2, 2), (2, 2, 2, 2))
    assert c.count == 9 and c.bytes == (32 + 16 + 32 + 16 + 16 + 4 * 16) * MIB
    # V100 stage 0, TP rank 2 (TP 4): its quarter goes to stage 1's TP rank 1 (TP 2), the
    # gradient's quarter comes back from it: 2 channels.
    c = rank_communicators(MIXED, 1, 0, 2)
    assert (c.world, c.tp, c.sync, c.p2p) == ((14,), (4,), (8, 2), (2, 2))
    assert plan_nccl_bytes(MIXED)[1][0] == (32 + 32 + 32 + 16 + 2 * 16) * MIB  # every TP rank: 2 channels


@pytest.mark.parametrize("a", range(1, 9))
@pytest.mark.parametrize("b", range(1, 9))
def test_boundary_pieces_cover_the_tensor_once_with_equal_shares(a, b):
    pieces = boundary_pieces(a, b)
    assert len(pieces) == a + b - math.gcd(a, b)
    assert pieces[0][2] == 0 and pieces[-1][3] == 1
    assert all(x[3] == y[2] for x, y in itertools.pairwise(pieces))  # contiguous, no overlap
    for s in range(a):  # each sender sends exactly its own 1/a, in order
        mine = [(lo, hi) for x, _, lo, hi in pieces if x == s]
        assert mine[0][0] == Fraction(s, a) and mine[-1][1] == Fraction(s + 1, a)
    for r in range(b):  # each receiver gets exactly its own 1/b
        mine = [(lo, hi) for _, x, lo, hi in pieces if x == r]
        assert mine[0][0] == Fraction(r, b) and mine[-1][1] == Fraction(r + 1, b)


def test_boundary_pieces_by_hand():
    f = Fraction
    assert boundary_pieces(2, 2) == [(0, 0, 0, f(1, 2)), (1, 1, f(1, 2), 1)]
    assert boundary_pieces(2, 3) == [(0, 0, 0, f(1, 3)), (0, 1, f(1, 3), f(1, 2)), (1, 1, f(1, 2), f(2, 3)),
                                     (1, 2, f(2, 3), 1)]
    assert boundary_pieces(1, 1) == [(0, 0, 0, 1)]
    with pytest.raises(ValueError):
        boundary_pieces(0, 2)


def test_uniform_plan_equals_the_planners_bound():
    for v, tp, pipes in ((1, 1, 1), (1, 2, 3), (2, 4, 2), (1, 1, 4)):
        stages = [[0, 2], [2, 4], [4, 6], [6, 8]] if v == 2 else [[0, 3], [3, 6]]
        plan = Plan.model_validate({
            "micro_batch_size": 1, "stages": stages,
            **({"schedule": {"kind": "interleaved-1f1b", "virtual_stages": 2}} if v == 2 else {}),
            "pipelines": [{"microbatches": 4, "replicas": [_rep(0, tp), _rep(1, tp)]}] * pipes})
        for i in range(2):
            assert plan_nccl_bytes(plan)[0][i] == uniform_nccl_bytes(tp, i, 2, pipes, interleaved=v > 1), (v, tp, pipes)


def test_interleaving_wraps_round():
    plan = Plan.model_validate({"micro_batch_size": 1, "stages": [[0, 2], [2, 4], [4, 6], [6, 8]],
                                "schedule": {"kind": "interleaved-1f1b", "virtual_stages": 2},
                                "pipelines": [{"microbatches": 4, "replicas": [_rep(0, 1), _rep(1, 1)]}]})
    # stage 0 both receives from and sends to stage 1, each way activation and gradient: 4 channels
    assert rank_communicators(plan, 0, 0, 0).p2p == (2, 2, 2, 2)
    single = Plan.model_validate({"micro_batch_size": 1, "stages": [[0, 8]],
                                  "pipelines": [{"microbatches": 4, "replicas": [_rep(0, 1)]}]})
    assert rank_communicators(single, 0, 0, 0).count == 0 and plan_nccl_bytes(single)[0][0] == 0


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_count_is_within_the_issue_range_for_a_dp_tp_pp_rank(tp):
    plan = Plan.model_validate({"micro_batch_size": 1, "stages": [[0, 2], [2, 4], [4, 6]], "pipelines": [
        {"microbatches": 4, "replicas": [_rep(0, tp), _rep(1, tp), _rep(2, tp)]}] * 2})
    assert 4 <= rank_communicators(plan, 0, 1, 0).count <= 9



def _reference_communicators(plan, pipeline, stage, tp_rank):
    """(world, tp, sync, p2p) of one rank as the module docstring defines them, counted over the
    ranks of `rank_layout` one by one (the straightforward reference `rank_communicators` and
    `plan_nccl_bytes` must agree with)."""
    ranks = rank_layout(plan)
    me = next(x for x in ranks if (x.pipeline, x.stage, x.tp_rank) == (pipeline, stage, tp_rank))
    holders = [x for x in ranks if x.stage == stage]
    tps = [x.tp for x in holders if x.tp_rank == 0]  # one per pipeline
    sync = [len(holders)] if len(holders) > 1 else []
    if len(tps) > 1 and any(t > 1 for t in tps):  # block groups, unless they equal the stage group
        sync += [len(tps)] * (math.lcm(*tps) // me.tp)
    P = plan.num_stages
    wrap = plan.virtual_stages > 1 and P > 1
    peers = 0
    for other in (stage - 1, stage + 1):
        if not (0 <= other < P or wrap):
            continue
        u = next(x.tp for x in ranks if x.pipeline == pipeline and x.stage == other % P)
        # the neighbour's TP ranks whose slice [q/u, (q+1)/u) overlaps mine [r/t, (r+1)/t)
        lo, hi = Fraction(tp_rank, me.tp), Fraction(tp_rank + 1, me.tp)
        peers += sum(1 for q in range(u) if Fraction(q, u) < hi and lo < Fraction(q + 1, u))
    return ((len(ranks),) if len(ranks) > 1 else (), (me.tp,) if me.tp > 1 else (), tuple(sync),
            (2,) * (2 * peers))  # one channel each way per peer


def _check_against_reference(plan):
    table = plan_nccl_bytes(plan)
    assert [len(row) for row in table] == [plan.num_stages] * len(plan.pipelines)
    for j, p in enumerate(plan.pipelines):
        for i, r in enumerate(p.replicas):
            ref = [_reference_communicators(plan, j, i, k) for k in range(r.tp)]
            for k in range(r.tp):
                c = rank_communicators(plan, j, i, k)
                assert (c.world, c.tp, c.sync, c.p2p) == ref[k], (j, i, k)
            most = max(float(sum(communicator_bytes(n) for part in x for n in part)) for x in ref)
            assert table[j][i] == most, (j, i)


def test_plan_table_on_the_mixed_plan():
    # the README plan (hand-checked above): V100 stage 1 at TP 2 holds the most, 9 communicators
    _check_against_reference(MIXED)
    assert plan_nccl_bytes(MIXED)[1][1] == (32 + 16 + 32 + 16 + 16 + 4 * 16) * MIB


_TPS = st.sampled_from([1, 2, 3, 4, 8])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.booleans(), st.lists(st.tuples(st.integers(1, 3), st.data()), min_size=1, max_size=4))
def test_communicators_equal_the_rank_by_rank_reference(P, interleaved, pipes):
    interleaved = interleaved and P > 1
    v = 2 if interleaved else 1
    # pipelines repeat so that the table's per-(stage, TP, neighbours) pricing is shared
    pipelines = [{"microbatches": m, "replicas": [_rep(i, data.draw(_TPS)) for i in range(P)]} for m, data in pipes]
    plan = Plan.model_validate({"micro_batch_size": 1, "stages": [[k, k + 1] for k in range(P * v)],
                                **({"schedule": {"kind": "interleaved-1f1b", "virtual_stages": 2}} if interleaved else {}),
                                "pipelines": pipelines + pipelines[:1]})
    _check_against_reference(plan)
