"""The profile's whole-model pass runs the optimizer's layer hooks as a training step does
(`runtime.profile_measure.pass_optimizer`): after the pass every layer's gradients are in the
optimizer's bucket buffers, summed over the micro-batches, and the parameters hold none. In one
process (one stage, one rank: no collective, no process started)."""

from __future__ import annotations

import datetime

import pytest
import torch

from sailor.plan.orders import ScheduleKind
from sailor.plan.spec import Pipeline, Plan, Replica, Schedule
from sailor.runtime.buckets import flatten
from sailor.runtime.executor import StageExecutor
from sailor.runtime.pipeline import P2P, run_pipeline
from sailor.runtime.profile_measure import _build_layer, pass_optimizer
from sailor.runtime.tensor_parallel import head_loss
from sailor.runtime.topology import derive_topology
from sailor.specs.job import JobSpec

JOB = JobSpec(model="tiny", global_batch_size=8)
CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", [ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB_H1])
def test_the_whole_pass_leaves_the_gradient_sum_in_the_buffers(kind):
    spec, seq, m, mbs = JOB.model, JOB.seq, 3, 2
    tok = torch.randint(0, spec.vocab_size, (m * mbs, seq + 1), generator=torch.Generator().manual_seed(5))
    scale = 1.0 / (m * mbs * seq)
    ref = _build_layer(JOB, 0, 0, 1, None, CPU, spec.num_layers)
    for k in range(m):  # plain autograd: the gradients accumulate in .grad over the micro-batches
        x = tok[k * mbs:(k + 1) * mbs]
        (head_loss(ref)(ref(x[:, :-1]), x[:, 1:]) * scale).backward()

    model = _build_layer(JOB, 0, 0, 1, None, CPU, spec.num_layers)
    pipe = Pipeline(microbatches=m, replicas=(Replica(stage=0, gpu="cpu", zone="profile", tp=1),))
    role = derive_topology(Plan(micro_batch_size=mbs, stages=((0, spec.num_layers),), pipelines=(pipe,))).roles[0]
    order = Schedule(kind=kind).order(0, 1, m)
    opt = pass_optimizer(model, role, order)
    p2p = P2P(role, shape=(mbs, seq, spec.hidden_size), device=CPU, timeout=datetime.timedelta(seconds=10))
    run_pipeline([StageExecutor(model, opt, first_stage=True)], role, p2p, order=order, inputs=lambda k: tok[k * mbs:(k + 1) * mbs, :-1],
                 targets=lambda k: tok[k * mbs:(k + 1) * mbs, 1:], loss_fn=head_loss(model), loss_scale=scale)
    assert all(p.grad is None for p in model.parameters())  # the hooks took each layer's gradients
    opt.reduce()  # a group of one rank: nothing to wait for; the buffers are the step's gradients
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert opt.buckets
    for b, got in zip(opt.buckets, opt.grad):
        torch.testing.assert_close(got, flatten(b, want, dtype=torch.float32, device=CPU, padded=True),
                                   rtol=1e-5, atol=1e-7)


def test_the_profile_times_the_pass_with_the_hooks():
    # `_time_pipeline` (what `sailor profile` times on CPU) runs the hooks: no gradient is left in the
    # parameters (without the hooks autograd leaves every one there), and one row per timed repeat,
    # WHOLE_PASS_REPEATS of them per repeat of a layer
    from sailor.runtime.profile_measure import WHOLE_PASS_REPEATS, _nullcontext, _time_pipeline

    model = _build_layer(JOB, 0, 0, 1, None, CPU, JOB.model.num_layers)
    o = {"gpu": "cpu", "warmup": 1, "repeats": 2, "timeout_s": 10}
    rows = _time_pipeline(model, JOB, o, 0, 1, 1, 1, CPU, _nullcontext, lambda: None, Schedule())
    assert len(rows) == 2 * WHOLE_PASS_REPEATS and all(len(r) == 4 and r[0] > 0 and r[1] > 0 for r in rows)
    assert all(p.grad is None for p in model.parameters())
