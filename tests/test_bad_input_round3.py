"""Bad input, round 3 (issue 31): each case the issue lists ends in exit status 2 and one line naming
the file and field, or (for legitimate input) succeeds. Commands run in-process through
`sailor.cli.main` (helpers from tests/test_cli_bad_input.py)."""

import json
import tomllib
import warnings
from pathlib import Path

import pytest
from test_cli_bad_input import _base, _main, _refused

from sailor.core.errors import SailorInputError

ROOT = Path(__file__).resolve().parents[1]


# ---- profiles record Sailor's version ------------------------------------------------------------
def test_profiles_and_the_cache_key_record_sailors_version():
    from sailor.core import __version__
    from sailor.runtime.machine import cache_key
    from sailor.runtime.profiler import versions
    from sailor.specs.job import JobSpec

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "sailor-train" and "version" in project["dynamic"]
    assert versions()["sailor"] == __version__ != "unknown"
    assert cache_key(JobSpec(model="tiny", global_batch_size=8))["sailor"] == __version__


# ---- profiles: all-zero times, per-layer counts, an unknown schema ------------------------------
def _profile(tmp_path: Path, name: str, edit) -> str:
    import mutate
    doc = json.loads(json.dumps(mutate.PROFILE))
    edit(doc)
    (tmp_path / name).write_text(json.dumps(doc))
    return name


def _all_zero(doc) -> None:
    for row in doc["layers"]:
        row["forward_s"], row["backward_s"] = [0] * 6, [0] * 6


@pytest.mark.parametrize("edit, words", [
    (_all_zero, "p.json: layers.0: every forward and backward time is 0 s"),
    (lambda d: d["layers"][0].update(backward_s=[0] * 6), "p.json: layers.0.backward_s: every backward time is 0 s"),
    (lambda d: d["layers"][1].update(forward_s=[0.0] * 6), "p.json: layers.1.forward_s: every forward time is 0 s"),
    (lambda d: d["layers"][0].update(forward_s=[1e-3] * 25),
     "p.json: layers.0.forward_s: expected 6 values (one per layer), got 25"),
    (lambda d: d["layers"][0].update(forward_s=[1e-3] * 25, backward_s=[1e-3] * 7),
     "p.json: layers.0: forward_s has 25 values and backward_s 7; both give one per layer (the model has 6)"),
    (lambda d: d["layers"][1].update(forward_s=[1e-3] * 25),
     "p.json: layers.1.forward_s: expected 6 values (one per layer), got 25"),
    (lambda d: d.update(model="mine") or d["layers"][0].update(forward_s=[1e-3] * 25),
     "p.json: layers.0: forward_s has 25 values and backward_s 6; both give one per layer"),
    (lambda d: d.update(schema="sailor.profiles/9"),
     "p.json: schema: unknown schema 'sailor.profiles/9' (this Sailor reads 'sailor.profiles/1')"),
])
def test_plan_refuses_a_profile_naming_the_field(tmp_path, monkeypatch, capsys, edit, words):
    _base(tmp_path)
    _profile(tmp_path, "p.json", edit)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no numpy warning on the way
        line = _refused(["plan", "--job", "job.yaml", "--cluster", "gcp.yaml", "--profiles", "p.json"],
                        tmp_path, monkeypatch, capsys)
    assert words in line, line


def test_a_sailor_profile_whose_times_are_all_zero_is_refused(tmp_path):
    import mutate

    from sailor.perf.profiles import load_profiles
    from sailor.specs.job import JobSpec
    doc = json.loads(json.dumps(mutate.SAILOR_PROFILES))
    doc["tiny"]["A100-40"]["4"]["1"] = {str(i): [0, 0, 1e-4] for i in range(6)}
    (tmp_path / "profiles_tmp.json").write_text(json.dumps(doc))
    with pytest.raises(SailorInputError, match=r"profiles_tmp.json: tiny.A100-40.4.1: every forward and backward"):
        load_profiles(tmp_path, JobSpec(model="tiny", global_batch_size=8))
    doc["tiny"]["A100-40"]["4"]["1"] = {str(i): [1e-3, 0, 1e-4] for i in range(6)}
    (tmp_path / "profiles_tmp.json").write_text(json.dumps(doc))
    with pytest.raises(SailorInputError, match=r"profiles_tmp.json: tiny.A100-40.4.1: every backward time is 0 s"):
        load_profiles(tmp_path, JobSpec(model="tiny", global_batch_size=8))


# ---- YAML: libyaml's parser with the same rules; a 4 MB job refused before it is read ------------
YAML_CASES = [
    "a: 1\nb: [1, 2.5, x]\n", "a: 1\na: 2\n", "? [a, b]\n: 1\n", "1: x\n", "yes: 1\n", "null: 1\n",
    "2024-01-01: 1\n", "a: 1:30\n", "a: 010\n", "a: 1e9\n", "a: -5.0e-3\n", "a: .nan\n", "a: .inf\n",
    "a: " + "9" * 5000 + "\n", "base: &b {x: 1}\nc:\n  <<: *b\n  y: 2\n", "a: &a [*a]\n", "a: [\n", "a: b: c\n",
    "a: 0x1F\n", "a: yes\n", "a: '1:30'\n", "a: 2001-12-14\n",
]


