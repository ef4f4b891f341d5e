"""Analytic (roofline) layer times: one operation by hand per kind, blocks summed over their
operations, the efficiency constants of the catalog, and the attention-core share."""

import pytest

from sailor import catalog
from sailor.model.spec import Framework
from sailor.perf.roofline import Op, OpKind, attention_core_share, layer_ops, layer_times, op_time_s
from sailor.specs.job import JobSpec

A100 = catalog.gpu("A100-80")


def test_efficiencies_come_from_the_catalog():
    eff = A100.efficiency
    assert (eff.matmul, eff.memory, eff.attention, eff.intra_node) == (0.869, 0.88, 0.50, 0.65)
    assert catalog.gpu("H100-80").efficiency.attention == 0.35
    assert catalog.gpu("V100-16").efficiency.matmul == 0.80  # no measurement: the documented default


def test_one_operation_by_hand():
    big = Op("gemm", OpKind.MATMUL, 2 * 8192**3, 2 * 3 * 8192**2)
    assert op_time_s(big, A100, "bf16") == pytest.approx(2 * 8192**3 / (312e12 * 0.869))  # compute-bound
    thin = Op("gemv", OpKind.MATMUL, 2 * 8192**2, 2 * 8192**2)
    assert op_time_s(thin, A100, "bf16") == pytest.approx(2 * 8192**2 / (2039e9 * 0.88))  # memory-bound
    assert op_time_s(Op("copy", OpKind.MEMORY, 0, 1e9), A100, "bf16") == pytest.approx(1e9 / (2039e9 * 0.88))
    flash = Op("sdpa", OpKind.ATTENTION, 1e12, 1e6)
    assert op_time_s(flash, A100, "bf16") == pytest.approx(1e12 / (312e12 * 0.50))
    assert op_time_s(big, A100, "fp32") == pytest.approx(2 * 8192**3 / (19.5e12 * 0.869))  # no TF32


def test_block_is_the_sum_of_its_operations_and_keeps_the_model_flops():
    for framework in Framework:
        job = JobSpec(model="gpt3-175b", global_batch_size=8, precision="bf16", framework=framework)
        fwd, bwd = layer_ops(job, 3, 8, 1)
        matmul = sum(op.flop for op in fwd if op.kind is OpKind.MATMUL)
        attention = sum(op.flop for op in fwd if op.kind is OpKind.ATTENTION)
        model = job.model.forward_flop(3, tp=8, mbs=1, seq=2048)
        if framework is Framework.MEGATRON:  # every FLOP of the model is a GEMM
            assert matmul == pytest.approx(model)
        else:  # the causal flash kernel skips half of QKᵀ and attention·V (4·b·s²·h/t)
            assert matmul + 2 * attention == pytest.approx(model)
        t = layer_times(job, "A100-80", 8, 1)
        assert t[3, 0] == pytest.approx(sum(op_time_s(op, A100, "bf16") for op in fwd))
        assert t[3, 1] == pytest.approx(sum(op_time_s(op, A100, "bf16") for op in bwd))
        assert (t[1:-1] == t[3]).all()  # every block alike


def test_megatron_attention_scores_are_memory_bound_and_its_core_costs_more_than_sdpa():
    meg = JobSpec(model="opt-350m", global_batch_size=8, precision="fp16", framework="megatron-lm")
    fwd, _ = layer_ops(meg, 1, 1, 1)
    softmax = next(op for op in fwd if op.name == "softmax")
    assert softmax.bytes == 2 * 2 * 16 * 2048 * 2048  # read and write 16 x 2048² fp16 scores
    sailor = JobSpec(model="opt-350m", global_batch_size=8, precision="fp16")
    assert attention_core_share(meg, "A100-80", 1, 1) > attention_core_share(sailor, "A100-80", 1, 1) > 0


def test_larger_micro_batches_and_tp_scale_the_compute():
    job = JobSpec(model="gpt3-175b", global_batch_size=8, precision="bf16")
    one, two = layer_times(job, "A100-80", 8, 1), layer_times(job, "A100-80", 8, 2)
    assert two[3, 0] == pytest.approx(2 * one[3, 0], rel=0.02)  # compute-bound GEMMs scale with tokens
    assert layer_times(job, "A100-80", 4, 1)[3, 0] == pytest.approx(2 * one[3, 0], rel=0.05)
