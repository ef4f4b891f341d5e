"""The runtime's memory options without torchrun: saved activations against `sailor.model.activations.stage_activation_bytes`
(one process), bytes held by the sharded optimizer in fp32 and bf16 against the ZeRO / Megatron rules
(two gloo processes on CPU), the bucket layout of a mixed-TP plan by hand, and the refusals of
`runtime.validate`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from spawn import spawn

from sailor.core.errors import SailorInputError
from sailor.model.activations import stage_activation_bytes
from sailor.plan.spec import Plan, StageMemory
from sailor.runtime.buckets import build_buckets
from sailor.runtime.data import batch_tokens, load_corpus
from sailor.runtime.executor import ActivationMeter
from sailor.runtime.model import GPT, lm_loss_sum
from sailor.runtime.pipeline import build_stage
from sailor.runtime.prepare import TrainOptions, prepare
from sailor.runtime.reference import train_reference
from sailor.runtime.tensor_parallel import apply_tp
from sailor.runtime.topology import derive_topology
from sailor.runtime.worker import build_rank
from sailor.specs.job import JobSpec

TINY = JobSpec(model="tiny", global_batch_size=8)
# Rotary positions, RMSNorm, grouped-query attention, SwiGLU, no biases: the Llama-style branches.
LLAMAISH = JobSpec(model={"name": "llamaish", "num_blocks": 3, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
                          "ffn_hidden_size": 96, "vocab_size": 256, "max_sequence_length": 32, "gated_mlp": True,
                          "learned_positions": False, "bias": False, "rms_norm": True, "tied_embeddings": False},
                   global_batch_size=4)
# Hugging Face variants (`sailor.model.hf_config`), with a vocabulary of 300 that the runtime pads to 384 and
# whose padding logits it drops. GPT-NeoX: half the head dimensions rotate, parallel residual, biases;
# GPT-2: learned positions, tanh GELU, tied; OPT: ReLU, position offset 2; Qwen2: q, k, v biases only.
_HF = {"num_blocks": 2, "hidden_size": 64, "num_heads": 4, "vocab_size": 300, "max_sequence_length": 32}
NEOXISH = JobSpec(model={**_HF, "name": "neoxish", "learned_positions": False, "rotary_fraction": 0.5,
                         "parallel_residual": True, "ffn_hidden_size": 96, "tied_embeddings": False},
                  global_batch_size=4)
GPT2ISH = JobSpec(model={**_HF, "name": "gpt2ish", "activation": "gelu_tanh"}, global_batch_size=4)
OPTISH = JobSpec(model={**_HF, "name": "optish", "activation": "relu", "position_offset": 2, "ffn_hidden_size": 96,
                        "tied_embeddings": False}, global_batch_size=4)
QWENISH = JobSpec(model={**_HF, "name": "qwenish", "num_kv_heads": 2, "gated_mlp": True, "learned_positions": False,
                         "bias": False, "qkv_bias": True, "rms_norm": True, "ffn_hidden_size": 96, "rope_theta": 1e6},
                  global_batch_size=4)
JOBS = {"tiny": TINY, "llamaish": LLAMAISH, "neoxish": NEOXISH, "gpt2ish": GPT2ISH, "optish": OPTISH,
        "qwenish": QWENISH}
MEMORY = {"none": StageMemory(), "selective": StageMemory(recompute="selective"), "full": StageMemory(recompute="full"),
          "full_first": StageMemory(recompute="full", recompute_blocks=1)}


def _rep(stage: int, tp: int) -> dict:
    return {"stage": stage, "gpu": "cpu", "zone": "local", "tp": tp}


def _measure_stage(job: JobSpec, layers: tuple[int, int], memory: StageMemory, dtype: torch.dtype) -> dict[int, int]:
    """Micro-batch 0's kept bytes per layer of one TP-1 stage, built as the runtime builds it."""
    spec = job.model
    n = spec.num_layers
    stages = [[0, layers[0]], list(layers)] if layers[0] else [list(layers)]
    if layers[1] < n:
        stages.append([layers[1], n])
    index = stages.index(list(layers))
    plan = Plan.model_validate({"micro_batch_size": 2, "stages": stages,
                                "memory": [memory.model_dump() if i == index else {} for i in range(len(stages))],
                                "pipelines": [{"microbatches": job.global_batch_size // 2,
                                               "replicas": [_rep(i, 1) for i in range(len(stages))]}]})
    role = derive_topology(plan).roles[index]
    rk = build_rank(plan, job, role, {}, device=torch.device("cpu"), seed=0, dtype=dtype)
    tok = torch.from_numpy(batch_tokens(load_corpus(), seed=0, step=0, first=0, count=2, seq=job.seq))
    x = tok[:, :-1].contiguous() if role.is_first_stage else torch.randn(2, job.seq, spec.hidden_size, dtype=dtype)
    meter = ActivationMeter()
    targets = tok[:, 1:].contiguous()
    out = rk.executors[0].forward(0, x, loss=(lambda y: lm_loss_sum(y, targets) * 0.5) if role.is_last_stage else None,
                              meter=meter)
    rk.executors[0].backward(0, None if role.is_last_stage else torch.ones_like(out))  # recomputation runs
    return meter.per_layer


