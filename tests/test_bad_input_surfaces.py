"""Bad input on the newest surfaces, as a newcomer met it: `profile network --hosts`, `testbed
profile`, `run` and `train` output options, `launch` of a local plan to a cloud backend. Each case
ends in exit status 2 and one line naming the option or file (or, for a failed measurement, exit 1
and its one line), before any work starts. Commands run in-process through `sailor.cli.main`
(helpers from tests/test_cli_bad_input.py); none starts a process."""

import pytest
from test_cli_bad_input import _base, _main, _refused

HOSTS = "groups:\n- {zone: us-central1-a, gpu: A100-40, hosts: [10.0.0.1, 10.0.0.2]}\n"
CLUSTER = "provider: gcp\nzones: {us-central1-a: {A100-40: 2}}\ngpus_per_node: {A100-40: 1}\n"


# ---- profile network --hosts ---------------------------------------------------------------------
@pytest.mark.parametrize("port, words", [("0", "greater than or equal to 1"), ("70000", "less than or equal to 65535")])
def test_profile_network_names_its_own_port_option(tmp_path, monkeypatch, capsys, port, words):
    # it named --rdzv-port, an option of `sailor run` and `sailor launch` that this command does not have
    (tmp_path / "hosts.yaml").write_text(HOSTS)
    (tmp_path / "c.yaml").write_text(CLUSTER)
    line = _refused(["profile", "network", "--hosts", "hosts.yaml", "--cluster", "c.yaml", "--port", port], tmp_path,
                    monkeypatch, capsys)
    assert line.startswith("error: Invalid value for '--port': ") and words in line, line


def test_profile_network_between_unreachable_hosts_is_one_line_not_an_internal_error(tmp_path, monkeypatch, capsys):
    from sailor.runtime import netprofile

    def unreachable(pairs, launch, **kw):
        assert [p.hosts for p in pairs] == [("10.0.0.1", "10.0.0.2")]
        raise RuntimeError("link 10.0.0.1 -> 10.0.0.2: profiling rank 0 failed: Connection to 10.0.0.1 port 22 timed out")
    monkeypatch.setattr(netprofile, "profile_pairs", unreachable)
    (tmp_path / "hosts.yaml").write_text(HOSTS)
    (tmp_path / "c.yaml").write_text(CLUSTER)
    code, out, err = _main(["profile", "network", "--hosts", "hosts.yaml", "--cluster", "c.yaml", "--out", "n.json"],
                           tmp_path, monkeypatch, capsys)
    assert (code, out) == (1, "")
    assert err == ("error: link 10.0.0.1 -> 10.0.0.2: profiling rank 0 failed: Connection to 10.0.0.1 port 22 timed"
                   " out\n"), err
    assert not (tmp_path / "n.json").exists()


# ---- testbed profile ------------------------------------------------------------------------------
@pytest.mark.parametrize("job, mbs, line", [
    ("job.yaml", "x", "error: --mbs: expected comma-separated whole numbers, got 'x'"),
    ("job.yaml", "0,2", "error: --mbs: micro-batch sizes must be >= 1, got [0, 2]"),
    ("bf16.yaml", "1", "error: bf16.yaml: precision: the runtime trains in fp32 on cpu, the job says bf16 (set"
                       " precision: fp32 in the job)"),
])
def test_testbed_profile_refuses_what_each_class_profile_would_before_measuring(tmp_path, monkeypatch, capsys, job,
                                                                                mbs, line):
    # these ended, minutes later, as one class's failed `sailor profile`: an internal error, exit 1
    from sailor.testbed import host
    from sailor.testbed import profile as testbed_profile

    monkeypatch.setattr(host, "check_support", lambda: None)
    monkeypatch.setattr(testbed_profile, "profile_classes", lambda *a, **k: pytest.fail("measured a bad input"))
    _base(tmp_path)
    (tmp_path / "bf16.yaml").write_text("model: tiny\nglobal_batch_size: 8\nprecision: bf16\n")
    (tmp_path / "tb.yaml").write_text(TESTBED)
    got = _refused(["testbed", "profile", "tb.yaml", "--job", job, "--mbs", mbs, "--out", "out/p.json",
                    "--state-dir", str(tmp_path / "state")], tmp_path, monkeypatch, capsys)
    assert got == line


TESTBED = """name: nc
devices: {fast: {gpu: A100-40, cpu_quota: 0.3}}
links: {same_zone_mbit_per_s: 400, cross_zone_mbit_per_s: 200, cross_region_mbit_per_s: 50}
nodes:
  - {name: a0, zone: us-central1-a, region: us-central1, device: fast, ranks: 1, nic_mbit_per_s: 300}
"""


