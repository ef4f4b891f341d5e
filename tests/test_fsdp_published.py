"""benchmarks/fsdp_published.py: its model specs and plans say what the published runs ran."""


import pytest
from benchmark_module import load_benchmark


def _module():
    return load_benchmark("fsdp_published")


def test_mpt_specs_have_the_published_parameter_counts():
    """llm-foundry's table lists NumParams per row; the seq-2048 count of every size is reproduced exactly."""
    mod = _module()
    for size, (_, _, _, published) in mod.MPT_SIZES.items():
        assert mod.mpt_model(size).model_params() == published, size


@pytest.mark.parametrize("name, params", [
    ("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496),
    ("llama-2-13b", 13_015_864_320), ("llama-2-70b", 68_976_648_192)])
def test_llama_specs_have_the_checkpoints_parameter_counts(name, params):
    """Meta's checkpoints as Hugging Face transformers counts them (`num_parameters()`)."""
    assert _module().llama_model(name).model_params() == params


def test_llama_3_8b_spec_is_the_built_in_one():
    from sailor.model.registry import get_model

    built_in = get_model("llama-3-8b")
    mine = _module().llama_model("llama-3-8b")
    assert [mine.params(i) for i in range(mine.num_layers)] == [built_in.params(i) for i in range(built_in.num_layers)]


def test_fsdp_plan_is_one_zero3_stage_per_gpu_with_the_row_batch():
    mod = _module()
    model = mod.mpt_model("7b")
    plan = mod.fsdp_plan(model, "A100-40", 16, 12, 4, None)
    assert plan.stages == ((0, model.num_layers),) and plan.world_size == 16
    assert all(p.microbatches == 4 and [r.tp for r in p.replicas] == [1] for p in plan.pipelines)
    mem = plan.stage_memory(0)
    assert (mem.zero, mem.recompute.value, mem.recompute_blocks) == (3, "none", None)
    assert plan.micro_batch_size * 4 * 16 == 768


def test_activation_checkpointing_maps_to_full_recompute_of_all_or_half_the_blocks():
    mod = _module()
    model = mod.llama_model("llama-2-13b")
    full = mod.fsdp_plan(model, "A100-80", 64, 2, 1, model.num_blocks).stage_memory(0)
    half = mod.fsdp_plan(model, "A100-80", 64, 2, 1, model.num_blocks // 2).stage_memory(0)
    assert (full.recompute.value, full.recompute_blocks) == ("full", None)
    assert (half.recompute.value, half.recompute_blocks) == ("full", 20)