@pytest.mark.parametrize("name", list(JOBS))
@pytest.mark.parametrize("option", list(MEMORY))
def test_saved_activations_equal_the_runtime_formula(name, option):
    job = JOBS[name]
    n = job.model.num_layers
    for layers in [(0, n), (0, 2), (2, n)]:  # whole model; a stage ending and one starting with a block
        got = _measure_stage(job, layers, MEMORY[option], torch.float32)
        want = stage_activation_bytes(job.model, layers, MEMORY[option], mbs=2, seq=job.seq, tp=1, elem_bytes=4)
        assert got == want, (layers, got, want)


@pytest.mark.parametrize("option", ["none", "selective", "full"])
def test_saved_activations_in_bf16_on_cpu(option):
    # On CPU LayerNorm keeps its statistics in the input dtype (stats_bytes = 2); SDPA's
    # log-sum-exp and the loss stay fp32.
    n = TINY.model.num_layers
    got = _measure_stage(TINY, (0, n), MEMORY[option], torch.bfloat16)
    assert got == stage_activation_bytes(TINY.model, (0, n), MEMORY[option], mbs=2, seq=TINY.seq, tp=1, elem_bytes=2)


def test_recomputation_cuts_what_a_block_keeps():
    n = TINY.model.num_layers
    kept = {o: sum(_measure_stage(TINY, (0, n), MEMORY[o], torch.float32).values()) for o in ("none", "selective", "full")}
    assert kept["full"] < kept["selective"] < kept["none"]
    # full: a block keeps its (2, 64, 64) fp32 input only
    per_block = _measure_stage(TINY, (0, n), MEMORY["full"], torch.float32)
    assert [per_block[i] for i in range(1, n - 1)] == [2 * 64 * 64 * 4] * TINY.model.num_blocks


PLAN_C = {"micro_batch_size": 2, "stages": [[0, 3], [3, 6]],
          "pipelines": [{"microbatches": 3, "replicas": [_rep(0, 2), _rep(1, 1)]},
                        {"microbatches": 1, "replicas": [_rep(0, 1), _rep(1, 2)]}]}


