"""Moving the training state to a new plan in memory (`runtime.reshard_plan`, `runtime.reshard`).

Without processes: hand-checked plans (TP 2 -> 1 with and without the second rank, a pipeline
repartition 2 -> 3 stages, ZeRO-1 -> ZeRO-3 with the processes kept and swapped, a shrink whose lost
ZeRO shards come from the checkpoint) and, for each, the property that every new rank's needs are
covered exactly once by pieces its sources really hold. With 2 gloo ranks: state trained under one
plan and moved in memory equals, bit for bit, what saving under that plan and loading under the new
one gives.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from sailor.plan.spec import Plan
from sailor.runtime.checkpoint_io import as_2d
from sailor.runtime.model import param_shapes
from sailor.runtime.reshard_plan import CHECKPOINT, KEYS, Slice, held_by, plan_reshard
from sailor.specs.job import JobSpec

TINY = JobSpec(model="tiny", global_batch_size=8)
SPEC = TINY.model
Q, O, NORM = "layers.1.attn.q.weight", "layers.1.attn.o.weight", "layers.1.norm1.weight"  # split dim 0, 1, none


def plan(*pipelines: tuple[int, ...], stages=((0, 6),), zero: int = 0) -> Plan:
    """A CPU plan: one tuple of per-stage TP degrees per pipeline, the global batch (8) split evenly."""
    return Plan.model_validate({
        "micro_batch_size": 2, "stages": [list(s) for s in stages], "memory": [{"zero": zero}] * len(stages),
        "pipelines": [{"microbatches": 4 // len(pipelines), "replicas": [
            {"stage": i, "gpu": "cpu", "zone": "local", "tp": t} for i, t in enumerate(tps)]} for tps in pipelines]})


def moves(rp, name: str, key: str, dst: int = 0) -> list[tuple[int, tuple]]:
    """(old rank or CHECKPOINT, rectangle) of each transfer of `key` of `name` to `dst`, in plan order."""
    return [(t.src, t.rect) for t in rp.transfers if (t.name, t.key, t.dst) == (name, key, dst)]


def check_exact_cover(rp, old: Plan, *, weights_fp32: bool = True) -> None:
    """Every new rank gets each element it needs exactly once and nothing else, and every piece comes
    from a slice its old rank holds, inside that slice's rectangle."""
    held = held_by(old, SPEC, sorted(rp.survivors), weights_fp32=weights_fp32)
    for t in rp.transfers:
        if t.src != CHECKPOINT:
            assert t.source in held[t.src], t
            assert t.src_rect in t.source.rects(rp.shapes[t.name]), t
            a, b, h, w, _ = t.src_rect
            r0, c0, rh, rw = t.rect
            assert a <= r0 and r0 + rh <= a + h and b <= c0 and c0 + rw <= b + w, t
    for dst, needs in rp.needs.items():
        count = {(n, k): torch.zeros(as_2d(list(shape), 0)[:2], dtype=torch.int32)
                 for n, shape in rp.shapes.items() for k in KEYS}  # needed -1, given +1: all 0 at the end
        for s in needs:
            for r0, c0, h, w, _ in s.rects(rp.shapes[s.name]):
                count[(s.name, s.key)][r0:r0 + h, c0:c0 + w] -= 1
        for t in rp.transfers:
            if t.dst == dst:
                r0, c0, h, w = t.rect
                count[(t.name, t.key)][r0:r0 + h, c0:c0 + w] += 1
        for (name, key), c in count.items():
            assert not c.any(), (dst, name, key)


def test_tp2_to_tp1_takes_each_half_from_its_holder():
    """TP 2 -> TP 1 (one replica, ZeRO-0). With old rank 1 lost, rank 0 keeps its half of each split
    tensor (rows 0-31 of q, columns 0-31 of o: no transfer) and reads the other from the checkpoint; a
    replicated norm is all its own. With old rank 1 alive as a leaving process, it sends its halves."""
    old, new = plan((2,)), plan((1,))
    rp = plan_reshard(old, new, SPEC, {0: 0})
    assert moves(rp, Q, "param") == [(CHECKPOINT, (32, 0, 32, 64)), (0, (0, 0, 32, 64))]
    kept = next(t for t in rp.transfers if (t.name, t.key, t.src) == (Q, "param", 0))
    assert kept.source == Slice(Q, "param", 0, 0, 32, 0, 32 * 64, weights=True) and kept.src_rect == (0, 0, 32, 64, 0)
    assert moves(rp, O, "exp_avg") == [(CHECKPOINT, (0, 32, 64, 32)), (0, (0, 0, 64, 32))]
    assert moves(rp, NORM, "exp_avg_sq") == [(0, (0, 0, 1, 64))]
    assert rp.needs_checkpoint and rp.moved_elements()["sent"] == 0
    check_exact_cover(rp, old)

    rp = plan_reshard(old, new, SPEC, {0: 0, 1: 1})
    assert moves(rp, Q, "param") == [(0, (0, 0, 32, 64)), (1, (32, 0, 32, 64))]
    sent = next(t for t in rp.transfers if (t.name, t.key, t.src) == (Q, "param", 1))
    assert sent.source == Slice(Q, "param", 0, 32, 32, 0, 32 * 64, weights=True) and sent.src_rect == (32, 0, 32, 64, 0)
    assert moves(rp, O, "exp_avg") == [(0, (0, 0, 64, 32)), (1, (0, 32, 64, 32))]
    assert not rp.needs_checkpoint
    check_exact_cover(rp, old)


