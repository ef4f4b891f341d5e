"""Job and cluster specs: defaults, derived values, aliases, overrides and validation errors."""

import re

import pytest

from sailor import catalog
from sailor.catalog import LinkClass
from sailor.core.errors import SailorInputError
from sailor.model.spec import Framework
from sailor.simulator.memory import state_bytes
from sailor.specs import load_cluster, load_job
from sailor.specs.cluster import ClusterSpec, local_cluster
from sailor.specs.job import JobSpec, Optimizer


def test_job_defaults_and_derived_values():
    job = JobSpec(model="OPT-350", global_batch_size=32)
    assert job.model.name == "opt-350m"
    assert job.seq == 2048 and job.elem_bytes == 4 and job.optimizer is Optimizer.ADAM
    assert job.state_bytes_per_param == {"weights": 4, "gradients": 4, "optimizer": 8}  # fp32 Adam: 16 B
    mixed = JobSpec(model="tiny", global_batch_size=4, precision="bf16", optimizer="SGD")
    assert mixed.elem_bytes == 2 and mixed.optimizer is Optimizer.SGD

    def per_param(precision, zero=0, d=1, framework="megatron-lm"):
        job = JobSpec(model="tiny", global_batch_size=4, precision=precision, framework=framework)
        return sum(state_bytes(job.state_bytes_per_param, 1.0, zero, d).values())

    # Megatron-LM docs/source/distrib_optimizer.md: bytes per parameter without / with the distributed
    # optimizer (ZeRO-1) over d data-parallel ranks
    for precision, plain, fixed, sharded in (("fp16", 20, 4, 16), ("bf16", 18, 6, 12), ("fp32", 16, 8, 8)):
        assert per_param(precision) == plain
        for d in (2, 8, 64):
            assert per_param(precision, zero=1, d=d) == pytest.approx(fixed + sharded / d)
    # Sailor's runtime keeps fp16 gradients in fp32 (as bf16's): 2 + 4 + 12, and 6 + 12/d
    assert per_param("fp16", framework="sailor") == 18
    assert per_param("fp16", zero=1, d=8, framework="sailor") == pytest.approx(6 + 12 / 8)
    # ZeRO-2 also shards the gradients, ZeRO-3 also the weights (bf16: 2 + 4 + 12 bytes)
    assert per_param("bf16", zero=2, d=4) == pytest.approx(2 + (4 + 12) / 4)
    assert per_param("bf16", zero=3, d=4) == pytest.approx(18 / 4)


def test_job_inline_model_and_round_trip():
    arch = {"name": "mini", "num_blocks": 2, "hidden_size": 32, "num_heads": 2, "vocab_size": 100,
            "max_sequence_length": 16}
    job = JobSpec(model=arch, global_batch_size=8)
    assert job.model.num_layers == 4
    assert JobSpec.model_validate(job.to_dict()) == job
    assert JobSpec(model="tiny", global_batch_size=4).to_dict()["model"] == "tiny"


def test_job_rejects_sequence_beyond_learned_positions():
    with pytest.raises(ValueError, match="sequence_length 128 exceeds tiny's learned position table of 64"):
        JobSpec(model="tiny", global_batch_size=4, sequence_length=128)


def test_job_rejects_misspelt_field(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("model: tiny\nglobal_batch_size: 4\nprecison: bf16\n")
    with pytest.raises(SailorInputError, match=r"job\.yaml: precison: Extra inputs are not permitted"):
        load_job(p)


def test_load_job_yaml_and_json(tmp_path):
    (tmp_path / "a.yaml").write_text("model: tiny\nglobal_batch_size: 8\n")
    (tmp_path / "b.json").write_text('{"model": "tiny", "global_batch_size": 8}')
    assert load_job(tmp_path / "a.yaml") == load_job(tmp_path / "b.json")


def test_cluster_aliases_merge_and_counts():
    c = ClusterSpec(zones={"us-central1-a": {"GH-96": 4, "GH200-96": 4, "A100-40": 8}})
    assert c.available("us-central1-a", "GH200-96") == 8
    assert c.available("us-central1-b", "A100-40") == 0
    assert c.total_gpus() == 16 and c.gpu_types() == ["A100-40", "GH200-96"]


def test_cluster_prices_flat_zone_and_list():
    c = ClusterSpec(zones={"us-central1-a": {"A100-40": 8}},
                    prices={"A100-40": 2.0, "us-central1-b": {"A100-40": 1.5}})
    assert c.price("us-central1-a", "A100-40") == 2.0
    assert c.price("us-central1-b", "A100-40") == 1.5
    assert c.price("us-central1-a", "V100-16") == catalog.list_price("gcp", "V100-16")


def test_cluster_network_override_and_node_size():
    c = ClusterSpec(zones={"us-central1-a": {"A100-40": 8}}, gpus_per_node={"A100-40": 4},
                    network={"same_zone": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 5e9}})
    assert c.link(LinkClass.SAME_ZONE).bandwidth_bytes_per_s == 5e9
    assert c.link(LinkClass.SAME_REGION) == catalog.provider("gcp").links[LinkClass.SAME_REGION]
    assert c.node_size("A100-40") == 4 and c.node_size("V100-16") == 8