# ---- run and train: two outputs on one path, inputs read before measuring -------------------------
RUN = ["run", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "trace.json"]


@pytest.mark.parametrize("args, line", [
    (RUN + ["--events", "out/x.jsonl", "--metrics", "out/x.jsonl"],
     "error: --events: out/x.jsonl is also the --metrics output (name a different file for each)"),
    (RUN + ["--checkpoint-dir", "out/ck", "--metrics", "out/ck"],
     "error: --metrics: out/ck is also the --checkpoint-dir output (name a different file for each)"),
    # checked before the machine is measured (measuring starts processes, which a unit test refuses)
    (RUN + ["--data", "nosuch.npy"], "error: nosuch.npy: no such file (pass a .bin or .npy token file)"),
    (RUN + ["--init-from", "nosuch"], "error: --init-from: nosuch is not a folder (pass a Hugging Face model folder)"),
    (["train", "cpu_plan.json", "--metrics", "out/m.jsonl", "--stop-file", "out/m.jsonl", "--dry-run"],
     "error: --stop-file: out/m.jsonl is also the --metrics output (name a different file for each)"),
    (["train", "cpu_plan.json", "--tensorboard", "out/tb", "--checkpoint-dir", "out/tb", "--dry-run"],
     "error: --tensorboard: out/tb is also the --checkpoint-dir output (name a different file for each)"),
])
def test_run_and_train_refuse_before_any_work(tmp_path, monkeypatch, capsys, args, line):
    _base(tmp_path)
    assert _refused(args, tmp_path, monkeypatch, capsys) == line


def test_run_refuses_an_events_file_holding_an_earlier_runs_events(tmp_path, monkeypatch, capsys):
    # a second run appended its events to the first's without a word
    _base(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "e.jsonl").write_text('{"event": "done"}\n')
    assert _refused(RUN + ["--events", "out/e.jsonl"], tmp_path, monkeypatch, capsys) == (
        "error: --events: out/e.jsonl holds events already (an earlier run's?); this run's would be mixed into them"
        " (name a new file, or pass --append-events to add this run's after them)")


def test_replay_refuses_cluster_settings_for_what_the_trace_never_offers(tmp_path, monkeypatch, capsys):
    # the trace replaces the cluster's zones: a price for a GPU type it never offers was ignored without a word
    _base(tmp_path)
    (tmp_path / "c.yaml").write_text("provider: local\nzones: {local: {cpu: 4, A100-40: 0}}\n"
                                     "prices: {local: {A100-40: 1.5}}\n")
    line = _refused(["replay", "--job", "job.yaml", "--cluster", "c.yaml", "--availability", "trace.json"], tmp_path,
                    monkeypatch, capsys)
    assert line == ("error: c.yaml: prices.local.A100-40: the trace trace.json offers no A100-40 in zone 'local' (it"
                    " lists cpu there), so this price would never be used (remove the price, or offer that GPU type"
                    " there)")


def test_distinct_outputs_see_one_path_spelled_two_ways(tmp_path):
    from sailor.core.fileio import check_distinct_outputs

    # distinct outputs pass; a relative and an absolute spelling of one path do not
    check_distinct_outputs({"--metrics": tmp_path / "m.jsonl", "--events": tmp_path / "e.jsonl", "--x": None})
    with pytest.raises(Exception, match="is also the --metrics output"):
        check_distinct_outputs({"--metrics": tmp_path / "m.jsonl", "--events": tmp_path / "." / "m.jsonl"})


# ---- a cluster offering a GPU type where its provider has none ------------------------------------
def test_plan_refuses_a_gpu_type_the_zone_does_not_offer(tmp_path, monkeypatch, capsys):
    # it planned 8 A100-40 in europe-west1-b, where GCP rents none (no a2-highgpu machines there)
    _base(tmp_path)
    (tmp_path / "c.yaml").write_text("provider: gcp\nzones: {europe-west1-b: {A100-40: 8}}\n")
    line = _refused(["plan", "--job", "job.yaml", "--cluster", "c.yaml"], tmp_path, monkeypatch, capsys)
    assert line == ("error: c.yaml: zones.europe-west1-b.A100-40: gcp does not offer A100-40 in zone 'europe-west1-b'"
                    " (it offers H100-80, H200-141, L4, T4 there) (use a zone that does, e.g. europe-west4-a,"
                    " asia-northeast1-a, asia-northeast3-a; or, if yours does, give its price there under"
                    " prices.europe-west1-b.A100-40)")