def test_pipeline_repartition_from_2_to_3_stages_moves_whole_layers_from_their_stage():
    """Layers 0-2 | 3-5 -> 0-1 | 2-3 | 4-5: each layer's tensors go whole from the old stage holding it
    to the new one, a third process (new rank 2, no old state) included; what stays is not sent."""
    old = plan((1, 1), stages=((0, 3), (3, 6)))
    new = plan((1, 1, 1), stages=((0, 2), (2, 4), (4, 6)))
    rp = plan_reshard(old, new, SPEC, {0: 0, 1: 1})
    pairs = {int(t.name.split(".")[1]): set() for t in rp.transfers}
    for t in rp.transfers:
        rows, cols, _ = as_2d(list(rp.shapes[t.name]), 0)
        assert t.rect == (0, 0, rows, cols), t
        pairs[int(t.name.split(".")[1])].add((t.src, t.dst))
    assert pairs == {0: {(0, 0)}, 1: {(0, 0)}, 2: {(0, 1)}, 3: {(1, 1)}, 4: {(1, 2)}, 5: {(1, 2)}}
    numel = {layer: 3 * sum(math.prod(s) for n, s in param_shapes(SPEC).items() if n.split(".")[1] == str(layer))
             for layer in range(6)}
    assert rp.moved_elements() == {"sent": numel[2] + numel[4] + numel[5],
                                   "local": numel[0] + numel[1] + numel[3], "checkpoint": 0}
    # one message per (sending process, receiving rank): 0 -> 1 carries layer 2, 1 -> 2 layers 4 and 5
    sizes = {pair: sum(t.numel for t in ts) for pair, ts in rp.messages().items()}
    assert sizes == {(0, 1): numel[2], (1, 2): numel[4] + numel[5]}
    assert {pair: sum(t.numel for t in ts) for pair, ts in rp.messages(moments=False).items()} == {
        pair: n // 3 for pair, n in sizes.items()}  # before the first step: the weights only
    check_exact_cover(rp, old)


def test_zero1_to_zero3_at_the_same_data_parallelism_moves_nothing_unless_the_ranks_swap():
    """DP 2: ZeRO-1 and ZeRO-3 shard each bucket the same way, so each rank keeps its own shard (the
    weights' owned ranges from its full replica). With the processes swapped, the weights still come
    from each process's own replica, but every moment element crosses once."""
    old, new = plan((1,), (1,), zero=1), plan((1,), (1,), zero=3)
    total = sum(math.prod(s) for s in param_shapes(SPEC).values())
    rp = plan_reshard(old, new, SPEC, {0: 0, 1: 1})
    assert rp.moved_elements() == {"sent": 0, "local": 3 * total, "checkpoint": 0}
    for t in rp.transfers:
        if t.key != "param":
            assert t.source in rp.needs[t.dst], t  # slice for slice: the same ownership
    check_exact_cover(rp, old)

    rp = plan_reshard(old, new, SPEC, {0: 1, 1: 0})
    assert rp.moved_elements() == {"sent": 2 * total, "local": total, "checkpoint": 0}
    assert all(rp.process(t.src) == t.dst for t in rp.transfers if t.key == "param")
    check_exact_cover(rp, old)


def test_a_shrink_reads_the_lost_shards_from_the_checkpoint():
    """DP 2 under ZeRO-1 -> one rank, old rank 1 lost. Its full replica of the weights gives rank 0
    every weight, but the Adam moments of rank 1's half of each bucket exist nowhere else. The
    embedding layer's bucket is tok (256 x 64 = 16384) then pos (64 x 64 = 4096): 20480 elements,
    rank 1 owned [10240, 20480), rows 160-255 of tok and all of pos. Without fp32 weights (bf16) the
    weights' second halves come from the checkpoint too."""
    old, new = plan((1,), (1,), zero=1), plan((1,), zero=1)
    rp = plan_reshard(old, new, SPEC, {0: 0})
    tok, pos = "layers.0.tok.weight", "layers.0.pos.weight"
    assert moves(rp, tok, "exp_avg") == [(CHECKPOINT, (160, 0, 96, 64)), (0, (0, 0, 160, 64))]
    assert moves(rp, pos, "exp_avg_sq") == [(CHECKPOINT, (0, 0, 64, 64))]
    assert moves(rp, tok, "param") == [(0, (0, 0, 256, 64))]
    total = sum(math.prod(s) for s in param_shapes(SPEC).values())
    moved = rp.moved_elements()
    assert moved["sent"] == 0 and moved["local"] + moved["checkpoint"] == 3 * total and moved["checkpoint"] > 0
    check_exact_cover(rp, old)

    rp = plan_reshard(old, new, SPEC, {0: 0}, weights_fp32=False)
    assert moves(rp, tok, "param") == [(CHECKPOINT, (160, 0, 96, 64)), (0, (0, 0, 160, 64))]
    check_exact_cover(rp, old, weights_fp32=False)


def test_sources_spread_over_replicas_and_prefer_the_receivers_node():
    """Two old replicas (ZeRO-0) survive as processes 2 and 3, which as new ranks 2 and 3 keep their own
    copy; newcomers 0 and 1 get every tensor from one of them. On one node the load is split (neither
    sends more than the other plus one tensor's three keys); with process 2 on newcomer 0's node and 3
    on newcomer 1's, each newcomer takes everything from its neighbour."""
    old, new = plan((1,), (1,)), plan((1,), (1,), (1,), (1,))
    total = sum(math.prod(s) for s in param_shapes(SPEC).values())
    largest = max(math.prod(s) for s in param_shapes(SPEC).values())
    rp = plan_reshard(old, new, SPEC, {0: 2, 1: 3}, node_of=dict.fromkeys(range(4), "n"))
    assert rp.moved_elements() == {"sent": 2 * 3 * total, "local": 2 * 3 * total, "checkpoint": 0}
    sent = {0: 0, 1: 0}
    for t in rp.transfers:
        if rp.process(t.src) != t.dst:
            sent[t.src] += t.numel
    assert abs(sent[0] - sent[1]) <= largest, sent
    check_exact_cover(rp, old)

    rp = plan_reshard(old, new, SPEC, {0: 2, 1: 3}, node_of={0: "a", 2: "a", 1: "b", 3: "b"})
    assert {(t.src, t.dst) for t in rp.transfers} == {(0, 0), (1, 1), (0, 2), (1, 3)}
    check_exact_cover(rp, old)


@pytest.mark.parametrize("old", [plan((2,), zero=1), plan((2,), (1,), zero=1), plan((2,), (1,), zero=3),
                                 plan((1, 2), (2, 1), stages=((0, 3), (3, 6)), zero=2)],
                         ids=["tp2 zero-1", "tp2+tp1 zero-1", "tp2+tp1 zero-3", "pp2 mixed tp zero-2"])
def test_the_planned_holdings_are_what_a_live_optimizer_holds(old):
    """Each rank's optimizer, built (no process group: nothing here communicates) under plans with
    replicas of different TP degrees, yields from `checkpoint_entries(every_holder=True)` exactly the
    owned slices `held_by` plans with, and its weights are the TP shards planned as `weights`; a move to
    a plan with the TP degrees swapped covers every need exactly once."""
    from sailor.runtime.topology import derive_topology
    from sailor.runtime.worker import build_rank

    held = held_by(old, SPEC, range(old.world_size), weights_fp32=True)
    owned = held_by(old, SPEC, range(old.world_size), weights_fp32=False)
    for role in derive_topology(old).roles:
        opt = build_rank(old, TINY, role, {}, device=torch.device("cpu"), seed=0).optimizer
        opt.steps = 1  # the moments are yielded once a step was taken
        got = {Slice(n, k, d, a, w, lo, lo + flat.numel()) for n, k, d, a, w, lo, flat in
               opt.checkpoint_entries(every_holder=True)}
        assert got == set(owned[role.rank]), role.rank
        weights = {s for s in held[role.rank] if s.weights}
        assert {s.name: s.hi for s in weights} == ({n: p.numel() for n, p in opt.params.items()}
                                                   if role.memory.zero < 3 else {})
    new = plan(*[tuple(3 - t for t in (r.tp for r in p.replicas)) for p in old.pipelines],
               stages=tuple(tuple(c) for c in old.stages), zero=1)
    check_exact_cover(plan_reshard(old, new, SPEC, {r: r for r in range(old.world_size)}), old)


@pytest.mark.parametrize(("survivors", "match"), [({2: 0}, "not a rank of the old plan"),
                                                  ({0: 1, 1: 1}, "two old ranks map to one process"),
                                                  ({0: -1}, "not a process group rank")])
def test_bad_survivor_maps_are_refused(survivors, match):
    with pytest.raises(ValueError, match=match):
        plan_reshard(plan((1,), (1,)), plan((1,)), SPEC, survivors)


def test_every_key_is_planned():
    assert KEYS == ("param", "exp_avg", "exp_avg_sq")


# ---- 2 gloo ranks: in memory == through a checkpoint ----------------------------------------------
META = {"seed": 0, "model": {}, "global_batch_size": 8}
PP2 = {"stages": ((0, 3), (3, 6))}


def _cases() -> dict[str, tuple[Plan, Plan, dict[int, int], torch.dtype]]:
    """name -> (old plan, new plan, survivors, compute dtype) of the moves the 2 ranks check; the old
    plans are trained (fp16: weights in fp16, fp32 master and moments, as on a GPU)."""
    tp2, pp2, fp16 = plan((2,), zero=1), plan((1, 1), **PP2), plan((2,), zero=0)
    return {"tp2 zero-1 -> dp2 zero-2": (tp2, plan((1,), (1,), zero=2), {0: 0, 1: 1}, torch.float32),
            "pp2 -> pp1, rank 1 lost": (pp2, plan((1,)), {0: 0}, torch.float32),
            "pp2 -> pp1, rank 1 leaves": (pp2, plan((1,)), {0: 0, 1: 1}, torch.float32),
            "fp16 tp2 zero-0 -> dp2 zero-3": (fp16, plan((1,), (1,), zero=3), {0: 0, 1: 1}, torch.float16)}


def _trained(old: Plan, rank: int, timeout: timedelta, dtype: torch.dtype):
    """Rank `rank`'s model under `old` after two training steps in `dtype`."""
    from sailor.runtime.data import batch_tokens, load_corpus
    from sailor.runtime.groups import create_channel_groups, create_groups
    from sailor.runtime.pipeline import P2P
    from sailor.runtime.tensor_parallel import sliced_edges
    from sailor.runtime.topology import derive_topology
    from sailor.runtime.worker import build_rank, train_step

    topo = derive_topology(old)
    role, cpu = topo.roles[rank], torch.device("cpu")
    groups = create_groups(topo, timeout)
    channels = create_channel_groups(topo, timeout)
    rk = build_rank(old, TINY, role, groups, device=cpu, seed=0, dtype=dtype)
    p2p = P2P(role, shape=(2, TINY.seq, SPEC.hidden_size), device=cpu, timeout=timeout, dtype=dtype, channels=channels,
              tp_group=groups.get(role.tp_group), sliced=sliced_edges(rk.stage, role.chunks, sequence_parallel=False))
    for step in range(2):
        tok = torch.from_numpy(batch_tokens(load_corpus(), seed=0, step=step, first=role.first_sample,
                                            count=role.microbatches * 2, seq=TINY.seq))
        train_step(rk, role, p2p, tok, mbs=2, loss_scale=1.0 / (8 * TINY.seq), scaler=None)
    return rk, role


def _move_rank(rank: int, store: str, root: str, out: str) -> None:
    """One of 2 gloo ranks (tags ignored, as under NCCL): for each case, train the old plan 2 steps (once
    per old plan), save a checkpoint, load it under the new plan, move the live state in memory to the
    new plan, and record where the two differ."""
    import torch.distributed as dist

    from sailor.runtime import checkpoint as ckpt
    from sailor.runtime.checkpoint_io import Reader
    from sailor.runtime.groups import create_groups, ignore_tags
    from sailor.runtime.reshard import ReshardError, rebuild_rank
    from sailor.runtime.topology import derive_topology
    from sailor.runtime.worker import build_rank, model_layout, save_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    assert ignore_tags()
    timeout, cpu = timedelta(seconds=60), torch.device("cpu")
    trained: dict[int, tuple] = {}
    rows: dict = {}
    cases = _cases()
    for name, (old, new, survivors, dtype) in cases.items():
        if id(old) not in trained:
            rk, role = _trained(old, rank, timeout, dtype)
            path = save_checkpoint(Path(root) / str(len(trained)), 2, META, rk.optimizer, role, cpu,
                                   model_layout(SPEC))
            trained[id(old)] = (rk, path)
        rk, path = trained[id(old)]
        topo = derive_topology(new)
        groups = create_groups(topo, timeout)
        reader = Reader(path, ckpt.read_manifest(path, verify=False))
        want = (build_rank(new, TINY, topo.roles[rank], groups, device=cpu, seed=0, reader=reader, step=2,
                           dtype=dtype) if rank < new.world_size else None)
        rp = plan_reshard(old, new, SPEC, survivors, weights_fp32=dtype == torch.float32)
        got = rebuild_rank(rp, new, TINY, groups, old=rk.optimizer if rank in survivors else None, device=cpu,
                           checkpoint=reader, dtype=dtype)
        reader.close()
        row = {"moved": rp.moved_elements(), "built": got is not None, "differ": []}
        if want is not None:
            a, b = want.optimizer.full_state(), got.optimizer.full_state()
            row["steps"] = [want.optimizer.steps, got.optimizer.steps]
            row["keys"] = sorted({k for e in b.values() for k in e})
            row["differ"] = [f"{n} {k}" for n in a for k in a[n] if not torch.equal(a[n][k], b[n].get(k))]
            got_w = dict(got.stage.named_parameters())
            if new.stage_memory(0).zero < 3:  # ZeRO-3 frees the weights between passes: the master is all
                row["differ"] += [f"{n} weights" for n, p in want.stage.named_parameters()
                                  if not torch.equal(p, got_w[n])]
            row["dtype"] = str(next(iter(got_w.values())).dtype)
        rows[name] = row
    old, new, _, _ = cases["pp2 -> pp1, rank 1 lost"]  # refused moves: every process raises, none hangs
    rk, path = trained[id(old)]
    rows["errors"] = {}
    for label, checkpoint, bump in (("no checkpoint", False, 0), ("step mismatch", True, 1)):
        reader = Reader(path, ckpt.read_manifest(path, verify=False)) if checkpoint else None
        rk.optimizer.steps += bump
        try:
            rebuild_rank(plan_reshard(old, new, SPEC, {0: 0}), new, TINY, {}, old=rk.optimizer if rank == 0 else None,
                         device=cpu, checkpoint=reader)
            rows["errors"][label] = None
        except ReshardError as e:
            rows["errors"][label] = str(e)
        rk.optimizer.steps -= bump
        if reader is not None:
            reader.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.integration
def test_state_moved_in_memory_equals_a_checkpoint_round_trip(tmp_path, monkeypatch):
    """TP 2 under ZeRO-1 -> 2 data-parallel TP-1 replicas under ZeRO-2 (both ranks survive); 2 stages
    -> 1 with the second stage's rank lost (its layers read from the checkpoint) and leaving (it
    sends them); fp16 TP 2 under ZeRO-0 -> DP 2 under ZeRO-3 (only fp32 masters are sources): weights,
    fp32 master and both Adam moments and the step count equal, bit for bit, the new plan's load of a
    checkpoint saved under the old one after 2 training steps."""
    from spawn import spawn

    monkeypatch.setenv("SAILOR_IGNORE_TAGS", "1")
    spawn(_move_rank, 2, str(tmp_path / "store"), str(tmp_path / "ck"), str(tmp_path), timeout_s=180)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name, (_, new, _, dtype) in _cases().items():
        for r in range(new.world_size):
            row = rows[r][name]
            assert row["built"] and row["differ"] == [] and row["steps"] == [2, 2], (name, r, row)
            assert row["keys"] == sorted(KEYS) and row["dtype"] == str(dtype), row
        moved = rows[0][name]["moved"]
        assert rows[1][name]["moved"] == moved
        assert rows[1][name]["built"] == (new.world_size == 2)
        if "lost" in name:
            assert moved["checkpoint"] > 0 and moved["sent"] == 0, moved
        else:
            assert moved["checkpoint"] == 0 and moved["sent"] > 0, moved
    for r in range(2):  # the rank that lacks the checkpoint (0) and the one that does not (1) both refuse
        errors = rows[r]["errors"]
        assert "was given no checkpoint" in errors["no checkpoint"], errors
        assert "the checkpoint holds optimizer step 2, the survivors step 3" in errors["step mismatch"], errors