def test_with_zones_validates_again():
    c = ClusterSpec(zones={"us-central1-a": {"A100-40": 8}})
    assert c.with_zones({"us-west1-b": {"V100-16": 2}}).available("us-west1-b", "V100-16") == 2
    with pytest.raises(ValueError, match="unknown gcp zone 'mars'"):
        c.with_zones({"mars": {"V100-16": 2}})


def test_local_cluster():
    c = local_cluster(4)
    assert c.provider == "local" and c.available("local", "cpu") == 4 and c.node_size("cpu") == 4
    assert c.price("local", "cpu") == 0.0


@pytest.mark.parametrize("text, match", [
    ("zones: {us-central1-a: {A100-41: 8}}", r"zones\.us-central1-a\.A100-41: unknown GPU type 'A100-41'"),
    ("zones: {us-central1-z: {A100-40: 8}}", r"zones\.us-central1-z: unknown gcp zone"),
    ("zones: {us-central1-a: {A100-40: -1}}", r"zones\.us-central1-a\.A100-40: GPU count must be a whole number >= 0"),
    ("zones: {us-central1-a: {A100-40: 1.5}}", r"zones\.us-central1-a\.A100-40: GPU count must be a whole number"),
    ("zones: {us-central1-a: {A100-40: 8}}\nprices: {A100-40: -2}", r"prices\.A100-40: Input should be greater than or equal to 0 \(got -2\)"),
    ("zones: {us-central1-a: {A100-40: 8}}\ngpus_per_node: {A100-40: 0}", r"gpus_per_node\.A100-40: Input should be greater than 0 \(got 0\)"),
    ("zones: {us-central1-a: {A100-40: 8}}\nnetwork: {same_zone: {latency_s: 0, bandwidth_bytes_per_s: 0}}",
     r"network\.same_zone\.bandwidth_bytes_per_s: Input should be greater than or equal to 1"),
    ("zones: [a, b]", r"zones: Input should be a valid dictionary"),
    # a per-zone price: the union's mapping member names the GPU type, not "should be a valid number"
    ("zones: {us-central1-a: {A100-40: 8}}\nprices: {us-central1-a: {A100-40: -1}}",
     r"prices\.us-central1-a\.A100-40: Input should be greater than or equal to 0 \(got -1\)$"),
    ("zones: {us-central1-a: {A100-40: 8}}\nprices: {us-central1-a: {A100-40: x}}",
     r"prices\.us-central1-a\.A100-40: Input should be a valid number \(got 'x'\)$"),
    ("zones: {us-central1-a: {A100-40: 8}}\nprices: {A100-40: cheap}", r"prices\.A100-40: Input should be a valid number \(got 'cheap'\)$"),
])
def test_bad_cluster_names_file_and_field(tmp_path, text, match):
    p = tmp_path / "cluster.yaml"
    p.write_text(text + "\n")
    with pytest.raises(SailorInputError, match=r"cluster\.yaml: " + match):
        load_cluster(p)


LINK = "{same_node: {latency_s: 1.0e-6, bandwidth_bytes_per_s: 1.0e11}}"


