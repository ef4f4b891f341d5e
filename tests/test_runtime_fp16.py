"""fp16 mixed precision with dynamic loss scaling (`runtime.scaler`), the vocab-parallel cross
entropy (`runtime.tensor_parallel`), and the refusal of bf16 before Ampere.

Tolerance for fp16 against fp32: 1e-2 relative on the loss. fp16 keeps an 11-bit significand
(relative rounding 2^-11 ≈ 4.9e-4 per operation); Micikevicius et al. 2018 ("Mixed Precision
Training", ICLR) call fp16 training with fp32 master weights and loss scaling matched when its
curves stay within run-to-run noise of fp32, which for language models is well above 1e-2 of the
loss. The measured gaps (printed by the tests) are far below it.
"""

from __future__ import annotations

import itertools
import json
import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from spawn import spawn

from sailor.core.errors import SailorInputError
from sailor.model.activations import stage_activation_bytes
from sailor.plan.spec import Plan, StageMemory
from sailor.runtime.data import batch_tokens, load_corpus
from sailor.runtime.executor import ActivationMeter
from sailor.runtime.model import GPT, init_full_model, init_param, lm_loss_sum
from sailor.runtime.pipeline import P2P, build_stage, run_pipeline
from sailor.runtime.reference import train_reference
from sailor.runtime.scaler import LossScaler, overflowed
from sailor.runtime.tensor_parallel import (
    _shard_grad,
    _shard_max,
    _shard_sums,
    _shard_targets,
    apply_tp,
    head_loss,
    materialize_shards,
    shard,
    vocab_parallel_loss_sum,
)
from sailor.runtime.topology import derive_topology
from sailor.runtime.validate import check_device_precision
from sailor.runtime.worker import build_rank, train_step
from sailor.specs.job import JobSpec

TINY = JobSpec(model="tiny", global_batch_size=8)
LLAMAISH = JobSpec(model={"name": "llamaish", "num_blocks": 3, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
                          "ffn_hidden_size": 96, "vocab_size": 256, "max_sequence_length": 32, "gated_mlp": True,
                          "learned_positions": False, "bias": False, "rms_norm": True, "tied_embeddings": False},
                   global_batch_size=4)
PADDED = {"name": "padded", "num_blocks": 1, "hidden_size": 32, "num_heads": 2, "vocab_size": 300,
          "max_sequence_length": 16}  # vocabulary 300, padded to 384
FP16_RTOL = 1e-2


# ---- the scaler ---------------------------------------------------------------------------------
def test_scaler_defaults_are_megatron_lms():
    s = LossScaler()
    assert (s.scale, s.growth, s.backoff, s.growth_interval, s.min_scale) == (2.0 ** 32, 2.0, 0.5, 1000, 1.0)


def test_overflow_halves_the_scale_and_clean_steps_grow_it():
    s = LossScaler(scale=8.0, growth_interval=3)
    s.update(overflow=True)
    assert (s.scale, s.skipped, s.clean_steps) == (4.0, 1, 0)
    s.update(False)
    s.update(False)
    assert s.scale == 4.0  # two clean steps: not yet
    s.update(False)
    assert (s.scale, s.clean_steps) == (8.0, 0)  # the third: doubled
    s.update(False)
    s.update(True)  # an overflow restarts the count
    s.update(False)
    s.update(False)
    assert (s.scale, s.skipped) == (4.0, 2)
    low = LossScaler(scale=1.5, min_scale=1.0)
    low.update(True)
    low.update(True)
    assert low.scale == 1.0  # never below min_scale


def test_scaler_state_round_trips_as_json():
    s = LossScaler(scale=2.0 ** 17, growth_interval=3)
    s.update(True)
    s.update(False)
    state = json.loads(json.dumps(s.state_dict()))  # as the manifest keeps it
    back = LossScaler(**state)
    assert (back.scale, back.clean_steps, back.skipped) == (2.0 ** 16, 1, 1)


@pytest.mark.parametrize("kw", [{"scale": 0.0}, {"growth": 1.0}, {"backoff": 1.0}, {"growth_interval": 0},
                                {"scale": 0.5, "min_scale": 1.0}])