@pytest.mark.parametrize("text", YAML_CASES)
def test_c_and_python_yaml_loaders_apply_the_same_rules(text):
    import yaml

    from sailor.core import fileio

    def outcome(loader):
        try:
            return ("ok", fileio.parse_yaml(text, "f.yaml", loader))
        except SailorInputError as e:
            return ("refused", e.one_line())
    assert fileio._Loader.__mro__[2] is (yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader)
    c, py = outcome(fileio._Loader), outcome(fileio._PyLoader)
    assert c[0] == py[0], (c, py)
    if c[0] == "ok":
        assert c == py
    else:
        # the two parsers word a syntax error differently; the rules' own words are the same
        assert c[1].split(": ", 1)[0] == "f.yaml" and (c[1] == py[1] or "invalid YAML" in c[1]), (c, py)


def test_a_4_mb_yaml_job_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    # benchmarks/yaml_refusal.py times this (a test asserts no wall-clock)
    _base(tmp_path)
    text = "model: tiny\nglobal_batch_size: 8\nnotes:\n" + "".join(f"  - {{name: item{i}, value: {i}}}\n"
                                                                   for i in range(110_000))
    text += "#" + "x" * (4 * 2**20 - len(text) - 2) + "\n"  # exactly 4 MiB
    (tmp_path / "big.yaml").write_text(text)
    assert (tmp_path / "big.yaml").stat().st_size == 4 * 2**20
    line = _refused(["plan", "--job", "big.yaml", "--cluster", "local.yaml"], tmp_path, monkeypatch, capsys)
    assert line == ("error: big.yaml: a YAML file of 4.0 MiB, more than the 1 MiB any YAML input (job, cluster,"
                    " hosts, testbed) needs (check that it is the file you meant)"), line


@pytest.mark.parametrize("text, words", [
    ("", "job.yaml: the file is empty"),
    ("# a comment\n\n# another\n", "job.yaml: the file holds no data, only comments or blank lines"),
    ("---\n", "job.yaml: the file holds no data, only comments or blank lines"),
    ("- tiny\n", "job.yaml: expected a mapping (`key: value` lines) at the top level, got a list"),
    ("tiny\n", "job.yaml: expected a mapping (`key: value` lines) at the top level, got a string"),
])
def test_an_empty_or_comments_only_job_says_so(tmp_path, monkeypatch, capsys, text, words):
    _base(tmp_path)
    (tmp_path / "job.yaml").write_text(text)
    line = _refused(["plan", "--job", "job.yaml", "--cluster", "local.yaml"], tmp_path, monkeypatch, capsys)
    assert words in line and "NoneType" not in line, line


# ---- output off a terminal ---------------------------------------------------------------------
def test_profile_network_off_a_terminal_prints_its_error_alone(tmp_path, monkeypatch, capsys):
    """No progress-bar frame before the error when the output is a pipe."""
    from sailor.runtime import netprofile

    def failing(nproc, progress, **kw):
        progress(1)  # some sizes measured, then a rank fails
        progress(1)
        raise SailorInputError("rank 1 could not reach rank 0", source="--nproc")
    monkeypatch.setattr(netprofile, "profile_network", failing)
    code, out, err = _main(["profile", "network", "--nproc", "2", "--out", "n.json"], tmp_path, monkeypatch, capsys)
    assert (code, out, err) == (2, "", "error: --nproc: rank 1 could not reach rank 0\n")


def test_data_prepare_json_is_the_json_line_alone(tmp_path, monkeypatch, capsys):
    from sailor.runtime import dataprep

    summary = {"out": "t.npy", "tokens": 10, "documents": 1, "vocab_size": 300, "dtype": "uint16", "seconds": 0.1}

    def prepare(inputs, progress, **kw):
        progress(3)
        return summary
    monkeypatch.setattr(dataprep, "prepare_tokens", prepare)
    (tmp_path / "a.txt").write_text("hello")
    code, out, err = _main(["data", "prepare", "a.txt", "--tokenizer", "tok.json", "--out", "t.npy", "--json"],
                           tmp_path, monkeypatch, capsys)
    assert (code, err) == (0, "") and out == json.dumps(summary) + "\n", (out, err)


def test_progress_bars_are_drawn_only_on_terminals(monkeypatch):
    import io
    import sys

    from sailor.cli.common import progress_bar

    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stdout", Tty())
    monkeypatch.setattr(sys, "stderr", Tty())
    assert not progress_bar().disable
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # `| cat`
    assert progress_bar().disable
    monkeypatch.setattr(sys, "stdout", Tty())
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # `2> log`
    assert progress_bar().disable


