"""Runtime units that need no process group: topology, 1F1B order, data, sharding, checkpoints."""

from __future__ import annotations

import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sailor.core.errors import SailorInputError
from sailor.plan.orders import one_f_one_b_order
from sailor.plan.spec import Plan
from sailor.runtime import checkpoint as ckpt
from sailor.runtime.checkpoint_io import load_tensors, write_checkpoint
from sailor.runtime.data import batch_tokens, load_corpus
from sailor.runtime.model import GPT, init_full_model, init_param, on_meta
from sailor.runtime.pipeline import build_stage
from sailor.runtime.tensor_parallel import shard, shard_dim
from sailor.runtime.tied import Transfer, holdings, twin_transfers
from sailor.runtime.topology import Link, derive_topology
from sailor.runtime.validate import check_runtime_geometry
from sailor.specs.job import JobSpec


def _rep(stage: int, tp: int) -> dict:
    return {"stage": stage, "gpu": "cpu", "zone": "local", "tp": tp}


PLAN_C = Plan.model_validate({
    "micro_batch_size": 2, "stages": [[0, 3], [3, 6]],
    "pipelines": [{"microbatches": 3, "replicas": [_rep(0, 2), _rep(1, 1)]},
                  {"microbatches": 1, "replicas": [_rep(0, 1), _rep(1, 2)]}]})


def test_topology_of_mixed_tp_plan_by_hand():
    topo = derive_topology(PLAN_C)
    r = topo.roles
    # ranks: p0 s0 tp2 -> 0, 1; p0 s1 tp1 -> 2; p1 s0 tp1 -> 3; p1 s1 tp2 -> 4, 5
    assert [(x.pipeline, x.stage, x.tp_rank) for x in r] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (1, 1, 0), (1, 1, 1)]
    # scatter-gather: TP 2 -> TP 1, each sender sends its half; TP 1 -> TP 2, each receiver gets its half
    half, one = Fraction(1, 2), Fraction(1)
    assert r[0].fwd_send_to == (Link(2, 0, half),) and r[1].fwd_send_to == (Link(2, half, one),)
    assert r[2].fwd_recv_from == (Link(0, 0, half), Link(1, half, one)) == r[2].bwd_send_to
    assert r[0].bwd_recv_from == (Link(2, 0, half),) and r[1].bwd_recv_from == (Link(2, half, one),)
    assert r[3].fwd_send_to == (Link(4, 0, half), Link(5, half, one)) == r[3].bwd_recv_from
    assert r[4].fwd_recv_from == (Link(3, 0, half),) and r[5].fwd_recv_from == (Link(3, half, one),)
    assert r[4].bwd_send_to == (Link(3, 0, half),) and r[5].bwd_send_to == (Link(3, half, one),)
    # finest sharding of both stages is 2 blocks; each block group has one rank per pipeline
    assert r[0].block_groups == ((0, 3),) and r[1].block_groups == ((1, 3),)
    assert r[3].block_groups == ((0, 3), (1, 3))
    assert r[2].block_groups == ((2, 4), (2, 5)) and r[5].block_groups == ((2, 5),)
    assert r[2].stage_group == (2, 4, 5) and r[0].stage_group == (0, 1, 3)
    assert (r[0].first_sample, r[3].first_sample) == (0, 6)
    assert topo.groups() == [(0, 1), (0, 3), (1, 3), (2, 4), (2, 5), (4, 5), (0, 1, 3), (2, 4, 5)]


EMB, HEAD = "layers.0.tok.weight", "layers.5.lm.weight"  # tiny: 256 x 64 = 16384 elements