@pytest.mark.parametrize("zone, hint", [
    ("mars-1a", "known: 140 zones of gcp and aws, e.g. us-central1-a, us-east-1a"),
    ("us-centrall-a", "did you mean 'us-central1-a'?"),
])
def test_an_unknown_zone_of_two_providers_is_a_short_line(tmp_path, monkeypatch, capsys, zone, hint):
    # the line listed all 140 zones of gcp and aws (over 2,000 characters) when none was close
    _base(tmp_path)
    (tmp_path / "c.yaml").write_text(f"provider: [gcp, aws]\nzones: {{{zone}: {{A100-40: 8}}}}\n")
    line = _refused(["plan", "--job", "job.yaml", "--cluster", "c.yaml"], tmp_path, monkeypatch, capsys)
    assert line == f"error: c.yaml: zones.{zone}: unknown gcp+aws zone '{zone}' ({hint})"


# ---- a price of .nan ------------------------------------------------------------------------------
@pytest.mark.parametrize("prices, field", [("{A100-40: .nan}", "prices.A100-40"),
                                           ("{us-central1-a: {A100-40: .nan}}", "prices.us-central1-a.A100-40")])
def test_a_nan_price_names_its_field(tmp_path, monkeypatch, capsys, prices, field):
    # it said "c.yaml: invalid YAML at line 3: .nan is not a finite number", naming no field
    _base(tmp_path)
    (tmp_path / "c.yaml").write_text(f"provider: gcp\nzones: {{us-central1-a: {{A100-40: 8}}}}\nprices: {prices}\n")
    line = _refused(["plan", "--job", "job.yaml", "--cluster", "c.yaml"], tmp_path, monkeypatch, capsys)
    assert line == f"error: c.yaml: {field}: must be a finite number, got .nan (line 3)"


def test_a_nan_in_the_catalog_names_its_file_and_field(monkeypatch):
    # the catalog's own files were read by yaml.safe_load: a .nan price became a silent NaN
    import types

    from sailor import catalog
    from sailor.core.errors import SailorInputError

    text = "schema: 1\nproviders:\n  gcp:\n    prices_usd_per_gpu_hour:\n      A100-40: .nan\n"
    files = types.SimpleNamespace(joinpath=lambda name: types.SimpleNamespace(read_text=lambda encoding: text))
    monkeypatch.setattr(catalog.resources, "files", lambda package: files)
    with pytest.raises(SailorInputError) as e:
        catalog._load_yaml("gcp.yaml")
    assert str(e.value) == ("sailor/catalog/gcp.yaml: providers.gcp.prices_usd_per_gpu_hour.A100-40: must be a finite"
                            " number, got .nan (line 5)")


# ---- --profiles of every command that takes it -----------------------------------------------------
@pytest.mark.parametrize("args", [
    ["plan", "--job", "job.yaml", "--cluster", "local.yaml"],
    ["simulate", "cpu_plan.json"],
    RUN,
    ["replay", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "trace.json"],
    ["validate", "runs-tiny"],
])
def test_a_missing_profiles_path_names_the_option(tmp_path, monkeypatch, capsys, args):
    # it said "error: nosuch: no such file", naming neither --profiles nor that it was the profiles
    _base(tmp_path)
    line = _refused([*args, "--profiles", "nosuch"], tmp_path, monkeypatch, capsys)
    assert line == "error: Invalid value for '--profiles': path 'nosuch' does not exist. (see --help)"


# ---- launch of a local plan to a cloud backend ----------------------------------------------------
@pytest.mark.parametrize("backend, what", [("skypilot", "SkyPilot accelerator on local"),
                                           ("kubernetes", "GKE accelerator label")])
def test_launching_a_local_plan_on_a_cloud_backend_names_the_plan(tmp_path, monkeypatch, capsys, backend, what):
    _base(tmp_path)
    line = _refused(["launch", "cpu_plan.json", "--backend", backend, "--steps", "5", "--out", "out/x"], tmp_path,
                    monkeypatch, capsys)
    assert line.startswith(f"error: cpu_plan.json: pipelines.0.replicas.0.gpu: GPU type cpu has no {what}"), line


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_skypilot_without_out_names_the_out_option(tmp_path, monkeypatch, capsys, dry_run):
    # it blamed --backend, though the backend was right and --out was what was missing
    _base(tmp_path)
    line = _refused(["launch", "gcp_plan.json", "--backend", "skypilot", "--steps", "5", *dry_run], tmp_path,
                    monkeypatch, capsys)
    assert line == ("error: --out: the skypilot backend needs a new folder to write the tasks' working directory into"
                    " (task files, launch.sh, the plan and Sailor, synced to every node) (pass --out DIR; with"
                    " --dry-run it also prints the task files)")


