"""benchmarks/moe.py: the published MoE rows as plans (Megatron's layer split and rank order), the
published figures they are scored against, and the catalog entries and built-in they need."""

import pytest
from benchmark_module import load_benchmark

from sailor import catalog
from sailor.model.registry import BUILTIN_MODELS
from sailor.simulator import placed_slots
from sailor.specs.job import JobSpec

moe = load_benchmark("moe")


def test_the_embedding_and_loss_take_a_layers_place_when_the_recipe_says_so():
    qwen = BUILTIN_MODELS["qwen3-235b-a22b"]  # 94 blocks: 96 layers with the embedding and the head
    for chunks, per in ((48, 2), (24, 4)):  # GB300: PP 4 x VP 12; GB200: PP 8 x VP 3
        cut = moe.megatron_chunks(qwen, chunks, split_embedding_loss=True)
        assert [e - a for a, e in cut] == [per] * chunks
        assert cut[0][0] == 0 and cut[-1][1] == 96
    with pytest.raises(ValueError, match="do not split"):
        moe.megatron_chunks(qwen, 48)  # 94 blocks into 48 chunks
    # without the option: 32 Mixtral blocks into 32 chunks of one, the embedding with the first
    mixtral = moe.megatron_chunks(BUILTIN_MODELS["mixtral-8x7b"], 32)
    assert mixtral[0] == [0, 2] and mixtral[1] == [2, 3] and mixtral[-1] == [32, 34]


@pytest.mark.parametrize("row", moe.ROWS, ids=lambda r: f"{r.model}-{r.gpu}")
def test_each_row_is_its_published_shape_with_every_ep_group_and_stage_on_one_node(row):
    m = BUILTIN_MODELS[row.model]
    plan = moe.plan_for(m, row)
    cluster = moe.node_cluster(row.gpu, row.gpus, row.node, row.nic_bytes_per_s, price=0.0)
    plan.check_against(JobSpec(model=m, global_batch_size=row.gbs, sequence_length=row.seq, precision="bf16"),
                       cluster)
    dp = row.gpus // (row.tp * row.pp)
    assert len(plan.pipelines) == dp and sum(r.tp for p in plan.pipelines for r in p.replicas) == row.gpus
    assert all(p.microbatches * row.mbs * dp == row.gbs for p in plan.pipelines)
    slots = placed_slots(plan, cluster)
    for stage in range(row.pp):  # Megatron's rank order: stage i of consecutive DP ranks share a node
        nodes = [slots[j][stage].node for j in range(dp)]
        groups = [set(nodes[g:g + row.ep]) for g in range(0, dp, row.ep)]
        assert all(len(g) == 1 for g in groups), (stage, groups)
        assert all(slots[j][stage].gpu == row.gpu for j in range(dp))


def test_published_figures_and_their_conversion():
    mixtral, gb300, gb200 = moe.ROWS
    # Megatron-Core publishes TFLOP/s only: tokens/s by its FLOP count (module docstring)
    flop = moe.megatron_flop_per_token(BUILTIN_MODELS["mixtral-8x7b"], 4096)
    assert moe.published_tokens(mixtral) == pytest.approx(468e12 / flop)
    # Megatron-Bridge publishes tokens/s/GPU: taken as is. Its TFLOP/s over its tokens/s is the
    # Qwen3-235B-A22B's FLOPs per token: 6 per active parameter but the embedding's, plus causal
    # attention 3 x 2·s·(a·d) per block (forward and backward; QK and AV halved by the mask)
    assert (moe.published_tokens(gb300), moe.published_tokens(gb200)) == (6131.0, 4916.0)
    m = BUILTIN_MODELS["qwen3-235b-a22b"]
    ours = 6 * (m.active_params() - m.vocab_size * m.hidden_size) + 3 * 2 * 4096 * 64 * 128 * m.num_blocks
    for row in (gb300, gb200):
        assert moe.flop_per_token(row) == pytest.approx(ours, rel=0.005)
    assert (gb300.gpu, gb200.gpu) == (catalog.canonical_gpu("GB300"), catalog.canonical_gpu("GB200"))