def test_tied_gradient_transfers_by_hand():
    spec = JobSpec(model="tiny", global_batch_size=8).model
    # ZeRO-0 on both ends: each pipeline swaps with itself; pipeline 0's TP-2 embedding (ranks 0, 1,
    # 8192 elements each) with its TP-1 head (rank 2), pipeline 1's TP-1 embedding (3) with its TP-2
    # head (4, 5).
    plan = PLAN_C.model_copy(update={"memory": None})
    got = twin_transfers(spec, plan, derive_topology(plan))
    assert got == [Transfer(0, EMB, 2, HEAD, 0, 8192), Transfer(1, EMB, 2, HEAD, 8192, 16384),
                   Transfer(2, HEAD, 0, EMB, 0, 8192), Transfer(2, HEAD, 1, EMB, 8192, 16384),
                   Transfer(3, EMB, 4, HEAD, 0, 8192), Transfer(3, EMB, 5, HEAD, 8192, 16384),
                   Transfer(4, HEAD, 3, EMB, 0, 8192), Transfer(5, HEAD, 3, EMB, 8192, 16384)]
    # ZeRO-1 on the embedding's stage: the group (0, 3) of rows 0-127 is split in halves, rank 0 owns
    # elements 0-4095, rank 3 4096-8191; both pipelines' heads (unsharded) receive them from there.
    plan = Plan.model_validate({**PLAN_C.model_dump(), "memory": [{"zero": 1}, {}]})
    got = twin_transfers(spec, plan, derive_topology(plan))
    assert [t for t in got if t.src == 3] == [Transfer(3, EMB, 2, HEAD, 4096, 8192), Transfer(3, EMB, 2, HEAD, 12288, 16384),
                                              Transfer(3, EMB, 4, HEAD, 4096, 8192), Transfer(3, EMB, 5, HEAD, 12288, 16384)]
    assert [t for t in got if t.dst == 3] == [Transfer(4, HEAD, 3, EMB, 4096, 8192), Transfer(5, HEAD, 3, EMB, 12288, 16384)]
    assert twin_transfers(JobSpec(model="llama-3-8b", global_batch_size=8).model, PLAN_C, derive_topology(PLAN_C)) == []


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_tied_gradient_transfers_deliver_each_held_element_once(data):
    # Any plan: every element of a copy that a rank holds after the reduction arrives exactly once,
    # from a rank holding that element of the other copy (in the receiver's pipeline when the other
    # copy's stage is unsharded), and the holders cover the matrix once (ZeRO >= 1) or once per
    # pipeline (ZeRO-0).
    spec = JobSpec(model="tiny", global_batch_size=8).model
    stages = data.draw(st.sampled_from([[[0, 6]], [[0, 3], [3, 6]], [[0, 1], [1, 5], [5, 6]]]))
    pipes = data.draw(st.integers(1, 3))
    tps = [[data.draw(st.sampled_from([1, 2, 4])) for _ in stages] for _ in range(pipes)]
    memory = [{"zero": data.draw(st.integers(0, 3))} for _ in stages]
    plan = Plan.model_validate({"micro_batch_size": 1, "stages": stages, "memory": memory, "pipelines": [
        {"microbatches": 1, "replicas": [_rep(i, t) for i, t in enumerate(row)]} for row in tps]})
    topo = derive_topology(plan)
    held = holdings(spec, topo)
    for name, stage in ((EMB, 0), (HEAD, len(stages) - 1)):
        count = np.zeros(256 * 64, dtype=int)
        for h in held:
            if h.name == name:
                count[h.lo:h.hi] += 1
        assert (count == (pipes if plan.stage_memory(stage).zero == 0 else 1)).all()
    transfers = twin_transfers(spec, plan, topo)
    for h in held:
        got = np.zeros(h.hi - h.lo, dtype=int)
        for t in transfers:
            if t.dst == h.rank and t.dst_name == h.name and h.lo <= t.lo < h.hi:
                got[t.lo - h.lo:t.hi - h.lo] += 1
                src = [x for x in held if x.rank == t.src and x.name == t.src_name and x.lo <= t.lo and t.hi <= x.hi]
                assert src and t.src_name != t.dst_name
                if plan.stage_memory(len(stages) - 1 if h.name == EMB else 0).zero == 0:
                    assert topo.roles[t.src].pipeline == topo.roles[h.rank].pipeline
        assert (got == 1).all()


def schedule_1f1b(stage: int, num_stages: int, m: int) -> list[tuple[str, int]]:
    return [(op.kind, op.micro_batch) for op in one_f_one_b_order(num_stages, stage, m)]