def test_bad_scaler_settings_are_refused(kw):
    with pytest.raises(ValueError):
        LossScaler(**kw)


def test_overflow_is_a_non_finite_norm():
    assert overflowed(math.inf) and overflowed(math.nan) and not overflowed(3.0e38)


# ---- bf16 before Ampere ------------------------------------------------------------------------------
def test_bf16_is_refused_before_ampere_in_one_line():
    with pytest.raises(SailorInputError) as e:
        check_device_precision("bf16", (7, 0), device_name="Tesla V100-SXM2-16GB")
    line = str(e.value)
    assert "V100" in line and "7.0" in line and "precision" in line and "fp16" in line and "\n" not in line
    with pytest.raises(SailorInputError):
        check_device_precision("bf16", (7, 5))  # T4
    for precision, cap in (("bf16", (8, 0)), ("bf16", (9, 0)), ("fp16", (7, 0)), ("fp32", (6, 1))):
        check_device_precision(precision, cap)  # accepted


# ---- vocab-parallel cross entropy -------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_vocab_parallel_loss_and_gradient_equal_the_plain_ones(tp):
    # tp shards of a padded vocabulary (300 real of 384: at tp 8 the last shard is padding only),
    # combined as the all-reduces combine them, against F.cross_entropy over the real logits.
    vocab, padded, n = 300, 384, 40
    g = torch.Generator().manual_seed(0)
    full = torch.randn(n, padded, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, vocab, (n,), generator=g)
    rows = padded // tp
    shards = [full[:, r * rows: r * rows + max(0, min(rows, vocab - r * rows))] for r in range(tp)]
    locals_ = [_shard_targets(targets, r * rows, s.shape[1]) for r, s in enumerate(shards)]
    m = torch.stack([_shard_max(s) for s in shards]).amax(0).double()
    both = sum(_shard_sums(s, loc, m).double() for s, loc in zip(shards, locals_))
    lse = m + both[0].log()
    loss = (lse - both[1]).sum()
    real = full[:, :vocab].clone().requires_grad_()
    want = F.cross_entropy(real, targets, reduction="sum")
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    grads = torch.cat([_shard_grad(s, lse.float(), loc).double() for s, loc in zip(shards, locals_)], dim=1)
    torch.testing.assert_close(grads, real.grad, rtol=1e-5, atol=1e-6)
    assert shards[-1].shape[1] == (0 if tp == 8 else shards[-1].shape[1])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_vocab_parallel_loss_of_one_shard_is_lm_loss_sum_with_autograd(dtype, tol):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 16, 300, generator=g).to(dtype)
    targets = torch.randint(0, 300, (2, 16), generator=g)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = vocab_parallel_loss_sum(a, targets, start=0, group=None)
    want = lm_loss_sum(b, targets)
    got.backward()
    want.backward()
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=tol)
    torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=tol, atol=tol)


def _head_stage(spec, tp_rank: int, tp: int):
    with torch.device("meta"):
        stage = build_stage(GPT(spec), [(spec.num_layers - 1, spec.num_layers)])
    apply_tp(stage, tp_rank=tp_rank, tp=tp, group=None)
    materialize_shards(stage, lambda name, dim, full: shard(init_param(name, full, seed=0, num_blocks=1), dim, tp_rank,
                                                            tp), tp=tp, device=torch.device("cpu"))
    return stage


@pytest.mark.parametrize("tp", [2, 4])
def test_head_under_tp_keeps_only_its_vocabulary_shard(tp):
    # Forward only (the loss's all-reduces are skipped with group None): what the head keeps for its
    # backward equals the runtime formula for the widest rank; the last rank's padding gives no logits.
    spec = JobSpec(model=PADDED, global_batch_size=2).model
    head = spec.num_layers - 1
    x = torch.randn(2, 16, spec.hidden_size)
    targets = torch.randint(0, spec.vocab_size, (2, 16))
    widths = []
    for r in range(tp):
        stage = _head_stage(spec, r, tp)
        meter = ActivationMeter()
        layer = stage.layers[str(head)]
        inp = x.clone().requires_grad_()
        with meter.saving(head, layer.parameters()):
            logits = layer(inp)
            out = head_loss(stage)(logits, targets) * 0.5
        meter.keep(head, inp)
        meter.keep(head, out)
        widths.append(logits.shape[-1])
        want = stage_activation_bytes(spec, (head, head + 1), StageMemory(), mbs=2, seq=16, tp=tp, elem_bytes=4)
        if r == 0:
            assert meter.per_layer == want
        else:
            assert meter.per_layer[head] <= want[head]
    assert sum(widths) == spec.vocab_size and widths[0] == 384 // tp