# ---- the testbed benchmarks' flags ----------------------------------------------------------------
def _bench_args(**kw):
    import argparse
    from pathlib import Path

    examples = Path(__file__).resolve().parents[1] / "examples"
    base = {"testbed": examples / "testbed.yaml", "steps": 12, "skip": 3, "only": None, "no_baselines": False,
            "no_elastic": False, "stages": 4, "microbatches": 2, "mbs": 2, "seq": 128, "rounds": 6, "repeats": 5}
    if kw.get("testbed") == "pair":
        kw["testbed"] = examples / "testbed_pair.yaml"
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, words", [
    # --only once filtered after the testbed, profile and baselines (minutes): an unknown name ran the
    # planner alone, and a subset without every baseline ended in a KeyError traceback
    ({"only": "dp_fast,bogus"}, "--only: unknown plan 'bogus' (known: planner, dp_fast,"),
    ({"only": "baseline:paper", "no_baselines": True}, "--only: unknown plan 'baseline:paper'"),
    ({"steps": 3, "skip": 3}, "--steps: need 0 <= --skip < --steps"),
    ({"testbed": "pair", "no_elastic": True}, "testbed_pair.yaml: plan shares needs V100-16 in us-central1-b"),
    ({"testbed": "pair", "only": "dp_fast"}, "testbed_pair.yaml: nodes: the elastic row stops node a1"),
])
def test_testbed_benchmark_refuses_its_flags_before_the_testbed_comes_up(kw, words):
    from benchmark_module import load_benchmark

    from sailor.core.errors import SailorInputError
    from sailor.testbed import load_testbed

    bench, args = load_benchmark("testbed"), _bench_args(**kw)
    with pytest.raises(SailorInputError) as e:
        bench.check_args(args, load_testbed(args.testbed))
    assert words in e.value.one_line(), e.value.one_line()


def test_the_testbed_benchmarks_sub_clusters_are_clusters_the_reader_takes():
    # the baselines plan on the testbed's cluster cut to one device class or one zone; the reader
    # refuses node sizes and zone links for GPU types and zones nothing offers (session 13: the cut
    # kept gpus_per_node of the class it dropped, and the benchmark ended in that error)
    from benchmark_module import load_benchmark

    from sailor.specs import load_cluster
    from sailor.testbed import cluster_spec, load_testbed

    bench = load_benchmark("testbed")
    cluster = cluster_spec(load_testbed(_bench_args().testbed))
    for gpu in ("A100-40", "V100-16"):
        cut = load_cluster(bench._cluster_only(cluster, lambda z, g, x=gpu: g == x))
        assert set(cut.gpus_per_node) == {gpu} and {g for gs in cut.zones.values() for g in gs} == {gpu}
    cut = load_cluster(bench._cluster_only(cluster, lambda z, g: z == "us-west1-b"))
    assert list(cut.zones) == ["us-west1-b"] and set(cut.gpus_per_node) == {"V100-16"}


def test_testbed_benchmark_takes_a_subset_that_fits_the_testbed():
    from benchmark_module import load_benchmark

    from sailor.testbed import load_testbed

    bench = load_benchmark("testbed")
    args = _bench_args()
    assert bench.check_args(args, load_testbed(args.testbed)) is None  # every plan
    args = _bench_args(testbed="pair", only="dp_fast,baseline:one_zone", no_elastic=True)
    assert bench.check_args(args, load_testbed(args.testbed)) == ["dp_fast", "baseline:one_zone"]


@pytest.mark.parametrize("kw, words", [
    ({"testbed": "pair"}, "testbed_pair.yaml: nodes: the 4-stage plans need 4 ranks of device class 'cpu'"),
    ({"rounds": 0}, "--rounds: must be >= 1, got 0"),
    ({"steps": 2, "skip": 2}, "--skip: need 0 <= --skip < --steps"),
])
def test_schedules_benchmark_refuses_its_flags_before_any_work(kw, words):
    from benchmark_module import load_benchmark

    from sailor.core.errors import SailorInputError

    with pytest.raises(SailorInputError) as e:
        load_benchmark("schedules").check_args(_bench_args(**kw))
    assert words in e.value.one_line(), e.value.one_line()