@pytest.mark.parametrize("text, line", [
    (f"zones: {{us-central1-a: {{A100-40: 8}}}}\nzone_network: {{us-central1-b: {LINK}}}",
     "zone_network.us-central1-b: the cluster offers no GPUs in zone 'us-central1-b' (its zones: us-central1-a), so"
     " these links would never be used (remove the entry, or offer GPUs there)"),
    ("zones: {us-central1-a: {A100-40: 8}}\nprices: {us-west1-b: {A100-40: 2.0}}",
     "prices.us-west1-b: the cluster offers no GPUs in zone 'us-west1-b' (its zones: us-central1-a), so these prices"
     " would never be used (remove the entry, or offer GPUs there)"),
    ("zones: {us-central1-a: {A100-40: 8, V100-16: 0}}\nprices: {us-central1-a: {V100-16: 1.0, A100-80: 2.0}}",
     "prices.us-central1-a.A100-80: the cluster offers no A100-80 in zone 'us-central1-a' (it lists A100-40, V100-16"
     " there), so this price would never be used (remove the price, or offer that GPU type there)"),
    ("zones: {us-central1-a: {A100-40: 8}}\ngpus_per_node: {A100-40: 4, A100-80: 8}",
     "gpus_per_node.A100-80: the cluster offers no A100-80 in any zone (its GPU types: A100-40), so this node size"
     " would never be used (remove the entry, or offer that GPU type in a zone)"),
])
def test_settings_for_what_the_cluster_does_not_offer_are_refused(tmp_path, text, line):
    # they were ignored without a word; a zone or GPU type listed at 0 GPUs is offered (V100-16 above)
    p = tmp_path / "cluster.yaml"
    p.write_text(text + "\n")
    with pytest.raises(SailorInputError) as e:
        load_cluster(p)
    assert str(e.value) == f"{p}: {line}"
    spec = load_cluster(p, zones_from_trace=True)  # `sailor run` and `replay`: checked against the trace
    with pytest.raises(SailorInputError) as e:
        spec.check_offered(spec.zones, by="the trace t.json")
    assert str(e.value) == line.replace("the cluster", "the trace t.json")
    spec.check_offered({"us-central1-a": {"A100-40": 0, "V100-16": 3, "A100-80": 0}, "us-central1-b": {},
                        "us-west1-b": {"A100-40": 1}})  # a trace that offers them all


def test_bad_yaml_names_line(tmp_path):
    p = tmp_path / "cluster.yaml"
    p.write_text("zones:\n  us-central1-a: {A100-40: 8\n")
    with pytest.raises(SailorInputError, match=r"cluster\.yaml: invalid YAML at line \d+"):
        load_cluster(p)


def test_job_framework_field():
    job = JobSpec(model="tiny", global_batch_size=4)
    assert job.framework is Framework.SAILOR and "framework" not in job.to_dict()  # old job files read the same
    meg = JobSpec(model="tiny", global_batch_size=4, framework="Megatron-LM")
    assert meg.framework is Framework.MEGATRON and JobSpec.model_validate(meg.to_dict()) == meg
    ds = JobSpec(model="tiny", global_batch_size=4, framework="deepspeed")  # the public Sailor runs' engine
    assert ds.framework is Framework.DEEPSPEED and JobSpec.model_validate(ds.to_dict()) == ds
    with pytest.raises(ValueError, match="framework"):
        JobSpec(model="tiny", global_batch_size=4, framework="colossal-ai")


@pytest.mark.parametrize("count, shown", [("010", "010 reads as 8 (a YAML 1.1 octal number)"),
                                          ("1:30", "1:30 reads as 90 (a YAML 1.1 base-60 number)")])
def test_yaml11_only_numbers_are_refused_not_reread(tmp_path, count, shown):
    """A GPU count of `010` or `1:30` is not silently 8 or 90 GPUs; quoted, it is a string."""
    p = tmp_path / "cluster.yaml"
    p.write_text(f"zones:\n  us-central1-a: {{A100-40: {count}}}\n")
    with pytest.raises(SailorInputError, match=r"cluster\.yaml: zones\.us-central1-a\.A100-40: " + re.escape(shown)):
        load_cluster(p)
    p.write_text("zones: {us-central1-a: {A100-40: 10}}\nprices: {A100-40: 1.5e0}\n")
    assert load_cluster(p).price("us-central1-a", "A100-40") == 1.5