def test_schedule_1f1b_by_hand():
    assert schedule_1f1b(0, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert schedule_1f1b(1, 2, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    # fewer micro-batches than stages: all forwards, then all backwards
    assert schedule_1f1b(0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    for stage in range(3):
        order = schedule_1f1b(stage, 3, 5)
        assert sorted(order) == sorted([("F", k) for k in range(5)] + [("B", k) for k in range(5)])
        assert all(order.index(("F", k)) < order.index(("B", k)) for k in range(5))


def test_data_order_depends_only_on_seed_step_and_index():
    corpus = load_corpus()
    whole = batch_tokens(corpus, seed=1, step=4, first=0, count=8, seq=64)
    assert whole.shape == (8, 65) and whole.dtype == np.int64
    np.testing.assert_array_equal(batch_tokens(corpus, seed=1, step=4, first=6, count=2, seq=64), whole[6:])
    assert not np.array_equal(batch_tokens(corpus, seed=1, step=5, first=0, count=8, seq=64), whole)
    assert not np.array_equal(batch_tokens(corpus, seed=2, step=4, first=0, count=8, seq=64), whole)


def test_data_from_user_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello world " * 20)
    assert bytes(load_corpus(f)[:5]) == b"hello"
    with pytest.raises(SailorInputError, match="no such file"):
        load_corpus(tmp_path / "missing")


def test_shard_table_and_slices():
    assert shard_dim("layers.2.attn.q.weight") == 0 and shard_dim("layers.2.attn.q.bias") == 0
    assert shard_dim("layers.2.attn.o.weight") == 1 and shard_dim("layers.2.attn.o.bias") is None
    assert shard_dim("layers.0.tok.weight") == 0 and shard_dim("layers.0.pos.weight") is None
    assert shard_dim("layers.5.lm.weight") == 0 and shard_dim("layers.5.norm.weight") is None
    full = torch.arange(12.0).reshape(4, 3)
    assert torch.equal(torch.cat([shard(full, 0, t, 2) for t in range(2)]), full)
    assert shard(full, None, 1, 2) is full


def test_init_is_per_name_and_stage_keeps_global_names():
    job = JobSpec(model="tiny", global_batch_size=8)
    a = init_param("layers.3.attn.q.weight", (64, 64), seed=0, num_blocks=4)
    assert torch.equal(a, init_param("layers.3.attn.q.weight", (64, 64), seed=0, num_blocks=4))
    assert not torch.equal(a, init_param("layers.3.attn.q.weight", (64, 64), seed=1, num_blocks=4))
    assert abs(a.std().item() - 0.02) < 0.003
    stage = build_stage(GPT(job.model), ((3, 6),))
    names = [n for n, _ in stage.named_parameters()]
    assert names[0].startswith("layers.3.") and names[-1] == "layers.5.lm.weight"
    assert all(n.split(".")[1] in ("3", "4", "5") for n in names)
    full = dict(init_full_model(job.model, 0).named_parameters())
    assert torch.equal(full["layers.3.attn.q.weight"], a)


def test_on_meta_builds_the_same_shapes_and_skips_only_meta_initialisers():
    spec = JobSpec(model="tiny", global_batch_size=8).model
    with torch.device("meta"):
        plain = {n: (tuple(p.shape), p.dtype) for n, p in GPT(spec).named_parameters()}
    ran = []

    def uniform_(tensor):  # an initialiser dispatching as torch.nn.init's do, recording where it ran
        if torch.overrides.has_torch_function_variadic(tensor):
            return torch.overrides.handle_torch_function(uniform_, (tensor,), tensor)
        ran.append(tensor.device.type)
        return tensor

    with on_meta():
        built = GPT(spec)
        meta = torch.empty(4, 4)
        assert uniform_(meta) is meta
        cpu = uniform_(torch.zeros(2, device="cpu"))
        # a tensor on a real device is still initialised, exactly as outside
        drawn = torch.nn.init.normal_(torch.zeros(3, 5, device="cpu"), std=2.0,
                                      generator=torch.Generator().manual_seed(7))
    assert ran == ["cpu"] and cpu.device.type == "cpu" and meta.is_meta
    with torch.device("meta"):  # the plain meta device runs it
        uniform_(torch.empty(1))
    assert ran == ["cpu", "meta"]
    assert {n: (tuple(p.shape), p.dtype) for n, p in built.named_parameters()} == plain
    assert all(p.is_meta for p in built.parameters())
    assert torch.equal(drawn, torch.zeros(3, 5).normal_(0.0, 2.0, generator=torch.Generator().manual_seed(7)))


def test_runtime_geometry_rejects_tp_not_dividing_the_vocabulary():
    job = JobSpec(model={"name": "six", "num_blocks": 1, "hidden_size": 96, "num_heads": 6, "vocab_size": 256,
                         "max_sequence_length": 16}, global_batch_size=2)
    plan = Plan.model_validate({"micro_batch_size": 2, "stages": [[0, 3]],
                                "pipelines": [{"microbatches": 1, "replicas": [_rep(0, 3)]}]})
    plan.check_against(job)  # 3 divides the 6 heads ...
    with pytest.raises(SailorInputError, match="TP 3 does not divide the 256 padded vocabulary"):
        check_runtime_geometry(plan, job)  # ... but not the 256-row vocabulary


def _write_checkpoint(root, step: int, value: float) -> None:
    write_checkpoint(root, step, {"seed": 0, "model": {}, "global_batch_size": 8},
                     {"layers.0.tok.weight": {"param": torch.full((2, 2), value)}})


def test_checkpoint_roundtrip_and_checksum_fallback(tmp_path):
    _write_checkpoint(tmp_path, 2, 2.0)
    _write_checkpoint(tmp_path, 3, 3.0)
    found = ckpt.find_latest(tmp_path)
    assert found.path == tmp_path / "step-00000003" and found.manifest["step"] == 3 and not found.skipped
    got = load_tensors(found.path, found.manifest, ["layers.0.tok.weight"])
    assert torch.equal(got["layers.0.tok.weight"]["param"], torch.full((2, 2), 3.0))
    # flip one byte of the newest checkpoint: it is never loaded, the previous one is used instead
    f = tmp_path / "step-00000003" / "rank-00000.bin"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    found = ckpt.find_latest(tmp_path)
    assert found.path == tmp_path / "step-00000002"
    assert len(found.skipped) == 1 and "checksum mismatch" in found.skipped[0]
    with pytest.raises(ckpt.CheckpointError, match="checksum"):
        load_tensors(tmp_path / "step-00000003", ckpt.read_manifest(tmp_path / "step-00000002"),
                          ["layers.0.tok.weight"])
    # a half-written attempt (no rename yet) is invisible
    ckpt.prepare_tmp(tmp_path, 4)
    assert ckpt.find_latest(tmp_path).path == tmp_path / "step-00000002"


@pytest.mark.integration
def test_plan_level_modules_stay_torch_free():
    import subprocess
    code = ("import sys; import sailor.runtime.topology, sailor.runtime.validate, sailor.runtime.data,"
            " sailor.runtime.messages, sailor.runtime.comm_check,"
            " sailor.runtime.checkpoint, sailor.runtime.launcher, sailor.model.activations;"
            " assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("option, value, match", [
    ("data", "", "--data: is an empty path"),
    ("init_from", " ", "--init-from: is an empty path"),
    ("checkpoint_dir", "", "--checkpoint-dir: is an empty path"),
])
def test_train_refuses_an_empty_path_before_any_process(tmp_path, option, value, match):
    # "" would pass every "was it given?" check, then become the current folder on every rank
    from sailor.runtime.prepare import TrainOptions, prepare
    plan = tmp_path / "plan.json"
    Plan.model_validate({"micro_batch_size": 1, "stages": [[0, 6]], "pipelines": [{"microbatches": 8, "replicas": [
        {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}]}]}).with_specs(JobSpec(model="tiny", global_batch_size=8),
                                                                            None).save(plan)
    with pytest.raises(SailorInputError, match=match):
        prepare(TrainOptions(plan=str(plan), steps=1, **{option: value}))


def test_train_refuses_a_stop_file_that_exists_or_is_a_folder(tmp_path):
    from sailor.runtime.prepare import TrainOptions, check_train_options
    (tmp_path / "dir").mkdir()
    (tmp_path / "stop").touch()
    with pytest.raises(SailorInputError, match="exists already, so the run would stop before its first step"):
        check_train_options(TrainOptions(plan="p.json", steps=1, stop_file=str(tmp_path / "stop")))
    with pytest.raises(SailorInputError, match="exists already"):
        check_train_options(TrainOptions(plan="p.json", steps=1, stop_file=str(tmp_path / "dir")))
    check_train_options(TrainOptions(plan="p.json", steps=1, stop_file=str(tmp_path / "new")))  # not there yet: fine