@pytest.mark.integration
def test_a_reader_that_leaves_early_ends_the_command_quietly_with_status_0(tmp_path):
    """`sailor plan | head -1`: the pipe's reader is gone before the first write. (`--profiles`: the
    plan from the given profile, not from a measurement of this machine first, which takes minutes
    on a loaded 2-core machine and has nothing to do with the pipe.)"""
    import subprocess
    import sys

    _base(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", "from sailor.cli import main; main()", "plan", "--job", "job.yaml",
                             "--cluster", "local.yaml", "--profiles", "profile.json"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader leaves
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err and "error" not in err, err


# ---- one check that a checkpoint's manifest describes its tensors: resume, export; --init-from ---
def _edited_checkpoint(tmp_path: Path, **model_fields) -> Path:
    from test_cli_bad_input import JOB, _checkpoint
    _checkpoint(tmp_path / "ck", 2, JOB, seed=0)
    m = tmp_path / "ck" / "step-00000002" / "manifest.json"
    doc = json.loads(m.read_text())
    doc["model"].update(model_fields)
    m.write_text(json.dumps(doc))
    return m


@pytest.mark.parametrize("fields, words", [
    ({"hidden_size": 128}, ("ck/step-00000002/manifest.json: model.hidden_size: hidden_size 128, the checkpoint's"
                            " embedding layers.0.tok.weight is 64 wide")),
    ({"num_blocks": 5}, ("ck/step-00000002/manifest.json: model.num_blocks: num_blocks 5 means 7 layers, the"
                         " checkpoint's tensors have 6 (4 blocks)")),
    ({"ffn_hidden_size": 96}, ("ck/step-00000002/manifest.json: model: does not describe the checkpoint's tensors:"
                               " layers.1.mlp.fc1.weight: the model implies shape [96, 64], the checkpoint holds"
                               " [256, 64]")),
])
@pytest.mark.parametrize("command", [["export", "ck", "--to", "out"],
                                     ["train", "cpu_plan.json", "--checkpoint-dir", "ck", "--resume", "--steps", "5",
                                      "--dry-run"]])
def test_a_manifest_whose_model_does_not_fit_its_tensors_is_refused(tmp_path, monkeypatch, capsys, command, fields,
                                                                     words):
    _base(tmp_path)
    _edited_checkpoint(tmp_path, **fields)
    line = _refused(command, tmp_path, monkeypatch, capsys)
    assert words in line, line


def test_init_from_a_folder_whose_config_does_not_fit_its_weights_is_refused(tmp_path, monkeypatch, capsys):
    """--init-from reads a Hugging Face folder: its config.json is the sidecar (HFWeights.check)."""
    from test_cli_bad_input import CPU_PLAN
    _base(tmp_path)
    _edited_checkpoint(tmp_path)
    code, _, err = _main(["export", "ck", "--to", "hf"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"n_embd": 128}))
    (tmp_path / "p.json").write_text(json.dumps(CPU_PLAN | {"job": {"model": "hf/config.json", "global_batch_size": 8}}))
    line = _refused(["train", "p.json", "--init-from", "hf", "--dry-run"], tmp_path, monkeypatch, capsys)
    assert "hf: transformer.wte.weight: shape [256, 64] in model.safetensors, the config implies [256, 128]" in line


def test_export_writes_the_usual_permissions(tmp_path, monkeypatch, capsys):
    import os
    import stat
    _base(tmp_path)
    _edited_checkpoint(tmp_path)
    old = os.umask(0o022)
    try:
        code, _, err = _main(["export", "ck", "--to", "shared/hf"], tmp_path, monkeypatch, capsys)
    finally:
        os.umask(old)
    assert code == 0, err
    out = tmp_path / "shared" / "hf"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        "config.json": 0o644, "model.safetensors": 0o644}


# ---- accepted silently before: now refused in one line ------------------------------------------
@pytest.mark.parametrize("files, args, words", [
    ({}, ["launch", "cpu_plan.json", "--backend", "kubernetes", "--dry-run", "--checkpoint-dir", "/ckpt",
          "--checkpoint-claim", "my claim"],
     "--checkpoint-claim: 'my claim' is not a PersistentVolumeClaim name (a DNS-1123 subdomain"),
    ({}, ["launch", "cpu_plan.json", "--backend", "kubernetes", "--dry-run", "--checkpoint-dir", "/ckpt",
          "--checkpoint-claim", "Claim-"], "'Claim-' is not a PersistentVolumeClaim name"),
    ({"h.yaml": {"groups": [{"zone": "local", "gpu": "cpu", "gpus_per_node": 4, "hosts": ["127.0.0.1"]},
                            {"zone": "locall", "gpu": "cpu", "hosts": ["spare"]}]}},
     ["launch", "cpu_plan.json", "--backend", "torchrun", "--hosts", "h.yaml", "--dry-run"],
     "h.yaml: groups.1.zone: unknown zone 'locall': neither the plan nor the catalog has it (did you mean 'local'?)"),
    ({"n.json": {"schema": "sailor.network/1", "links": [
        {"src_zone": "us-central1-a", "src_gpu": "A100-40", "dst_zone": "us-central1-bb", "dst_gpu": "V100-16",
         "latency_s": 5e-4, "bandwidth_bytes_per_s": 1e9}]}},
     ["plan", "--job", "job.yaml", "--cluster", "gcp.yaml", "--network", "n.json"],
     ("n.json: links.0.dst_zone: unknown zone 'us-central1-bb': neither the cluster nor its provider (gcp) has it"
      " (did you mean 'us-central1-b'?)")),
    ({"afile": "x"}, ["train", "cpu_plan.json", "--stop-file", "afile/stop", "--dry-run"],
     "--stop-file: afile is a file, so afile/stop cannot be created under it"),
    ({}, ["profile", "--job", "job.yaml", "--concurrency", "-1"], "--concurrency: must be >= 0, got -1"),
    ({}, ["profile", "--job", "job.yaml", "--repeats", "0"], "--repeats: must be >= 1, got 0"),
    ({}, ["launch", "sailor_plan.json", "--backend", "torchrun", "--dry-run"],
     "sailor_plan.json: the plan carries no job (pass --job JOB"),
])
def test_round3_cases_are_one_line(tmp_path, monkeypatch, capsys, files, args, words):
    from test_cli_bad_input import _write
    _base(tmp_path)
    _write(tmp_path, files)
    line = _refused(args, tmp_path, monkeypatch, capsys)
    assert words in line, line