def test_schedules_benchmark_runs_two_stages_on_two_ranks():
    # "the 4-stage plans need 4 ranks" refused --stages 2 on a testbed of two ranks
    from benchmark_module import load_benchmark

    schedules = load_benchmark("schedules")
    assert [n.name for n in schedules.check_args(_bench_args(testbed="pair", stages=2)).nodes] == ["a", "b"]
    assert schedules.check_args(_bench_args(testbed=None)) is None


# ---- mixture-of-experts configs name the config's own keys ----------------------------------------
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 256, "max_position_embeddings": 128, "num_local_experts": 4, "num_experts_per_tok": 2,
           "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu"}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
             "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 128,
             "num_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
             "tie_word_embeddings": False, "hidden_act": "silu"}


@pytest.mark.parametrize("base, edit, field, words", [
    # these named the MoE spec's fields (`moe: top_k ...`, `moe.num_experts`), which no config has
    (MIXTRAL, {"num_experts_per_tok": 9}, "num_experts_per_tok", "top_k 9 exceeds num_experts 4"),
    (MIXTRAL, {"num_local_experts": 1, "num_experts_per_tok": 1}, "num_local_experts", "greater than or equal to 2 (got 1)"),
    (MIXTRAL, {"num_local_experts": 10**9}, "num_local_experts", "less than or equal to"),
    (QWEN3_MOE, {"num_experts_per_tok": 9}, "num_experts_per_tok", "top_k 9 exceeds num_experts 8"),
    (QWEN3_MOE, {"moe_intermediate_size": 10**9}, "moe_intermediate_size", "less than or equal to"),
    (QWEN3_MOE, {"decoder_sparse_step": 10**9}, "decoder_sparse_step", "less than or equal to"),
])
def test_bad_moe_configs_name_the_config_key(base, edit, field, words):
    from sailor.core.errors import SailorInputError
    from sailor.model.hf_config import spec_from_hf

    with pytest.raises(SailorInputError) as e:
        spec_from_hf(base | edit, source="config.json", name="m")
    assert (e.value.source, e.value.field) == ("config.json", field), e.value.one_line()
    assert words in e.value.message, e.value.one_line()
    assert spec_from_hf(base, source="config.json", name="m").moe.num_experts == base.get("num_local_experts", 8)


# ---- a model too large to measure on this CPU ------------------------------------------------------
def test_a_model_too_large_for_this_machine_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    # `sailor plan` of mixtral-8x7b on the local provider started measuring it: 4 processes each
    # building the whole model (348 GiB of fp32 weights and gradients) on a 24 GB machine
    from sailor.core import limits

    monkeypatch.setattr(limits, "available_memory_bytes", lambda: 20 * 2**30)
    _base(tmp_path)
    (tmp_path / "mix.yaml").write_text("model: mixtral-8x7b\nglobal_batch_size: 8\nsequence_length: 128\n")
    line = _refused(["plan", "--job", "mix.yaml", "--cluster", "local.yaml"], tmp_path, monkeypatch, capsys)
    assert line == ("error: mix.yaml: model: measuring mixtral-8x7b (46.7B parameters) on this CPU needs at least"
                    " 348.0 GiB (fp32 weights and gradients of 1 model copy measured at once), more than the 20.0 GiB"
                    " available (pass --profiles with a profile measured where the model fits, or a smaller model)")
    line = _refused(["profile", "--job", "mix.yaml", "--concurrency", "2", "--out", "out/p.json"], tmp_path,
                    monkeypatch, capsys)
    assert line.startswith("error: mix.yaml: model: measuring mixtral-8x7b"), line
    assert "695.9 GiB (fp32 weights and gradients of 2 model copies" in line, line


def test_the_memory_bound_is_eight_bytes_per_parameter_per_copy(monkeypatch):
    from sailor.core import limits
    from sailor.core.errors import SailorInputError
    from sailor.runtime.profiler import ProfileOptions, check_options
    from sailor.specs.job import JobSpec

    job = JobSpec(model="tiny", global_batch_size=8)
    need = 3 * job.model.total_params() * 8  # 3 copies at once
    monkeypatch.setattr(limits, "available_memory_bytes", lambda: need)
    check_options(ProfileOptions(job=job, concurrency=3))  # exactly fits
    monkeypatch.setattr(limits, "available_memory_bytes", lambda: need - 1)
    with pytest.raises(SailorInputError, match="3 model copies measured at once") as e:
        check_options(ProfileOptions(job=job, concurrency=3))
    assert e.value.field == "model"
    monkeypatch.setattr(limits, "available_memory_bytes", lambda: None)  # unknown: not refused
    check_options(ProfileOptions(job=job, concurrency=3))