def test_buckets_of_a_mixed_tp_rank_by_hand():
    # Rank 3 is stage 0 of pipeline 1 at TP 1; pipeline 0 holds stage 0 at TP 2 (ranks 0, 1), so each
    # sharded parameter is two blocks: block 0 with rank 0, block 1 with rank 1; replicated ones
    # with the whole stage (0, 1, 3).
    plan = Plan.model_validate(PLAN_C)
    role = derive_topology(plan).roles[3]
    with torch.device("meta"):
        stage = build_stage(GPT(TINY.model), role.chunks)
    buckets = build_buckets(dict(stage.named_parameters()), role, zero=1, sequence_parallel=False)
    layer1 = [b for b in buckets if b.layer == 1]
    assert [b.ranks for b in layer1] == [(0, 3), (1, 3), (0, 1, 3)]
    h, f = 64, 256
    half = (3 * h * h + h * h + 2 * h * f) // 2 + (3 * h + f) // 2  # q,k,v,o,fc1,fc2 weights; q,k,v,fc1 biases
    assert [b.numel for b in layer1] == [half, half, 4 * h + 2 * h]  # norms (2 x 2h), o and fc2 biases
    q = layer1[0].pieces[0]
    assert (q.name, q.dim, q.start, q.width) == ("layers.1.attn.q.weight", 0, 0, 32)
    assert layer1[1].pieces[0].start == 32 and layer1[0].decay_numel == (3 * h * h + h * h + 2 * h * f) // 2
    # ZeRO-1: rank 3 is member 1 of (0, 3) and (1, 3), member 2 of (0, 1, 3)
    assert (layer1[0].lo, layer1[0].hi) == (math.ceil(half / 2), half)
    assert (layer1[2].lo, layer1[2].hi) == (2 * 128, 384)
    assert buckets == sorted(buckets, key=lambda b: (b.layer, len(b.ranks), b.ranks))
    # Under sequence parallelism a norm's gradient is a partial sum: weight 1, not 1 / tp.
    role0 = derive_topology(plan).roles[0]
    with torch.device("meta"):
        stage0 = apply_tp(build_stage(GPT(TINY.model), role0.chunks), tp_rank=0, tp=2, group=None)
    for sp, w in ((False, 0.5), (True, 1.0)):
        b = [b for b in build_buckets(dict(stage0.named_parameters()), role0, zero=0, sequence_parallel=sp)
             if b.layer == 1 and len(b.ranks) == 3][0]
        assert {p.name: p.weight for p in b.pieces}["layers.1.norm1.weight"] == w


# ---- bytes held by the sharded optimizer: two gloo processes --------------------------------------
TWO_PIPELINES = {"micro_batch_size": 2, "stages": [[0, 6]],
                 "pipelines": [{"microbatches": 2, "replicas": [_rep(0, 1)]},
                               {"microbatches": 2, "replicas": [_rep(0, 1)]}]}