@pytest.mark.parametrize("files, args", [
    # the --job that the refusal above names is one `sailor launch` takes
    ({}, ["launch", "sailor_plan.json", "--job", "job.yaml", "--backend", "torchrun", "--dry-run", "--steps", "5"]),
    # a spare group in a zone the catalog knows, and a claim that is a DNS-1123 subdomain
    ({"h.yaml": {"groups": [{"zone": "local", "gpu": "cpu", "gpus_per_node": 4, "hosts": ["127.0.0.1"]},
                            {"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["spare"]}]}},
     ["launch", "cpu_plan.json", "--backend", "torchrun", "--hosts", "h.yaml", "--dry-run", "--steps", "5"]),
    ({}, ["launch", "gcp_plan.json", "--backend", "kubernetes", "--dry-run", "--checkpoint-dir", "/ckpt",
          "--checkpoint-claim", "ckpt.team-a", "--steps", "5"]),
    # a link measured in a zone of the provider that this cluster does not use
    ({"n.json": {"schema": "sailor.network/1", "links": [
        {"src_zone": "us-central1-a", "src_gpu": "A100-40", "dst_zone": "europe-west4-a", "dst_gpu": "A100-40",
         "latency_s": 5e-3, "bandwidth_bytes_per_s": 1e9}]}},
     ["plan", "--job", "job.yaml", "--cluster", "gcp.yaml", "--network", "n.json"]),
])
def test_legitimate_neighbours_of_the_round3_cases_succeed(tmp_path, monkeypatch, capsys, files, args):
    from test_cli_bad_input import _write
    _base(tmp_path)
    _write(tmp_path, files)
    code, _, err = _main(args, tmp_path, monkeypatch, capsys)
    assert code == 0, err


# ---- clearer words: traces, long lists of counts ------------------------------------------------
@pytest.mark.parametrize("name, text, words", [
    ("t.csv", "Timestamp,cpu_local\n0,4\n\n60,2\n30,4\n",
     "t.csv: line 5.Timestamp: time goes backwards: 30 s after 60 s (line 4.Timestamp)"),
    ("t.json", json.dumps([{"time_s": t, "zone": "local", "gpu": "cpu", "count": 2} for t in (0, 10, 5)]),
     "t.json: [2].time_s: time goes backwards: 5 s after 10 s ([1].time_s)"),
    ("t.json", "Timestamp,cpu_local\n0,4\n", "t.json: invalid JSON at line 1 column 1"),
])
def test_trace_errors_name_the_line_and_the_format(tmp_path, monkeypatch, capsys, name, text, words):
    _base(tmp_path)
    (tmp_path / name).write_text(text)
    line = _refused(["replay", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", name], tmp_path,
                    monkeypatch, capsys)
    assert words in line, line


def test_a_long_list_of_microbatch_counts_is_summarised(tmp_path, monkeypatch, capsys):
    from test_cli_bad_input import CPU_PLAN
    _base(tmp_path)
    pipelines = [CPU_PLAN["pipelines"][0] | {"microbatches": 4 + (j >= 150)} for j in range(200)]
    (tmp_path / "p.json").write_text(json.dumps(CPU_PLAN | {"pipelines": pipelines}))
    line = _refused(["launch", "p.json", "--backend", "torchrun", "--dry-run"], tmp_path, monkeypatch, capsys)
    assert line.endswith("p.json: pipelines: micro_batch_size 2 x microbatches [150 x 4, 50 x 5] = 1700 samples,"
                         " but the job's global batch is 8"), line


def test_summarize_counts():
    from sailor.plan.spec import summarize_counts
    assert summarize_counts([4, 4, 5]) == "[4, 4, 5]"
    assert summarize_counts([3] * 7 + [1]) == "[7 x 3, 1 x 1]"
    assert summarize_counts(list(range(1, 11))) == "[10 values, 1..10, sum 55]"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_profile_on_cpu_names_the_job_file_of_a_half_precision(tmp_path, monkeypatch, capsys, precision):
    from test_cli_bad_input import _write
    _base(tmp_path)
    _write(tmp_path, {"half.yaml": {"model": "tiny", "global_batch_size": 8, "precision": precision}})
    line = _refused(["profile", "--job", "half.yaml"], tmp_path, monkeypatch, capsys)
    assert f"half.yaml: precision: the runtime trains in fp32 on cpu, the job says {precision}" in line, line


# ---- Hugging Face configs: the key the user wrote, mixture-of-experts first, a folder beside the job
def _hf_folder(tmp_path: Path, monkeypatch, capsys, name: str) -> dict:
    """An exported tiny model (a gpt2 config.json and its weights) in tmp_path/name; its config."""
    _edited_checkpoint(tmp_path)
    code, _, err = _main(["export", "ck", "--to", name], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    return json.loads((tmp_path / name / "config.json").read_text())


def test_a_folder_beside_the_job_is_read_as_a_path(tmp_path, monkeypatch, capsys):
    from test_cli_bad_input import _write
    _base(tmp_path)
    (tmp_path / "jobs").mkdir()
    _hf_folder(tmp_path / "jobs", monkeypatch, capsys, "tiny-hf")
    _write(tmp_path, {"jobs/job.yaml": {"model": "tiny-hf", "global_batch_size": 8}})
    code, out, err = _main(["plan", "--job", "jobs/job.yaml", "--cluster", "gcp.yaml"], tmp_path, monkeypatch, capsys)
    assert code == 0 and out.startswith("tiny-hf (220,544 parameters), global batch 8"), (out, err)
    # beside the current folder but not beside the job: no "did you mean 'tiny'?", which would train another model
    _write(tmp_path, {"jobs/sub/job.yaml": {"model": "tiny-hf", "global_batch_size": 8}})
    monkeypatch.chdir(tmp_path / "jobs")
    line = _refused(["plan", "--job", "sub/job.yaml", "--cluster", "../local.yaml"], tmp_path / "jobs", monkeypatch,
                    capsys)
    assert "sub/job.yaml: model: unknown model 'tiny-hf': no built-in model has that name" in line, line
    assert "did you mean" not in line and "model: ./tiny-hf" in line, line


def test_a_builtin_name_that_is_also_a_folder_beside_the_job_is_ambiguous(tmp_path, monkeypatch, capsys):
    from test_cli_bad_input import _write
    _base(tmp_path)
    _hf_folder(tmp_path, monkeypatch, capsys, "tiny")
    line = _refused(["plan", "--job", "job.yaml", "--cluster", "local.yaml"], tmp_path, monkeypatch, capsys)
    assert "job.yaml: model: 'tiny' is both a built-in model and ./tiny beside the job file" in line, line
    _write(tmp_path, {"dot.yaml": {"model": "./tiny", "global_batch_size": 8}})
    code, _, err = _main(["plan", "--job", "dot.yaml", "--cluster", "gcp.yaml"], tmp_path, monkeypatch, capsys)
    assert code == 0, err


@pytest.mark.parametrize("edit, words", [
    (lambda c: c | {"n_layer": 10**6}, "config.json: n_layer: Input should be less than or equal to"),
    # a GPT-2 config renamed to a mixture of experts Sailor builds lacks that architecture's keys
    (lambda c: c | {"model_type": "mixtral"}, "config.json: hidden_size: missing (the mixtral config needs it)"),
    (lambda c: c | {"model_type": "qwen2_moe"}, "config.json: hidden_size: missing (the qwen2_moe config needs it)"),
    (lambda c: c | {"model_type": "dbrx"}, "config.json: model_type: 'dbrx' is a mixture-of-experts model Sailor does"),
    (lambda c: c | {"num_local_experts": 8}, ("config.json: num_local_experts: the config's expert fields"
                                              " (num_local_experts) make it a mixture-of-experts model, which a gpt2")),
    (lambda c: c | {"model_type": "mistral", "num_experts": 8, "num_experts_per_tok": 2},
     "config.json: num_experts: the config's expert fields (num_experts, num_experts_per_tok) make it a mixture-of"),
])
def test_hf_config_errors_name_the_key_and_the_real_reason(tmp_path, monkeypatch, capsys, edit, words):
    from test_cli_bad_input import _write
    _base(tmp_path)
    config = _hf_folder(tmp_path, monkeypatch, capsys, "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(edit(config)))
    _write(tmp_path, {"j.yaml": {"model": "hf/config.json", "global_batch_size": 8}})
    line = _refused(["plan", "--job", "j.yaml", "--cluster", "local.yaml"], tmp_path, monkeypatch, capsys)
    assert words in line and "did you mean" not in line, line


def test_a_llama_layer_count_names_num_hidden_layers():
    from sailor.model.hf_config import spec_from_hf
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 10**6,
              "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}
    with pytest.raises(SailorInputError, match=r"^c/config.json: num_hidden_layers: Input should be less") as e:
        spec_from_hf(config, source="c/config.json", name="x")
    assert "num_blocks" not in str(e.value)


def test_the_moe_mutation_reaches_the_mixture_of_experts_refusal(tmp_path):
    import random

    import mutate

    from sailor.model.hf_config import load_hf_config
    refused = 0
    for k in range(40):
        doc = mutate.moe_mutation(mutate.HF_LLAMA, mutate.RandomChooser(random.Random(k)))
        (tmp_path / f"{k}.json").write_text(json.dumps(doc))
        if doc["model_type"] in ("mixtral", "qwen2_moe", "qwen3_moe"):
            # a mixture of experts Sailor builds: the dense config lacks its expert count
            with pytest.raises(SailorInputError, match=rf"^{tmp_path}/{k}.json: num_(local_)?experts: missing"):
                load_hf_config(tmp_path / f"{k}.json")
            refused += 1
        elif set(doc) & set(mutate.MOE_EXTRA):
            with pytest.raises(SailorInputError, match=rf"^{tmp_path}/{k}.json: \S+: .* make it a mixture-of-experts model"):
                load_hf_config(tmp_path / f"{k}.json")
            refused += 1
    assert refused >= 10


def test_a_builtin_name_beside_a_folder_that_holds_no_config_is_the_builtin(tmp_path, monkeypatch, capsys):
    """`sailor train plan.json --checkpoint-dir tiny` leaves a folder named like the model."""
    _base(tmp_path)
    (tmp_path / "tiny").mkdir()
    code, out, err = _main(["plan", "--job", "job.yaml", "--cluster", "gcp.yaml"], tmp_path, monkeypatch, capsys)
    assert code == 0 and out.startswith("tiny ("), (out, err)
    assert ", global batch 8" in out.splitlines()[0]


def test_train_draws_no_progress_bar_off_a_terminal(capsys):
    from types import SimpleNamespace

    from rich.console import Console
    from test_cli_bad_input import CPU_PLAN

    from sailor.cli.train import _run_with_progress
    from sailor.plan import plan_from_dict
    from sailor.specs.job import JobSpec
    plan, job = plan_from_dict(CPU_PLAN), JobSpec(model="tiny", global_batch_size=8)
    prep = SimpleNamespace(plan=plan, job=job, resume_step=0, options=SimpleNamespace(steps=2))

    def launch(prep, on_event):
        on_event({"event": "step", "step": 1, "loss": 5.0, "tokens_per_s": 10.0, "mfu": 0.01, "tokens": 128,
                  "step_time_s": 0.5})
        return "result"
    assert _run_with_progress(prep, launch, Console(stderr=True), log_every=0) == "result"
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", ""), out


# ---- an output path that is one of the command's inputs ------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--out", "job.yaml"], "--out: job.yaml is the --job input"),
    (["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--out", "./sub/../local.yaml"],
     "--out: sub/../local.yaml is the --cluster input"),
    (["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--profiles", "profile.json", "--out", "profile.json"],
     "--out: profile.json is the --profiles input"),
    (["launch", "cpu_plan.json", "--backend", "kubernetes", "--out", "cpu_plan.json"],
     "--out: cpu_plan.json is the PLAN input"),
    (["launch", "sailor_plan.json", "--job", "job.yaml", "--backend", "kubernetes", "--out", "link.yaml"],
     "--out: link.yaml is the --job input"),
])
def test_an_output_that_is_an_input_is_refused(tmp_path, monkeypatch, capsys, args, words):
    """The file is named by another path (a relative detour, a symbolic link): still the input."""
    (tmp_path / "sub").mkdir()
    _base(tmp_path)
    (tmp_path / "link.yaml").symlink_to("job.yaml")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    line = _refused(args, tmp_path, monkeypatch, capsys)
    assert line == f"error: {words}", line
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_check_output_path_compares_with_every_input(tmp_path):
    from sailor.core.fileio import check_output_path, same_path
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "hard.txt").hardlink_to(tmp_path / "a.txt")
    assert same_path(tmp_path / "hard.txt", tmp_path / "a.txt")
    assert same_path(tmp_path / "new" / ".." / "x.npy", tmp_path / "x.npy")  # neither exists: resolved
    assert not same_path(tmp_path / "b.npy", tmp_path / "a.txt")
    with pytest.raises(SailorInputError, match=r"hard.txt is the INPUT input"):
        check_output_path(tmp_path / "hard.txt", "--out", inputs={"INPUT": [tmp_path / "z.txt", tmp_path / "a.txt"]})
    check_output_path(tmp_path / "b.txt", "--out", inputs={"INPUT": [tmp_path / "a.txt"], "--job": None})


def test_data_prepare_refuses_an_output_that_is_an_input(tmp_path):
    from sailor.runtime.dataprep import prepare_tokens
    (tmp_path / "docs.npy").write_text("not tokens")
    with pytest.raises(SailorInputError) as e:
        prepare_tokens([tmp_path / "docs.npy"], tokenizer=tmp_path / "tok.json", out=tmp_path / "docs.npy")
    assert e.value.one_line() == f"--out: {tmp_path / 'docs.npy'} is the INPUT input"
    assert (tmp_path / "docs.npy").read_text() == "not tokens"


# ---- a manifest's invalid model is named field by field, as an inline job model is --------------
@pytest.mark.parametrize("model, words", [
    ({"hidden_size": "wide"}, "model.hidden_size: Input should be a valid integer (got 'wide')"),
    ({"num_blocks": -1}, "model.num_blocks: Input should be greater than 0 (got -1)"),
    ({"colour": 1}, "model.colour: Extra inputs are not permitted (got 1)"),
])
def test_a_manifest_with_an_invalid_model_names_the_field(tmp_path, model, words):
    from sailor.runtime.checkpoint_io import check_model_matches_tensors
    from sailor.specs import load_job
    from test_cli_bad_input import JOB
    (tmp_path / "job.yaml").write_text(json.dumps(JOB))
    spec = load_job(tmp_path / "job.yaml").model.model_dump()
    with pytest.raises(SailorInputError) as e:
        check_model_matches_tensors(tmp_path, {"model": spec | model, "tensors": {}})
    line = e.value.one_line()
    assert line == f"{tmp_path / 'manifest.json'}: {words}", line
    assert "validation error" not in line
    # the same model inline in a job is named the same way
    (tmp_path / "bad.yaml").write_text(json.dumps(JOB | {"model": spec | model}))
    with pytest.raises(SailorInputError) as inline:
        load_job(tmp_path / "bad.yaml")
    assert inline.value.field == e.value.field and inline.value.message == e.value.message


# ---- a network file of another schema says so ----------------------------------------------------
def _network_refusal(tmp_path, monkeypatch, doc) -> str:
    """The one line `network_for` refuses `doc` with, written as n.json beside the local cluster c.json."""
    from sailor.perf.network_files import network_for
    from sailor.specs import load_cluster
    from test_cli_bad_input import LOCAL
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.json").write_text(json.dumps(LOCAL))
    (tmp_path / "n.json").write_text(json.dumps(doc))
    with pytest.raises(SailorInputError) as e:
        network_for(load_cluster("c.json"), "n.json")
    return e.value.one_line()


@pytest.mark.parametrize("doc, words", [
    ({"schema": "sailor.network/7"}, "n.json: schema: unknown schema 'sailor.network/7' (this Sailor reads"
                                     " 'sailor.network/1') (measure again with `sailor profile network`"),
    ({"schema": "sailor.network/7", "links": []}, "n.json: schema: unknown schema 'sailor.network/7'"),
    ({"schema": "sailor.profiles/1", "layers": []},
     "n.json: schema: unknown schema 'sailor.profiles/1' (this Sailor reads 'sailor.network/1') (that names a"
     " profile file: pass it with --profiles)"),
    ({"schema": "acme.net/2"}, "n.json: schema: unknown schema 'acme.net/2'"),
])
def test_a_network_file_of_another_schema_names_it(tmp_path, monkeypatch, doc, words):
    line = _network_refusal(tmp_path, monkeypatch, doc)
    assert line.startswith(words), line


# ---- a network file without its schema line says so (a newcomer's finding) -----------------------
_LINKS = {"classes": {"same_zone": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9}},
          "collective": {"startup_s": 1e-4}}
_ACCEPTED = ("--network takes our link file with \"schema\": \"sailor.network/1\" (`sailor profile network` writes"
             " it), a Sailor multizone_bandwidths*.json file (zone -> GPU type -> count -> ...) or a Sailor network"
             " folder")


@pytest.mark.parametrize("doc, line", [
    # our link file that lost its schema line: read as the published format, it was refused as
    # "classes: expected a mapping of GPU type -> count -> ..."
    (_LINKS, "n.json: no \"schema\" field, but our link file's fields (classes, collective) (add \"schema\":"
             " \"sailor.network/1\" as `sailor profile network` writes it)"),
    ({"local": {"cpu": 3}}, "n.json: not our link file (no \"schema\" field) and not a Sailor bandwidth file (local.cpu:"
                            f" expected a mapping of count -> zone -> ..., got int 3) ({_ACCEPTED})"),
    ([], f"n.json: not a network file ({_ACCEPTED})"),
])
def test_a_network_file_without_its_schema_line_says_so(tmp_path, monkeypatch, doc, line):
    from sailor.perf.network_files import network_for
    from sailor.specs import load_cluster
    got = _network_refusal(tmp_path, monkeypatch, doc)
    assert got == line, got
    (tmp_path / "ok.json").write_text(json.dumps({"schema": "sailor.network/1", **_LINKS}))
    assert network_for(load_cluster("c.json"), "ok.json").collective.startup_s == 1e-4  # with the line: read


def test_plan_with_a_link_file_without_schema_names_the_file(tmp_path, monkeypatch, capsys):
    _base(tmp_path)
    (tmp_path / "n.json").write_text(json.dumps(_LINKS))
    line = _refused(["plan", "--job", "job.yaml", "--cluster", "gcp.yaml", "--network", "n.json"],
                    tmp_path, monkeypatch, capsys)
    assert line.startswith("error: n.json: no \"schema\" field, but our link file's fields"), line


# ---- a bad value is quoted as the file spells it (a newcomer's finding: None, True) -------------
@pytest.mark.parametrize("value, words", [(None, "got null"), (True, "got true"), (False, "got false"),
                                          ([None, True], "got [null, true]"), ({"s": None}, "got {'s': null}")])
def test_bad_values_are_quoted_as_json_spells_them(tmp_path, monkeypatch, value, words):
    """The collective entry of a link file (where the backend's figures sit) quoted JSON's null and
    true as Python's None and True; `core.errors.show`, which every such message uses, spells them
    as the file does."""
    from sailor.core.errors import show
    from sailor.perf.network_files import network_for
    from sailor.specs import load_cluster
    from test_cli_bad_input import LOCAL
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.json").write_text(json.dumps(LOCAL))
    (tmp_path / "n.json").write_text(json.dumps({"schema": "sailor.network/1", "collective": {"startup_s": value}}))
    with pytest.raises(SailorInputError) as e:
        network_for(load_cluster("c.json"), "n.json")
    assert e.value.one_line() == f"n.json: collective.startup_s: expected a number of seconds, {words}"
    assert (show(1), show(0), show("null"), show(1.5)) == ("1", "0", "'null'", "1.5")  # only null, true, false change


def test_plan_with_a_profile_as_network_names_the_schema(tmp_path, monkeypatch, capsys):
    _base(tmp_path)
    line = _refused(["plan", "--job", "job.yaml", "--cluster", "gcp.yaml", "--network", "profile.json"],
                    tmp_path, monkeypatch, capsys)
    assert line.startswith("error: profile.json: schema: unknown schema 'sailor.profiles/1'"), line


# ---- testbed up: a quota past this machine's cores names the testbed file ------------------------
def test_testbed_quotas_past_the_machine_name_the_file(tmp_path, monkeypatch, capsys):
    """examples/testbed.yaml asks 4 x 0.3 + 2 x 0.15 = 1.5 cores for its ranks (their
    communication threads have no limit); a 1-core machine cannot host it.
    `check_support` (root, ip, tc) is taken as passed: the refusal comes before anything is made."""
    import sailor.testbed.host as host
    from sailor.testbed import load_testbed
    (tmp_path / "tb.yaml").write_text((ROOT / "examples" / "testbed.yaml").read_text())
    monkeypatch.setattr(host, "check_support", lambda: None)
    monkeypatch.setattr(host.os, "cpu_count", lambda: 1)
    line = _refused(["testbed", "up", "tb.yaml", "--state-dir", str(tmp_path / "state")], tmp_path, monkeypatch,
                    capsys)
    assert line == ("error: tb.yaml: devices: the quotas of ranks and communication add up to 1.5 cores, more"
                    " than the 1 of this machine (smaller cpu_quota or comm_cpu_quota, or fewer ranks)"), line
    monkeypatch.setattr(host.os, "cpu_count", lambda: 2)
    host.check_cores(load_testbed(tmp_path / "tb.yaml"), "tb.yaml")  # 1.5 of 2 cores: accepted


# ---- help into a pipe whose reader has left: status 0, as other output ---------------------------
class _ReaderGone:
    """A standard output whose reader has left: every write and flush raises EPIPE (what Python
    raises on a closed pipe, SIGPIPE being ignored). `fileno` is a scratch file's, for main's dup2."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, text: str) -> int:
        import errno
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def flush(self) -> None:
        self.write("")

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return False


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["testbed", "up", "--help"], []])
def test_help_into_a_closed_pipe_ends_quietly_with_status_0(tmp_path, monkeypatch, capsys, args):
    """`sailor --help | head -1`: rich's own Console would exit 1; typer's help goes through the
    same ending as `console()` (sailor.cli.common.pipe_safe_help)."""
    import os
    import sys

    from sailor.cli import main
    fd = os.open(tmp_path / "stdout", os.O_WRONLY | os.O_CREAT)
    try:
        monkeypatch.setattr(sys, "argv", ["sailor", *args])
        monkeypatch.setattr(sys, "stdout", _ReaderGone(fd))
        with pytest.raises(SystemExit) as e:
            main()
    finally:
        os.close(fd)
    assert e.value.code == 0
    assert capsys.readouterr().err == ""


# ---- wording: expert fields of a dense config, a config without model_type, an empty folder ------
def test_wording_of_expert_fields_missing_model_type_and_an_empty_profiles_folder(tmp_path):
    import mutate

    from sailor.model.hf_config import load_hf_config
    from sailor.perf.profiles import load_profiles
    from sailor.specs.job import JobSpec
    (tmp_path / "moe.json").write_text(json.dumps(mutate.HF_LLAMA | {"num_local_experts": 8}))
    with pytest.raises(SailorInputError) as e:
        load_hf_config(tmp_path / "moe.json")
    assert e.value.one_line().startswith(
        f"{tmp_path}/moe.json: num_local_experts: the config's expert fields (num_local_experts) make it a"
        " mixture-of-experts model, which a llama config cannot be"), e.value.one_line()
    assert "mixtral" in e.value.one_line()  # the fix names the architectures that have them
    (tmp_path / "untyped.json").write_text(json.dumps({k: v for k, v in mutate.HF_LLAMA.items() if k != "model_type"}))
    with pytest.raises(SailorInputError) as e:
        load_hf_config(tmp_path / "untyped.json")
    assert e.value.one_line().startswith(f"{tmp_path}/untyped.json: model_type: missing"), e.value.one_line()
    assert "None" not in e.value.one_line()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SailorInputError) as e:
        load_profiles(tmp_path / "empty", JobSpec(model="tiny", global_batch_size=8))
    assert e.value.one_line() == f"{tmp_path}/empty: folder holds no profiles_tmp.json (Sailor format)"


# ---- profile network --hosts ---------------------------------------------------------------------
def test_profile_network_between_hosts_needs_the_cluster_and_two_machines(tmp_path, monkeypatch, capsys):
    (tmp_path / "hosts.yaml").write_text("groups:\n- {zone: us-central1-a, gpu: A100-40, hosts: [10.0.0.1]}\n")
    (tmp_path / "c.yaml").write_text("provider: gcp\nzones: {us-central1-a: {A100-40: 1}}\ngpus_per_node: {A100-40: 1}\n")
    line = _refused(["profile", "network", "--hosts", "hosts.yaml"], tmp_path, monkeypatch, capsys)
    assert line == "error: --cluster: --hosts needs the cluster spec the machines belong to", line
    line = _refused(["profile", "network", "--hosts", "hosts.yaml", "--cluster", "c.yaml"], tmp_path, monkeypatch, capsys)
    assert line == ("error: hosts.yaml: groups: one machine of one GPU per node has no link to measure (list two"
                    " machines, or machines of two groups)"), line
    line = _refused(["profile", "network", "--hosts", "hosts.yaml", "--cluster", "c.yaml", "--out", "c.yaml"], tmp_path,
                    monkeypatch, capsys)
    assert line == "error: --out: c.yaml is the --cluster input", line
    line = _refused(["profile", "network", "--port", "29600"], tmp_path, monkeypatch, capsys)
    assert line == "error: --port: only with --hosts (the links between machines)", line
