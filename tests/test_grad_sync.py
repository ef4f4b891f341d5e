"""Overlapped gradient reduction (`sailor.runtime.grad_sync`): which backward makes a layer's
gradients final under each schedule, the fixed issue order, and a 2-rank data-parallel step whose
timeline shows bucket collectives issued while the backward still runs (gloo, CPU), also spread over
lanes (`groups.create_sync_lanes`) with the same bits; and the optimizer's multi-tensor AdamW step
against torch's per-parameter AdamW, bit for bit."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from spawn import spawn

from sailor.plan.orders import interleaved_order, one_f_one_b_order, zb_h1_order
from sailor.plan.spec import Plan
from sailor.runtime.grad_sync import InFlight, Lanes, ReadyOrder, backwards_per_layer
from sailor.runtime.groups import GLOO_SYNC_LANES
from sailor.specs.job import JobSpec

TINY = JobSpec(model="tiny", global_batch_size=8)


def test_a_layer_is_final_after_its_chunks_last_backward_or_weight_pass():
    # 1F1B, 4 micro-batches: 4 B ops of chunk 0
    assert backwards_per_layer(one_f_one_b_order(2, 0, 4), [(0, 3)]) == {0: 4, 1: 4, 2: 4}
    # ZB-H1: the W ops call the last hook (B ops only the input-gradient pass)
    zb = zb_h1_order(3, 1, 5)
    assert sum(op.kind == "W" for op in zb) == 5
    assert backwards_per_layer(zb, [(2, 4)]) == {2: 5, 3: 5}
    # interleaved, v = 2, 4 micro-batches: each chunk runs 4 backwards
    order = interleaved_order(2, 2, 0, 4)
    assert backwards_per_layer(order, [(0, 2), (3, 5)]) == {0: 4, 1: 4, 3: 4, 4: 4}


def test_buckets_go_out_in_one_order_as_soon_as_they_and_all_before_them_are_final():
    # buckets 0..3 of layers 0, 0, 1, 2; issued in reverse: 3, 2, 1, 0
    r = ReadyOrder([3, 2, 1, 0], [0, 0, 1, 2])
    r.expected = {0: 2, 1: 2, 2: 2}
    assert [r.backward_done(layer) for layer in (2, 1, 0)] == [[], [], []]  # micro-batch 0: nothing final
    assert r.backward_done(2) == [3]
    assert r.backward_done(1) == [2]
    assert r.all_final is False
    assert r.backward_done(0) == [1, 0] and r.all_final
    assert r.rest() == []
    # a lower layer final first (an interleaved stage's chunks out of order) waits for the higher one
    r.expected = {0: 1, 1: 1, 2: 1}
    assert r.backward_done(0) == [] and r.backward_done(1) == [] and r.backward_done(2) == [3, 2, 1, 0]
    r.rest()
    # a backward too many is a bug of the caller
    assert r.backward_done(2) == [3]
    with pytest.raises(AssertionError):
        r.backward_done(2)


def test_without_expected_counts_everything_goes_out_at_the_end_in_the_same_order():
    r = ReadyOrder([2, 1, 0], [0, 1, 2])
    assert [r.backward_done(layer) for layer in (2, 1, 0)] == [[], [], []]
    assert not r.all_final and r.rest() == [2, 1, 0]


def test_in_flight_waits_oldest_first_and_keeps_the_newest():
    done = []
    f = InFlight()
    for i in range(3):
        f.add(None, lambda i=i: done.append(i))
    f.wait(keep=1)
    assert done == [0, 1] and len(f.items) == 1
    f.wait()
    assert done == [0, 1, 2] and not f.items


def test_a_groups_reductions_take_its_lanes_in_turn_whatever_other_groups_do():
    lanes = Lanes({(0, 1): "g01", (0, 2): "g02"}, {(0, 1): ("g01", "a", "b")})
    picked = [lanes.next(r) for r in [(0, 1), (0, 2), (0, 1), (0, 1), (0, 2), (0, 1)]]
    assert picked == ["g01", "g02", "a", "b", "g02", "g01"]  # (0, 2) has no lanes: its own group
    assert lanes.issued == {(0, 1): 4}
    with pytest.raises(KeyError):
        lanes.next((1, 2))


@pytest.mark.parametrize("case", ["mixed tp", "experts"])
def test_the_sync_groups_are_exactly_the_groups_of_every_ranks_buckets(case):
    from test_moe_ep import _plan, _spec
    from test_runtime_memory import PLAN_C

    from sailor.runtime.buckets import build_buckets
    from sailor.runtime.topology import derive_topology
    from sailor.runtime.worker import meta_stage

    if case == "mixed tp":  # 2 stages, TP 2 + TP 1 replicas: block groups of 2, stage groups of 3
        plan, spec = Plan.model_validate(PLAN_C), TINY.model
    else:  # 4 pipelines, EP 2: expert groups of 2 beside the stage group of 4
        plan, spec = Plan.model_validate(_plan([{"ep": 2, "placement": [[3], [0, 1, 2]]}], tps=(1, 1, 1, 1))), _spec()
    topo = derive_topology(plan)
    held = {b.ranks for role in topo.roles
            for b in build_buckets(dict(meta_stage(spec, role).named_parameters()), role, zero=1,
                                   sequence_parallel=False) if len(b.ranks) > 1}
    assert set(topo.sync_groups()) == held and len(held) >= 3
    assert [g for g in topo.groups() if g in held] == topo.sync_groups()  # one creation order


# ---- 2 ranks: the step's timeline ------------------------------------------------------------------
DP2 = {"micro_batch_size": 2, "stages": [[0, 6]],
       "pipelines": [{"microbatches": 2, "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}]}] * 2}


def _timeline_rank(rank: int, store: str, out: str) -> None:
    """One rank of a 2-pipeline data-parallel plan: two steps under ZeRO-0, ZeRO-2 and ZeRO-3 (re-sharded
    after every pass, and kept for the step); records the
    second step's sync timeline and loss."""
    import torch.distributed as dist

    from sailor.runtime.data import batch_tokens, load_corpus
    from sailor.runtime.groups import create_groups, create_sync_lanes
    from sailor.runtime.pipeline import P2P
    from sailor.runtime.topology import derive_topology
    from sailor.runtime.worker import build_rank, sync_exposed_s, train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    rows = {}
    for zero, reshard, lanes in ((0, True, False), (2, True, False), (3, True, False), (3, False, False),
                                 (0, True, True), (1, True, True), (2, True, True)):
        plan = Plan.model_validate({**DP2, "memory": [{"zero": zero, "reshard_after_forward": reshard}]})
        topo = derive_topology(plan)
        role = topo.roles[rank]
        groups = create_groups(topo, timedelta(seconds=60))
        rk = build_rank(plan, TINY, role, groups, device=torch.device("cpu"), seed=0,
                        lanes=create_sync_lanes(topo, groups, timedelta(seconds=60)) if lanes else None)
        p2p = P2P(role, shape=(2, TINY.seq, 64), device=torch.device("cpu"), timeout=timedelta(seconds=60))
        for step in range(2):
            tok = torch.from_numpy(batch_tokens(load_corpus(), seed=0, step=step, first=role.first_sample, count=4,
                                                seq=TINY.seq))
            res = train_step(rk, role, p2p, tok, mbs=2, loss_scale=1.0 / (8 * TINY.seq), scaler=None)
        total = res.loss_sum.reshape(1).clone()
        dist.all_reduce(total)
        rows[f"{zero}{'' if reshard else ' kept'}{' lanes' if lanes else ''}"] = {
            **rk.optimizer.last_timeline.seconds(), "buckets": len(rk.optimizer.buckets),
            "layers": len(rk.optimizer.layer_params), "gathers": rk.optimizer.last_timeline.gathers,
            "loss": total.item() / (8 * TINY.seq), "exposed": sync_exposed_s(rk.optimizer),
            "lane_issued": list(rk.optimizer._lanes.issued.items()),
            "weights": [p.detach().flatten()[:64].tolist() for p in rk.optimizer.params.values()] if zero < 3 else None}
    Path(out).joinpath(f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.integration
def test_gradient_sync_runs_during_the_backward(tmp_path):
    spawn(_timeline_rank, 2, str(tmp_path / "store"), str(tmp_path))
    for r in range(2):
        rows = json.loads((tmp_path / f"rank{r}.json").read_text())
        # lanes (gloo: GLOO_SYNC_LANES groups of ranks (0, 1) taking the reductions in turn): the same
        # weights bit for bit as one group, and every reduction went out through them
        assert GLOO_SYNC_LANES >= 2
        for zero in ("0", "2"):
            assert rows[f"{zero} lanes"]["weights"] == rows[zero]["weights"], zero
            assert rows[f"{zero} lanes"]["loss"] == rows[zero]["loss"], zero
            assert rows[zero]["lane_issued"] == []
        for zero in ("0", "1", "2"):
            row = rows[f"{zero} lanes"]
            assert row["lane_issued"] == [[[0, 1], len(row["issued_s"]) * 2]], row  # 2 steps
        assert rows["1 lanes"]["loss"] == pytest.approx(rows["0"]["loss"], rel=1e-6)
        rows = {k: v for k, v in rows.items() if "lanes" not in k or k == "0 lanes"}
        for zero, row in rows.items():
            issued = [s for _, s in row["issued_s"]]
            n = row["buckets"]
            assert n >= 2, row
            # ZeRO-0: one all-reduce per bucket per step, in reverse bucket order; ZeRO-2/3: one
            # reduce-scatter per bucket per micro-batch (2), in the layers' backward order
            assert len(issued) == (n if zero.startswith("0") else 2 * n), row
            if zero.startswith("0"):
                assert [i for i, _ in row["issued_s"]] == list(reversed(range(n)))
            assert issued == sorted(issued)
            end = row["backward_end_s"]
            assert issued[0] < end <= row["waited_s"], row  # a sync started before the backward ended
            assert sum(s < end for s in issued) >= (n - 1 if zero.startswith("0") else 2 * n - 1), row
            assert row["exposed"] == pytest.approx(row["waited_s"] - end)  # the metrics' sync_exposed_s
            order, finished = [i for i, _ in row["issued_s"]], row["finished_s"]
            assert [i for i, _ in finished] == order and all(s <= row["waited_s"] for _, s in finished), row
            if not zero.startswith("0"):
                # ZeRO-2/3, one bucket per layer here: each reduce-scatter is waited on once the next
                # layer's was issued, so it runs under that layer's backward (the last one of a
                # micro-batch under the next micro-batch's forward and first layer backward), and no
                # later than the one after it is issued (at most two in flight: one layer's transient)
                assert n == row["layers"], row
                for p, (_, s) in enumerate(finished):
                    assert p + 1 == len(issued) or issued[p + 1] <= s, (p, row)
                    assert p + 2 >= len(issued) or s <= issued[p + 2], (p, row)
        # ZeRO-3 gathers, L layers, 2 micro-batches: re-sharded after every pass, 2 x 2 passes of L
        # gathers, each issued one layer ahead but the first of its pass; kept, one gather per layer,
        # the forward's first layer on demand
        L = rows["3"]["layers"]
        passes = [list(range(L)), list(reversed(range(L)))] * 2
        assert rows["3"]["gathers"] == [[layer, i > 0] for p in passes for i, layer in enumerate(p)]
        assert rows["3 kept"]["gathers"] == [[layer, layer > 0] for layer in range(L)]
        assert rows["0"]["gathers"] == rows["2"]["gathers"] == []
        for zero in ("2", "3", "3 kept"):
            assert rows["0"]["loss"] == pytest.approx(rows[zero]["loss"], rel=1e-6)


# ---- the multi-tensor AdamW step -------------------------------------------------------------------
@pytest.mark.parametrize("zero", [0, 3])  # 0: masters copied from the weights per layer; 3: kept masters
def test_multi_tensor_step_gives_the_bits_of_torchs_per_parameter_adamw(zero):
    from sailor.runtime.optim import OptimConfig, build_optimizer
    from sailor.runtime.topology import derive_topology
    from sailor.runtime.worker import build_rank

    job = JobSpec(model={"name": "untied", "num_blocks": 2, "hidden_size": 64, "num_heads": 4, "vocab_size": 256,
                         "max_sequence_length": 32, "tied_embeddings": False}, global_batch_size=4)
    plan = Plan.model_validate({**DP2, "stages": [[0, 4]], "pipelines": DP2["pipelines"][:1],
                                "memory": [{"zero": zero}]})
    rk = build_rank(plan, job, derive_topology(plan).roles[0], {}, device=torch.device("cpu"), seed=0)
    opt = rk.optimizer
    for layer in opt.layer_params:
        opt.before_backward(layer)  # ZeRO-3: the weights gathered
    ref = {n: torch.nn.Parameter(p.detach().clone()) for n, p in opt.params.items()}
    ref_opt = build_optimizer(ref, OptimConfig())
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in ref.items()}
        for layer in sorted(opt.layer_params, reverse=True):
            opt.before_backward(layer)
            for n in opt.layer_params[layer]:
                opt.params[n].grad = grads[n].clone()
            opt.after_backward(layer)
        opt.reduce()
        opt.step()
        for n, p in ref.items():
            p.grad = grads[n]
        ref_opt.step()
    state = opt.full_state()
    for n, p in ref.items():
        assert torch.equal(state[n]["param"], p.detach()), n
        assert torch.equal(state[n]["exp_avg"], ref_opt.state[p]["exp_avg"]), n