def _held_bytes_rank(rank: int, store: str, out: str) -> None:
    """One rank: for each ZeRO stage and dtype, one training step of the tiny model on a 2-pipeline
    plan; records the bytes held after the backward and the step's loss."""
    import datetime

    import torch.distributed as dist

    from sailor.runtime.groups import create_groups
    from sailor.runtime.pipeline import P2P, run_pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for zero in range(4):
            plan = Plan.model_validate({**TWO_PIPELINES, "memory": [{"zero": zero}]})
            topo = derive_topology(plan)
            role = topo.roles[rank]
            groups = create_groups(topo, datetime.timedelta(seconds=60))
            rk = build_rank(plan, TINY, role, groups, device=torch.device("cpu"), seed=0, dtype=dtype)
            tok = torch.from_numpy(batch_tokens(load_corpus(), seed=0, step=0, first=role.first_sample, count=4,
                                                seq=TINY.seq))
            p2p = P2P(role, shape=(2, TINY.seq, 64), device=torch.device("cpu"), timeout=datetime.timedelta(seconds=60))
            loss_sum, _ = run_pipeline(rk.executors, role, p2p, order=rk.order,
                                       inputs=lambda k: tok[2 * k:2 * k + 2, :-1].contiguous(),
                                       targets=lambda k: tok[2 * k:2 * k + 2, 1:].contiguous(), loss_fn=lm_loss_sum,
                                       loss_scale=1.0 / (8 * TINY.seq))
            held = rk.optimizer.held_bytes()
            rk.optimizer.reduce()
            after = rk.optimizer.held_bytes()  # the reduction made no second copy of the gradients
            assert after == held, (zero, dtype, held, after)
            rk.optimizer.clip(1.0)
            rk.optimizer.step()
            total = loss_sum.reshape(1).clone()  # fp64 on the device (`run_pipeline`)
            dist.all_reduce(total)
            weights = sum(float(t["param"].double().sum()) for t in rk.optimizer.full_state().values())
            rows.append({"dtype": str(dtype), "zero": zero, **held, "loss": total.item() / (8 * TINY.seq),
                         "weights": weights})
    Path(out).joinpath(f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def test_held_bytes_follow_the_zero_and_mixed_precision_rules(tmp_path):
    spawn(_held_bytes_rank, 2, str(tmp_path / "store"), str(tmp_path))
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    spec = TINY.model
    per_layer = [spec.params(i, 1) for i in range(spec.num_layers)]  # one bucket per layer, group of 2
    P = sum(per_layer)
    own = sum(math.ceil(n / 2) for n in per_layer)  # elements of each rank's shards (ZeRO >= 1)
    # (params, grads, optimizer) bytes: fp32 weights are the master; bf16 keeps an fp32 master and
    # fp32 gradients (the buffers): 18 bytes/param, or 6 + 12/d (Megatron-LM distributed optimizer).
    # ZeRO-1's gradient buffers are padded to 2 shards (2 * own elements).
    want = {("torch.float32", 0): (4 * P, 4 * P, 8 * P), ("torch.float32", 1): (4 * P, 8 * own, 8 * own),
            ("torch.float32", 2): (4 * P, 4 * own, 8 * own), ("torch.float32", 3): (4 * own, 4 * own, 8 * own),
            ("torch.bfloat16", 0): (2 * P, 4 * P, 12 * P), ("torch.bfloat16", 1): (2 * P, 8 * own, 12 * own),
            ("torch.bfloat16", 2): (2 * P, 4 * own, 12 * own), ("torch.bfloat16", 3): (0, 4 * own, 12 * own)}
    for rank_rows in rows:
        for r in rank_rows:
            assert (r["params"], r["grads"], r["optimizer"]) == want[(r["dtype"], r["zero"])], r
    assert sum(want[("torch.bfloat16", 0)]) == 18 * P
    ref, _ = train_reference(TINY, steps=1, seed=0, corpus=load_corpus())
    fp32 = [r for r in rows[0] if r["dtype"] == "torch.float32"]
    for r in fp32:  # every ZeRO stage gives the reference loss, and the same weights after the step
        assert r["loss"] == pytest.approx(ref[0], rel=1e-5)
        assert r["weights"] == pytest.approx(fp32[0]["weights"], rel=1e-5)
    for r in rows[0]:
        if r["dtype"] == "torch.bfloat16":
            assert r["loss"] == pytest.approx(ref[0], rel=2e-2)
    for a, b in zip(rows[0], rows[1]):  # the two data-parallel ranks end the step with the same weights
        assert a["weights"] == b["weights"]


# ---- refused before any process starts ------------------------------------------------------------
@pytest.mark.parametrize("stages, memory, job, field, message", [
    ([[0, 1], [1, 6]], [{"sequence_parallel": True}, {}], {}, "memory.0.sequence_parallel", "holds no transformer block"),
    ([[0, 1], [1, 6]], [{"recompute": "selective"}, {}], {}, "memory.0.recompute", "holds no transformer block"),
    ([[0, 3], [3, 6]], [{"sequence_parallel": True}, {}], {"sequence_length": 63}, "memory.0.sequence_parallel",
     "63 tokens do not divide by TP 2"),
    ([[0, 3], [3, 6]], [{}, {"sequence_parallel": True}], {}, "memory.1.sequence_parallel", "needs TP > 1"),
])
def test_runtime_refuses_what_it_cannot_execute(stages, memory, job, field, message, tmp_path):
    pipes = [{"microbatches": 4, "replicas": [_rep(0, 2), _rep(1, 1)]}]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"micro_batch_size": 2, "stages": stages, "memory": memory, "pipelines": pipes,
                                "job": {"model": "tiny", "global_batch_size": 8, **job}}))
    with pytest.raises(SailorInputError) as e:
        prepare(TrainOptions(plan=str(path), steps=2, device="cpu"))
    line = str(e.value)  # what `sailor train` prints (exit 2)
    assert line.startswith(f"{path}: {field}: ") and message in line and "\n" not in line, line