# ---- fp16 training against the fp32 reference ------------------------------------------------------
def _one_stage_plan(job: JobSpec, mbs: int = 2, zero: int = 0) -> Plan:
    return Plan.model_validate({"micro_batch_size": mbs, "stages": [[0, job.model.num_layers]],
                                "memory": [{"zero": zero}],
                                "pipelines": [{"microbatches": job.global_batch_size // mbs,
                                               "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}]}]})


def _train(job: JobSpec, steps: int, scaler: LossScaler, dtype=torch.float16) -> tuple[list[float], list[bool]]:
    plan = _one_stage_plan(job)
    role = derive_topology(plan).roles[0]
    cpu = torch.device("cpu")
    rk = build_rank(plan, job, role, {}, device=cpu, seed=0, dtype=dtype)
    p2p = P2P(role, shape=(2, job.seq, job.model.hidden_size), device=cpu, timeout=timedelta(seconds=10), dtype=dtype)
    corpus = load_corpus()
    losses, skipped = [], []
    for step in range(steps):
        tok = torch.from_numpy(batch_tokens(corpus, seed=0, step=step, first=0, count=job.global_batch_size,
                                            seq=job.seq))
        res = train_step(rk, role, p2p, tok, mbs=2, loss_scale=1.0 / (job.global_batch_size * job.seq), scaler=scaler)
        losses.append(res.loss_sum.item() / (job.global_batch_size * job.seq))
        skipped.append(res.skipped)
    return losses, skipped


@pytest.mark.parametrize("job", [TINY, LLAMAISH], ids=["tiny", "llamaish"])
def test_fp16_with_loss_scaling_equals_the_fp32_reference(job):
    steps = 6
    ref, _ = train_reference(job, steps=steps, seed=0, corpus=load_corpus())
    scaler = LossScaler(scale=2.0 ** 12)  # below the first overflow: every step trains
    got, skipped = _train(job, steps, scaler)
    assert not any(skipped) and scaler.scale == 2.0 ** 12
    gap = max(abs(a - b) / b for a, b in zip(got, ref))
    print(f"{job.model.name}: fp16 losses {got} / fp32 {ref}: max relative gap {gap:.2e}")
    assert gap < FP16_RTOL
    assert ref[-1] < ref[0] and got[-1] < got[0]  # both learn


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_a_skipped_step_leaves_no_trace(zero):
    # A: an overflowing step (scale 2^40) then a clean one; B: only the clean one, on the same
    # batch, from the same start. Skipping must leave nothing behind (no gradient accumulator
    # residue under ZeRO-2/3, no moment, no Adam step), so the weights end bit-identical.
    plan = _one_stage_plan(TINY, zero=zero)
    role = derive_topology(plan).roles[0]
    cpu = torch.device("cpu")
    corpus = load_corpus()
    batch = [torch.from_numpy(batch_tokens(corpus, seed=0, step=i, first=0, count=8, seq=TINY.seq)) for i in (0, 1)]
    ends = []
    for scales in ([2.0 ** 40, 2.0 ** 12], [2.0 ** 12]):
        rk = build_rank(plan, TINY, role, {}, device=cpu, seed=0, dtype=torch.float16)
        p2p = P2P(role, shape=(2, TINY.seq, 64), device=cpu, timeout=timedelta(seconds=10), dtype=torch.float16)
        skipped = []
        for i, scale in enumerate(scales):
            scaler = LossScaler(scale=scale)
            tok = batch[i + 2 - len(scales)]
            skipped.append(train_step(rk, role, p2p, tok, mbs=2, loss_scale=1.0 / (8 * TINY.seq), scaler=scaler).skipped)
        assert skipped == [True, False][2 - len(scales):] and rk.optimizer.steps == 1
        ends.append(torch.cat([m.clone() for m in rk.optimizer.master]))
    assert torch.equal(ends[0], ends[1])


def test_without_loss_scaling_fp16_flushes_small_gradients_to_zero():
    # The reason for the scaler: fp16 gradients under its smallest subnormal (2^-24 ≈ 6e-8) flush to
    # zero; the loss weight per token is 1/(B·T) = 2^-9 here. Counted: gradient elements that are
    # not 0 in fp32 but 0 in fp16 (measured: 84 at scale 1, 2 at 2^12, of 0.2 M).
    tok = torch.from_numpy(batch_tokens(load_corpus(), seed=0, step=0, first=0, count=8, seq=TINY.seq))
    grads = {}
    for dtype, scale in ((torch.float32, 1.0), (torch.float16, 1.0), (torch.float16, 2.0 ** 12)):
        plan = _one_stage_plan(TINY)
        role = derive_topology(plan).roles[0]
        rk = build_rank(plan, TINY, role, {}, device=torch.device("cpu"), seed=0, dtype=dtype)
        p2p = P2P(role, shape=(2, TINY.seq, 64), device=torch.device("cpu"), timeout=timedelta(seconds=10),
                  dtype=dtype)
        run_pipeline(rk.executors, role, p2p, order=rk.order, inputs=lambda k: tok[2 * k:2 * k + 2, :-1].contiguous(),
                     targets=lambda k: tok[2 * k:2 * k + 2, 1:].contiguous(), loss_fn=lm_loss_sum,
                     loss_scale=scale / (8 * TINY.seq))
        # ZeRO-0: every micro-batch's gradients were added into the fp32 bucket buffers (one layout
        # for every dtype), after the backward computed them in the weights' dtype.
        grads[(dtype, scale)] = torch.cat(list(rk.optimizer.grad_buffer))
    ref = grads[(torch.float32, 1.0)]
    flushed = {scale: int(((grads[(torch.float16, scale)] == 0) & (ref != 0)).sum()) for scale in (1.0, 2.0 ** 12)}
    assert flushed[1.0] > 10 * max(1, flushed[2.0 ** 12]), flushed


# ---- an actual 2-rank run: skipped steps agree on every rank -----------------------------------------
_CPU = {"gpu": "cpu", "zone": "local"}
TWO_RANK_PLANS = {  # pipeline parallel (rank 1 holds the loss), tensor parallel (vocab-parallel loss in fp16)
    "pp2": {"micro_batch_size": 2, "stages": [[0, 3], [3, 6]],
            "pipelines": [{"microbatches": 4, "replicas": [{"stage": 0, "tp": 1, **_CPU}, {"stage": 1, "tp": 1, **_CPU}]}]},
    "tp2": {"micro_batch_size": 2, "stages": [[0, 6]],
            "pipelines": [{"microbatches": 4, "replicas": [{"stage": 0, "tp": 2, **_CPU}]}]},
}
INJECT_AT = 6  # the step at which rank 0 (alone) finds an inf gradient
START_SCALE = 2.0 ** 20  # overflows the tiny model's fp16 gradients (Megatron-LM's 2^32 does for 15 steps)


def _fp16_rank(rank: int, store: str, out: str, steps: int, plan_name: str) -> None:
    import torch.distributed as dist

    from sailor.runtime.groups import create_channel_groups, create_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    plan = Plan.model_validate(TWO_RANK_PLANS[plan_name])
    topo = derive_topology(plan)
    role = topo.roles[rank]
    groups = create_groups(topo, timedelta(seconds=60))
    cpu = torch.device("cpu")
    rk = build_rank(plan, TINY, role, groups, device=cpu, seed=0, dtype=torch.float16)
    p2p = P2P(role, shape=(2, TINY.seq, 64), device=cpu, timeout=timedelta(seconds=60), dtype=torch.float16,
              channels=create_channel_groups(topo, timedelta(seconds=60)))
    scaler = LossScaler(scale=START_SCALE)
    corpus = load_corpus()
    opt = rk.optimizer
    rows = []
    initial = sum(float(p.detach().double().sum()) for p in rk.stage.parameters())

    def inject() -> None:
        opt.grad_buffer[0][0] = float("inf")  # ZeRO-0: the first bucket's fp32 gradient buffer

    for step in range(steps):
        tok = torch.from_numpy(batch_tokens(corpus, seed=0, step=step, first=0, count=8, seq=TINY.seq))
        scale = scaler.scale
        res = train_step(rk, role, p2p, tok, mbs=2, loss_scale=1.0 / (8 * TINY.seq), scaler=scaler,
                         after_backward=inject if (rank == 0 and step == INJECT_AT) else None)
        weights = sum(float(p.detach().double().sum()) for p in rk.stage.parameters())
        moments = sum(float(m.double().abs().sum()) for m in opt.exp_avg)
        rows.append({"scale": scale, "skipped": res.skipped, "adam_steps": opt.steps, "weights": weights,
                     "moments": moments, "loss": res.loss_sum.item() / (8 * TINY.seq)})
    Path(out).joinpath(f"rank{rank}.json").write_text(json.dumps({"initial": initial, "rows": rows}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.parametrize("plan_name", list(TWO_RANK_PLANS))
def test_overflowing_steps_are_skipped_on_every_rank_and_lower_the_scale(plan_name, tmp_path):
    steps = INJECT_AT + 2
    spawn(_fp16_rank, 2, str(tmp_path / "store"), str(tmp_path), steps, plan_name)
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    ranks = [run["rows"] for run in runs]
    assert [r["skipped"] for r in ranks[0]] == [r["skipped"] for r in ranks[1]]  # every rank agrees
    assert [r["scale"] for r in ranks[0]] == [r["scale"] for r in ranks[1]]
    rows = ranks[0]
    skipped = [r["skipped"] for r in rows]
    first_clean = skipped.index(False)
    # At 2^20 the gradients overflow fp16 (max 65504): the first steps are skipped, halving the
    # scale each time, until the gradients fit; then clean steps at that scale until the injection,
    # which rank 1 did not see and skips all the same.
    assert rows[0]["scale"] == START_SCALE and 1 <= first_clean < INJECT_AT - 1
    assert not any(skipped[first_clean:INJECT_AT])
    assert skipped[INJECT_AT] and not any(skipped[INJECT_AT + 1:])
    for prev, row in itertools.pairwise(rows):
        assert row["scale"] == (prev["scale"] / 2 if prev["skipped"] else prev["scale"])  # interval 1000
    for run, rank_rows in zip(runs, ranks):
        before = {"weights": run["initial"], "moments": 0.0, "adam_steps": 0}
        for i, row in enumerate(rank_rows):
            if row["skipped"]:  # nothing moved: weights, Adam moments, Adam's step count
                assert (row["weights"], row["moments"], row["adam_steps"]) == (
                    before["weights"], before["moments"], before["adam_steps"]), i
            else:
                assert row["weights"] != before["weights"] and row["adam_steps"] == before["adam_steps"] + 1, i
            before = row
    assert rows[-1]["adam_steps"] == steps - sum(skipped)
    # The first clean step starts from the initial weights: its loss is the initial model's on its
    # batch (fp32, one process), within the fp16 tolerance.
    model = init_full_model(TINY.model, 0)
    tok = torch.from_numpy(batch_tokens(load_corpus(), seed=0, step=first_clean, first=0, count=8, seq=TINY.seq))
    with torch.no_grad():
        want = lm_loss_sum(model(tok[:, :-1]), tok[:, 1:]).item() / tok[:, 1:].numel()
    assert all(math.isfinite(r["loss"]) for r in ranks[1])
    print(f"skipped steps {[i for i, s in enumerate(skipped) if s]}, scale after {rows[-1]['scale']:.0f},"
          f" first clean loss {ranks[1][first_clean]['loss']:.5f} / fp32 {want:.5f}")
    assert ranks[1][first_clean]["loss"] == pytest.approx(want, rel=FP16_RTOL)
