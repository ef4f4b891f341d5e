"""Every command on bad input (issue 13): exit status 2, exactly one stderr line, no traceback, no
output file left behind; and the guards behind it (launch and workers check plans, no silent data
loss, settings that take effect or are refused, output paths checked before work, internal errors as
one line). Commands run in-process through `sailor.cli.main`; a few through the console script."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import mutate
import pytest
import yaml
from mutate import RandomChooser, dump, mutate_text, mutate_tree

from sailor.core.errors import SailorInputError
from sailor.core.limits import MAX_GLOBAL_BATCH, MAX_PIPELINE_TASKS

assert 22 * MAX_GLOBAL_BATCH > MAX_PIPELINE_TASKS  # the unbounded-simulation case below goes past the limit

SAILOR = Path(sys.executable).with_name("sailor")
JOB = {"model": "tiny", "global_batch_size": 8}
LOCAL = {"provider": "local", "zones": {"local": {"cpu": 4}}}
CPU_REP = {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}
CPU_PLAN = {"micro_batch_size": 2, "stages": [[0, 3], [3, 6]],
            "pipelines": [{"microbatches": 4, "replicas": [CPU_REP, CPU_REP | {"stage": 1}]}], "job": JOB}
LOCAL_TRACE = [{"time_s": 0, "zone": "local", "gpu": "cpu", "count": 2},
               {"time_s": 5, "zone": "local", "gpu": "cpu", "count": 4}]
LOCAL_HOSTS = {"groups": [{"zone": "local", "gpu": "cpu", "gpus_per_node": 4, "hosts": ["127.0.0.1"]}]}


def _write(folder: Path, files: dict[str, bytes | str | dict | list]) -> None:
    for name, content in files.items():
        p = folder / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, (dict, list)):
            content = dump(content, "yaml" if name.endswith(".yaml") else "json")
        p.write_bytes(content if isinstance(content, bytes) else content.encode())


def _base(folder: Path) -> None:
    """Valid inputs of every command, in `folder`."""
    _write(folder, {"job.yaml": JOB, "local.yaml": LOCAL, "gcp.yaml": mutate.GCP, "cpu_plan.json": CPU_PLAN,
                    "gcp_plan.json": mutate.PLAN, "sailor_plan.json": mutate.SAILOR_PLAN, "trace.json": LOCAL_TRACE,
                    "hosts.yaml": LOCAL_HOSTS, "profile.json": mutate.PROFILE, "network.json": mutate.OUR_NETWORK,
                    "runs-tiny/plan_config_a.json": mutate.SAILOR_PLAN})


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def _main(args: list[str], cwd: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    from sailor.cli import main
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["sailor", *args])
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def _refused(args: list[str], cwd: Path, monkeypatch, capsys) -> str:
    """Run a command that must refuse its input: exit 2, one `error:` line, no traceback, and no
    file created in `cwd` (outputs are named under out/). Returns the line."""
    before = _files(cwd)
    code, _, err = _main(args, cwd, monkeypatch, capsys)
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert _files(cwd) == before, _files(cwd) - before
    return lines[0]


# ---- a sample of mutated inputs through every command -------------------------------------------------
def _mutants(doc, fmt: str, refused, n: int, seed: str) -> list[bytes]:
    """Up to `n` mutants of `doc` (as file bytes) that `refused(bytes)` says the library refuses."""
    rng, out = random.Random(seed), []
    c = RandomChooser(rng)
    for _ in range(40 * n):
        data = dump(mutate_tree(doc, c), fmt) if c.pick([0, 1, 1]) else mutate_text(dump(doc, fmt), fmt, c)
        if refused(data):
            out.append(data)
            if len(out) == n:
                break
    return out


def _refuses(read, suffix: str):
    """A predicate: does the library reader `read(path)` refuse these bytes?"""
    import tempfile

    def check(data: bytes) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / f"input{suffix}"
            p.write_bytes(data)
            try:
                read(p)
            except SailorInputError:
                return True
        return False
    return check


def _read_job(p):
    from sailor.specs import load_job
    return load_job(p)


def _read_cluster(p):
    from sailor.specs import load_cluster
    return load_cluster(p)


def _read_plan(p):
    from sailor.plan import load_plan
    from sailor.runtime.validate import check_plan_for_job
    plan = load_plan(p)
    check_plan_for_job(plan, plan.job, plan.cluster, source=str(p))


def _read_plan_to_simulate(p):
    # what `sailor simulate PLAN [--job job.yaml]` checks: the plan, its job (or job.yaml's) and cluster
    from sailor.cli.common import resolve_specs
    from sailor.plan import load_plan
    from sailor.specs.job import JobSpec
    plan = load_plan(p)
    if plan.job is None:
        plan = plan.with_specs(JobSpec.model_validate(JOB), plan.cluster)
    job, cluster = resolve_specs(plan, None, None)
    plan.check_against(job, cluster)


def _read_trace(p):
    from sailor.elastic.availability import load_trace
    from sailor.specs.cluster import ClusterSpec
    load_trace(p, ClusterSpec.model_validate(LOCAL))


def _read_hosts(p):
    from sailor.launch.hosts import load_hosts
    load_hosts(p)


def _read_profile(p):
    from sailor.perf.profiles import load_profiles
    from sailor.specs.job import JobSpec
    load_profiles(p, JobSpec(model="tiny", global_batch_size=8))


def _read_network(p):
    from sailor.perf.network_files import network_for
    from sailor.specs.cluster import ClusterSpec
    network_for(ClusterSpec.model_validate(mutate.GCP), p)


def _read_run(p):
    from sailor.simulator.fidelity import load_runs
    d = p.parent / "runs-tiny"
    d.mkdir()
    p.rename(d / "plan_config_a.json")
    load_runs(d)


# (command line with {X} for the mutated file X, the file it replaces, its seed, format, reader)
COMMANDS = [
    ("plan", ["plan", "--job", "{}", "--cluster", "local.yaml", "--out", "out/plan.json", "--report", "out/rep"],
     ".yaml", JOB, "yaml", _read_job),
    ("plan", ["plan", "--job", "job.yaml", "--cluster", "{}", "--out", "out/plan.json"], ".yaml", mutate.GCP, "yaml",
     _read_cluster),
    ("simulate", ["simulate", "{}", "--report", "out/rep", "--json"], ".json", mutate.PLAN, "json",
     _read_plan_to_simulate),
    ("simulate", ["simulate", "{}", "--job", "job.yaml", "--json"], ".json", mutate.SAILOR_PLAN | {"gbs": 8}, "json",
     _read_plan_to_simulate),
    ("simulate", ["simulate", "gcp_plan.json", "--profiles", "{}", "--json"], ".json", mutate.PROFILE, "json",
     _read_profile),
    ("simulate", ["simulate", "gcp_plan.json", "--network", "{}", "--json"], ".json", mutate.OUR_NETWORK, "json",
     _read_network),
    ("train", ["train", "{}", "--dry-run", "--metrics", "out/m.jsonl", "--checkpoint-dir", "out/ck"], ".json",
     CPU_PLAN, "json", _read_plan),
    ("train", ["train", "cpu_plan.json", "--job", "{}", "--dry-run"], ".yaml", JOB, "yaml", _read_job),
    ("launch", ["launch", "{}", "--backend", "torchrun", "--dry-run", "--out", "out/docs.yaml"], ".json", CPU_PLAN,
     "json", _read_plan),
    ("launch", ["launch", "cpu_plan.json", "--backend", "torchrun", "--hosts", "{}", "--dry-run"], ".yaml",
     LOCAL_HOSTS, "yaml", _read_hosts),
    ("run", ["run", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "{}", "--steps", "2",
             "--events", "out/e.jsonl", "--metrics", "out/m.jsonl", "--checkpoint-dir", "out/ck"], ".json",
     LOCAL_TRACE, "json", _read_trace),
    ("run", ["run", "--job", "{}", "--cluster", "local.yaml", "--availability", "trace.json", "--steps", "2",
             "--checkpoint-dir", "out/ck"], ".yaml", JOB, "yaml", _read_job),
    ("replay", ["replay", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "{}", "--plot",
                "out/x.png"], ".json", LOCAL_TRACE, "json", _read_trace),
    ("validate", ["validate", "runs-tiny", "--profiles", "profile.json"], ".json", mutate.SAILOR_PLAN, "json", _read_run),
    ("profile", ["profile", "--job", "{}", "--out", "out/p.json"], ".yaml", JOB, "yaml", _read_job),
]
PER_COMMAND = 5


def _cases():
    for k, (cmd, args, suffix, doc, fmt, read) in enumerate(COMMANDS):
        for i, data in enumerate(_mutants(doc, fmt, _refuses(read, suffix), PER_COMMAND, seed=f"cli-{k}")):
            yield pytest.param(args, suffix, data, id=f"{cmd}-{k}-{i}")


@pytest.mark.parametrize("args, suffix, data", list(_cases()))
def test_every_command_refuses_mutated_input_in_one_line(tmp_path, monkeypatch, capsys, args, suffix, data):
    _base(tmp_path)
    if args[0] == "validate":
        (tmp_path / "runs-tiny" / "plan_config_a.json").write_bytes(data)
    else:
        (tmp_path / f"bad{suffix}").write_bytes(data)
    mutate.TRIED["cli:" + args[0]] += 1
    _refused([a.replace("{}", f"bad{suffix}") for a in args], tmp_path, monkeypatch, capsys)


def test_the_sample_reaches_every_command():
    cases = list(_cases())
    assert {c.values[0][0] for c in cases} == {c[0] for c in COMMANDS}
    assert len(cases) >= PER_COMMAND * len(COMMANDS) - 3  # nearly every pair found its mutants


# ---- the issue's classes, one by one ---------------------------------------------------------------
BAD = [
    # unbounded work: a global batch beyond any real job
    ({"job.yaml": {"model": "tiny", "global_batch_size": 10**9}}, ["plan", "--job", "job.yaml", "--cluster", "local.yaml"],
     f"global_batch_size: Input should be less than or equal to {MAX_GLOBAL_BATCH}"),
    ({"job.yaml": {"model": "tiny", "global_batch_size": 10**30}}, ["plan", "--job", "job.yaml", "--cluster", "local.yaml"],
     "less than or equal to"),
    ({"big.json": {"micro_batch_size": 1, "stages": [[i, i + 1] for i in range(22)],
                   "pipelines": [{"microbatches": MAX_GLOBAL_BATCH, "replicas": [CPU_REP | {"stage": i} for i in range(22)]}],
                   "job": {"model": {"name": "deep", "num_blocks": 20, "hidden_size": 64, "num_heads": 4,
                                     "vocab_size": 256, "max_sequence_length": 64},
                           "global_batch_size": MAX_GLOBAL_BATCH}},
      "l32.yaml": {"provider": "local", "zones": {"local": {"cpu": 32}}}},
     ["simulate", "big.json", "--cluster", "l32.yaml"],
     f"a pipeline of 22 stages running {MAX_GLOBAL_BATCH} micro-batches is {22 * MAX_GLOBAL_BATCH:,} tasks per iteration"),
    # interleaving: every chunk's passes count (11 stages x 2 chunks), before the machine is profiled
    ({"big.json": {"micro_batch_size": 1, "stages": [[i, i + 1] for i in range(22)],
                   "schedule": {"kind": "interleaved-1f1b", "virtual_stages": 2},
                   "pipelines": [{"microbatches": MAX_GLOBAL_BATCH, "replicas": [CPU_REP | {"stage": i} for i in range(11)]}],
                   "job": {"model": {"name": "deep", "num_blocks": 20, "hidden_size": 64, "num_heads": 4,
                                     "vocab_size": 256, "max_sequence_length": 64},
                           "global_batch_size": MAX_GLOBAL_BATCH}},
      "l32.yaml": {"provider": "local", "zones": {"local": {"cpu": 32}}}},
     ["simulate", "big.json", "--cluster", "l32.yaml"],
     f"a pipeline of 11 stages x 2 chunks running {MAX_GLOBAL_BATCH} micro-batches is {22 * MAX_GLOBAL_BATCH:,} tasks"),
    # NaN and infinities
    ({"c.yaml": "provider: local\nzones: {local: {cpu: 4}}\nprices: {cpu: .nan}\n"},
     ["plan", "--job", "job.yaml", "--cluster", "c.yaml"], "prices.cpu: must be a finite number, got .nan"),
    ({"c.json": '{"provider": "local", "zones": {"local": {"cpu": 4}}, "prices": {"cpu": Infinity}}'},
     ["plan", "--job", "job.yaml", "--cluster", "c.json"], "Infinity is not a number JSON allows"),
    ({}, ["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--max-cost-per-hour", "nan"],
     "--max-cost-per-hour: must be a finite positive number, got nan"),
    ({}, ["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--max-cost-per-hour", "0"],
     "--max-cost-per-hour: must be a finite positive number, got 0"),
    ({}, ["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--max-cost-per-iteration", "-1"],
     "--max-cost-per-iteration: must be a finite positive number, got -1"),
    ({}, ["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--min-throughput", "-inf"],
     "--min-throughput: must be a finite non-negative number, got -inf"),
    # the option's name, not the planner's field (time_limit_s)
    ({}, ["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--time-limit", "0"],
     "error: --time-limit: must be a finite positive number, got 0"),
    ({}, ["run", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "trace.json", "--time-scale", "inf"],
     "--time-scale: expected a finite number"),
    # a node size for a GPU type no zone offers (ignored without a word before)
    ({"c.yaml": "provider: local\nzones: {local: {cpu: 4}}\ngpus_per_node: {cpu: 4, V100-16: 8}\n"},
     ["plan", "--job", "job.yaml", "--cluster", "c.yaml"],
     "c.yaml: gpus_per_node.V100-16: the cluster offers no V100-16 in any zone (its GPU types: cpu)"),
    # a flag pair where the last would win silently
    ({}, ["run", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "trace.json", "--in-place",
          "--restart"], "--in-place: given with --restart"),
    ({}, ["run", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "trace.json", "--restart",
          "--in-place"], "--in-place: given with --restart"),
    ({"t.csv": "Timestamp,cpu_local\n0,4\n60,nan\n"},
     ["replay", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "t.csv"], "line 3.cpu_local"),
    # deep nesting, odd keys, odd encodings, duplicate keys in a trace
    ({"deep.json": "[" * 100000 + "]" * 100000}, ["simulate", "deep.json"], "nested deeper than"),
    ({"c.yaml": "provider: local\nzones:\n  ? [a, b]\n  : {cpu: 4}\n"}, ["plan", "--job", "job.yaml", "--cluster",
                                                                          "c.yaml"], "a key must be a name"),
    ({"c.yaml": "provider: local\nzones:\n  local: {1: 4}\n"}, ["plan", "--job", "job.yaml", "--cluster", "c.yaml"],
     "key '1' is read as a number"),
    ({"t.json": '[{"time_s": 0, "zone": "local", "gpu": "cpu", "count": 4, "count": 2}]'},
     ["replay", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "t.json"], "key 'count' appears twice"),
    # the set's only run (a second, usable one would leave this one a warning and go on)
    ({"runs-tiny/plan_config_a.json": b'{"mbs": 1, "gbs": 8, "real": 1.0, "max_mem": 1e9, "note": "\xff"}'},
     ["validate", "runs-tiny", "--profiles", "profile.json"], "plan_config_a.json: not UTF-8 text"),
    # Sailor plan_config import
    ({"s.json": mutate.SAILOR_PLAN | {"mbs": 0}}, ["simulate", "s.json", "--job", "job.yaml"], "mbs: must be a whole"),
    ({"s.json": mutate.SAILOR_PLAN | {"mbs": 4.7}}, ["simulate", "s.json", "--job", "job.yaml"], "got 4.7"),
    ({"s.json": mutate.SAILOR_PLAN | {"gbs": 1024.9}}, ["simulate", "s.json", "--job", "job.yaml"], "got 1024.9"),
    ({"s.json": json.loads(json.dumps(mutate.SAILOR_PLAN).replace('"A100-40"', '"B200"'))},
     ["simulate", "s.json", "--job", "job.yaml"], "unknown GPU type 'B200'"),
    ({"s.json": json.loads(json.dumps(mutate.SAILOR_PLAN).replace('"us-central1-a"', '"mars-1"'))},
     ["simulate", "s.json", "--job", "job.yaml"], "unknown gcp zone 'mars-1'"),
    ({"s.json": json.loads(json.dumps(mutate.SAILOR_PLAN).replace('4, "us', '0, "us'))},
     ["simulate", "s.json", "--job", "job.yaml"], "0.0.1: must be a whole number from 1"),
    # output paths checked before the work
    ({"afile": "x"}, ["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--out", "afile/plan.json"],
     "--out: afile is a file"),
    ({"afile": "x"}, ["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--report", "afile/rep"],
     "--report: afile is a file"),
    ({"afile": "x"}, ["simulate", "gcp_plan.json", "--report", "afile/rep"], "--report: afile is a file"),
    ({"afile": "x"}, ["replay", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "trace.json",
                      "--plot", "afile/x.png"], "--plot: afile is a file"),
    ({"afile": "x"}, ["launch", "cpu_plan.json", "--backend", "torchrun", "--dry-run", "--out", "afile/d.yaml"],
     "--out: afile is a file"),
    ({"afile": "x"}, ["profile", "network", "--nproc", "2", "--out", "afile/n.json"], "--out: afile is a file"),
    # settings accepted but ignored
    ({"c.yaml": "provider: local\nzones: {local: {cpu: 4}}\ngpus_per_node: {cpu: true}\n"},
     ["plan", "--job", "job.yaml", "--cluster", "c.yaml"], "gpus_per_node.cpu: Input should be a valid integer"),
    ({"j.yaml": "model: {name: x, num_blocks: true, hidden_size: 64, num_heads: 4, vocab_size: 256,"
                " max_sequence_length: 64}\nglobal_batch_size: 8\n"},
     ["plan", "--job", "j.yaml", "--cluster", "local.yaml"], "model.num_blocks: Input should be a valid integer"),
    ({}, ["train", "cpu_plan.json", "--timeout-s", "0", "--dry-run"], "--timeout-s: must be a number of seconds > 0"),
    ({}, ["train", "cpu_plan.json", "--timeout-s", "-1", "--dry-run"], "--timeout-s"),
    # launch trusts no plan
    ({"p.json": CPU_PLAN | {"stages": [[0, 3], [3, 5]]}}, ["launch", "p.json", "--backend", "torchrun", "--dry-run"],
     "stages: stages cover layers [0, 5) but tiny has 6 layers"),
    ({"p.json": CPU_PLAN | {"micro_batch_size": 3}}, ["launch", "p.json", "--backend", "kubernetes", "--dry-run"],
     "but the job's global batch is 8"),
    ({"p.json": {k: v for k, v in CPU_PLAN.items() if k != "job"}},
     ["launch", "p.json", "--backend", "torchrun", "--dry-run"], "p.json: the plan carries no job"),
    ({"p.json": CPU_PLAN | {"pipelines": [{"microbatches": 4, "replicas": [CPU_REP | {"tp": 4}, CPU_REP | {"stage": 1}]}]},
      "h.yaml": {"groups": [{"zone": "local", "gpu": "cpu", "gpus_per_node": 2, "hosts": ["a", "b"]}]}},
     ["launch", "p.json", "--backend", "torchrun", "--hosts", "h.yaml", "--dry-run"],
     "h.yaml: groups.0.gpus_per_node: replica 0 of pipeline 0 has TP 4, but cpu machines hold 2 GPUs"),
    # unbounded local processes
    ({}, ["profile", "network", "--nproc", "1000000"], "--nproc: 1000000 processes, more than this machine can run"),
    # a container image that is no image reference (it would be written into the manifests as it is)
    ({}, ["launch", "cpu_plan.json", "--backend", "kubernetes", "--image", "foo bar;rm -rf /", "--dry-run"],
     "--image: 'foo bar;rm -rf /' is not a container image reference"),
    ({}, ["launch", "cpu_plan.json", "--backend", "skypilot", "--image", "UPPER/Case", "--out", "sky", "--dry-run"],
     "is not a container image reference"),
    # unbounded steps
    ({}, ["train", "cpu_plan.json", "--steps", str(10**20), "--dry-run"], "--steps: must be between 1 and"),
    # a file where a checkpoint folder belongs
    ({"ck.txt": "not a checkpoint"}, ["export", "ck.txt", "--to", "hf"], "ck.txt: is a file, expected a checkpoint folder"),
]


def test_an_output_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """Permission bits do not tell (root, /proc, read-only mounts): the check creates a file."""
    import errno
    import tempfile

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    _base(tmp_path)
    line = _refused(["simulate", "cpu_plan.json", "--report", "rep"], tmp_path, monkeypatch, capsys)
    assert line.endswith("--report: cannot write in . (Read-only file system)"), line


def test_export_without_safetensors_says_which_package(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else real(name, *a))
    _base(tmp_path)
    line = _refused(["export", "ck", "--to", "hf"], tmp_path, monkeypatch, capsys)
    assert "`sailor export` needs safetensors, which is not installed" in line, line


@pytest.mark.parametrize("files, args, words", BAD, ids=[f"{b[1][0]}-{i}" for i, b in enumerate(BAD)])
def test_issue_cases_are_one_line(tmp_path, monkeypatch, capsys, files, args, words):
    _base(tmp_path)
    _write(tmp_path, files)
    line = _refused(args, tmp_path, monkeypatch, capsys)
    assert words in line, line


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_profile_on_cpu_names_the_job_file_of_a_half_precision(tmp_path, monkeypatch, capsys, precision):
    """`sailor train` names the job file for a precision the CPU does not train in; `sailor profile`
    used to give the field alone."""
    _base(tmp_path)
    _write(tmp_path, {"half.yaml": JOB | {"precision": precision}})
    line = _refused(["profile", "--job", "half.yaml", "--mbs", "1", "--out", "out/p.json"], tmp_path, monkeypatch, capsys)
    assert line.startswith(f"error: half.yaml: precision: the runtime trains in fp32 on cpu, the job says {precision}")


def test_profile_refuses_a_bad_out_before_measuring(tmp_path, monkeypatch, capsys):
    import sailor.runtime.profiler as profiler

    def measure(*a, **k):
        raise AssertionError("measured before checking --out")
    monkeypatch.setattr(profiler, "profile_job", measure)
    _base(tmp_path)
    _write(tmp_path, {"afile": "x"})
    line = _refused(["profile", "--job", "job.yaml", "--out", "afile/p.json"], tmp_path, monkeypatch, capsys)
    assert "--out: afile is a file" in line


def test_a_trace_offering_more_processes_than_the_machine_runs(tmp_path, monkeypatch, capsys):
    _base(tmp_path)
    _write(tmp_path, {"t.json": [{"time_s": 0, "zone": "local", "gpu": "cpu", "count": 100000}]})
    line = _refused(["run", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "t.json"], tmp_path,
                    monkeypatch, capsys)
    assert "the trace offers up to 100000 GPUs, each a process on this machine" in line


# ---- no silent data loss --------------------------------------------------------------------------
def _checkpoint(root: Path, step: int, job: dict, seed: int, moments: bool = True) -> None:
    """A real, verified checkpoint folder (what a worker writes) of `job` trained with `seed`; after
    step 0 with the Adam moments unless `moments` is False (weights alone, as a conversion writes)."""
    import torch

    from sailor.runtime import checkpoint as ckpt
    from sailor.runtime.checkpoint_io import write_checkpoint
    from sailor.runtime.model import param_shapes
    from sailor.specs.job import JobSpec

    keys = ["param", *ckpt.OPTIMIZER_KEYS] if step > 0 and moments else ["param"]
    spec = JobSpec.model_validate(job)
    write_checkpoint(root, step, ckpt.run_meta(spec, seed),
                     {n: {k: torch.zeros(shape) for k in keys} for n, shape in param_shapes(spec.model).items()})


def test_train_refuses_a_folder_holding_another_run(tmp_path, monkeypatch, capsys):
    _base(tmp_path)
    _checkpoint(tmp_path / "ck", 3, JOB, seed=0)
    line = _refused(["train", "cpu_plan.json", "--checkpoint-dir", "ck", "--steps", "5"], tmp_path, monkeypatch, capsys)
    assert "ck holds the checkpoints of a run (step-00000003); this run would replace them" in line
    assert "pass --resume" in line
    assert (tmp_path / "ck" / "step-00000003" / "manifest.json").exists()  # nothing was touched


@pytest.mark.parametrize("extra, words", [
    (["--seed", "1"], "the checkpoint was written with seed 0, this run has 1"),
    (["--job", "other.yaml"], "written by a job with sequence_length 64, this run's job has 32"),
])
def test_resume_with_another_seed_or_job_is_refused(tmp_path, monkeypatch, capsys, extra, words):
    _base(tmp_path)
    _write(tmp_path, {"other.yaml": JOB | {"sequence_length": 32}})
    _checkpoint(tmp_path / "ck", 3, JOB, seed=0)
    line = _refused(["train", "cpu_plan.json", "--checkpoint-dir", "ck", "--resume", "--steps", "5", "--dry-run",
                     *extra], tmp_path, monkeypatch, capsys)
    assert words in line, line


def test_resume_of_the_same_run_goes_on(tmp_path, monkeypatch, capsys):
    _base(tmp_path)
    _checkpoint(tmp_path / "ck", 3, JOB, seed=0)
    code, out, err = _main(["train", "cpu_plan.json", "--checkpoint-dir", "ck", "--resume", "--steps", "5", "--dry-run"],
                           tmp_path, monkeypatch, capsys)
    assert code == 0 and "resuming from" in err and "(step 3)" in err, err


def test_resume_with_only_damaged_checkpoints_is_refused_and_keeps_them(tmp_path, monkeypatch, capsys):
    """Starting over would replace the damaged checkpoint once the run reached its step."""
    _base(tmp_path)
    _checkpoint(tmp_path / "ck", 3, JOB, seed=0)
    f = tmp_path / "ck" / "step-00000003" / "rank-00000.bin"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    line = _refused(["train", "cpu_plan.json", "--checkpoint-dir", "ck", "--resume", "--steps", "5", "--dry-run"],
                    tmp_path, monkeypatch, capsys)
    assert "--resume: no verified checkpoint in ck (" in line and "checksum mismatch" in line, line
    assert f.read_bytes() == bytes(data)  # kept as it was
    # an empty folder is a first run: it starts from step 0
    code, _, err = _main(["train", "cpu_plan.json", "--checkpoint-dir", "empty", "--resume", "--steps", "5", "--dry-run"],
                         tmp_path, monkeypatch, capsys)
    assert code == 0 and "starting from step 0" in err, err


def test_resume_from_weights_alone_after_step_0_is_refused(tmp_path, monkeypatch, capsys):
    """A step-3 checkpoint without Adam moments used to pass every check and stop rank 0 on an
    AssertionError (exit 1; `sailor run` counted it as a crash of the GPUs)."""
    _base(tmp_path)
    _checkpoint(tmp_path / "ck", 3, JOB, seed=0, moments=False)
    line = _refused(["train", "cpu_plan.json", "--checkpoint-dir", "ck", "--resume", "--steps", "5", "--dry-run"],
                    tmp_path, monkeypatch, capsys)
    assert "ck/step-00000003/manifest.json: keys: the checkpoint of step 3 holds the weights alone" in line, line
    assert "--init-from" in line


@pytest.mark.parametrize("count, words", [(0, "this machine has no CUDA device (or this torch is a CPU build)"),
                                           (1, "this machine has 1 CUDA device (")])
def test_train_cuda_on_too_few_gpus_names_no_cpu_way_out(tmp_path, monkeypatch, capsys, count, words):
    """A plan of A100s under --device cuda on a machine with fewer GPUs: the line used to say "run it
    with --device cpu", which refuses any plan of GPU types other than cpu."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    _base(tmp_path)
    rep = {"stage": 0, "gpu": "A100-40", "zone": "us-central1-a", "tp": 1}
    _write(tmp_path, {"a100.json": CPU_PLAN | {"pipelines": [{"microbatches": 4,
                                                              "replicas": [rep, rep | {"stage": 1}]}]}})
    line = _refused(["train", "a100.json", "--device", "cuda", "--steps", "1", "--dry-run"], tmp_path, monkeypatch, capsys)
    assert line.startswith(f"error: a100.json: the plan has 2 ranks but {words}"), line
    assert "--device cpu" not in line and "sailor launch" in line, line


NO_KERNELS = ("--device: the installed torch has no kernels for Tesla V100-SXM2-16GB (sm_70; it has sm_75 sm_80"
              " sm_90); install a build that does: pip install torch==2.13.0 --index-url"
              " https://download.pytorch.org/whl/cu126")


def _refusing_rank(prep, on_event=None, **kw):
    """A stand-in for `launch`: rank 0 refused its GPU (the error event `worker._report` emits for a
    SailorInputError), rank 1 then lost its peer; torchrun printed its failure report."""
    from sailor.runtime.launcher import TrainResult, finish_result

    events = [{"event": "error", "rank": 1, "error": "DistError: Connection closed by peer", "peer_lost": True},
              {"event": "error", "rank": 0, "error": f"SailorInputError: {NO_KERNELS}", "peer_lost": False}]
    for ev in events:
        if on_event:
            on_event(ev)
    tail = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\nRoot Cause (first observed failure):\n"
    return finish_result(TrainResult(status=None, message="", events=events), 1, 0, tail)


def test_a_rank_refusing_its_gpu_is_bad_input_in_one_line(tmp_path, monkeypatch, capsys):
    """README "GPU": a rank whose torch has no kernels for its GPU stops with one line naming the build
    (exit 2); it used to be 'training failed (...)' after torchrun's report, exit 1."""
    import sailor.runtime.launcher as launcher

    monkeypatch.setattr(launcher, "launch", _refusing_rank)
    _base(tmp_path)
    code, _, err = _main(["train", "cpu_plan.json", "--steps", "1"], tmp_path, monkeypatch, capsys)
    assert code == 2, err
    assert err.splitlines()[-1] == f"error: rank 0: {NO_KERNELS}", err  # after the progress bar's line
    assert err.count("error:") == 1 and "ChildFailedError" not in err, err


def _machine_stand_in(monkeypatch) -> None:
    """`sailor run` on the local provider measures this machine first (`runtime.machine`): a unit
    test stands in for the measurement (it starts processes) with blocks of 1 ms forward, 2 ms back."""
    from sailor.runtime import machine

    def measure(job, threads, tp, replicas):
        n = job.model.num_layers
        return {"schema": "sailor.profiles/1", "model": job.model.name, "sequence_length": job.seq,
                "precision": job.precision, "layers": [{"gpu": "cpu", "tp": tp, "mbs": b, "forward_s": [1e-3 * b] * n,
                                                        "backward_s": [2e-3 * b] * n} for b in machine.QUICK_MBS]}

    monkeypatch.setattr(machine, "_measure", measure)


def test_sailor_run_stops_when_a_rank_refuses_its_gpu(tmp_path, monkeypatch, capsys):
    """Every relaunch would be refused the same way: `sailor run` ends with the rank's line, exit 2,
    instead of counting a crash and taking the GPUs away. (On the restart path, whose launches are
    stood in for here: a unit test starts no process.)"""
    from sailor.elastic import launches

    _machine_stand_in(monkeypatch)
    monkeypatch.setattr(launches, "launch", _refusing_rank)
    _base(tmp_path)
    code, _, err = _main(["run", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "trace.json",
                          "--steps", "2", "--events", "out/ev.jsonl", "--restart"], tmp_path, monkeypatch, capsys)
    assert code == 2, err
    assert err.splitlines()[-1] == f"error: rank 0: {NO_KERNELS}", err
    assert "crash" not in err, err


@pytest.mark.parametrize("command", [["launch", "cpu_plan.json", "--backend", "torchrun", "--dry-run"]])
def test_checkpoint_every_without_a_folder_is_refused(tmp_path, monkeypatch, capsys, command):
    """--checkpoint-every without --checkpoint-dir saved nothing and said nothing (`sailor train` has a
    default folder: `test_train_checkpoints_by_default`)."""
    _base(tmp_path)
    line = _refused([*command, "--steps", "4", "--checkpoint-every", "2"], tmp_path, monkeypatch, capsys)
    assert line.startswith("error: --checkpoint-every: every 2 steps, but there is no --checkpoint-dir"), line


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_run_on_cpu_names_the_job_file_of_a_half_precision(tmp_path, monkeypatch, capsys, precision):
    """`sailor run` used to plan first and then name its own temporary plan file (plan-3.json)."""
    _base(tmp_path)
    _write(tmp_path, {"half.yaml": JOB | {"precision": precision}})
    line = _refused(["run", "--job", "half.yaml", "--cluster", "local.yaml", "--availability", "trace.json",
                     "--steps", "2"], tmp_path, monkeypatch, capsys)
    assert line.startswith(f"error: half.yaml: precision: the runtime trains in fp32 on cpu, the job says {precision}")


@pytest.mark.parametrize("command, source", [
    (["plan", "--job", "half.yaml", "--cluster", "local.yaml"], "half.yaml"),
    (["simulate", "cpu_plan.json", "--job", "half.yaml"], "half.yaml"),
    (["simulate", "half_plan.json"], "half_plan.json"),
])
def test_plan_and_simulate_on_local_name_the_file_of_a_half_precision(tmp_path, monkeypatch, capsys, command, source):
    """Measuring this machine for a bf16 job is refused; the line used to give the field alone."""
    _base(tmp_path)
    _write(tmp_path, {"half.yaml": JOB | {"precision": "bf16"},
                      "half_plan.json": CPU_PLAN | {"job": JOB | {"precision": "bf16"}}})
    line = _refused(command, tmp_path, monkeypatch, capsys)
    assert line.startswith(f"error: {source}: precision: the runtime trains in fp32 on cpu, the job says bf16"), line


def test_run_with_only_damaged_checkpoints_names_its_own_option(tmp_path, monkeypatch, capsys):
    """`sailor run` resumes from --checkpoint-dir on its own; its line used to name `--resume`, an
    option it does not have."""
    _base(tmp_path)
    _machine_stand_in(monkeypatch)
    _checkpoint(tmp_path / "ck", 3, JOB, seed=0)
    f = tmp_path / "ck" / "step-00000003" / "rank-00000.bin"
    f.write_bytes(b"\xff" + f.read_bytes()[1:])
    code, _, err = _main(["run", "--job", "job.yaml", "--cluster", "local.yaml", "--availability", "trace.json",
                          "--checkpoint-dir", "ck", "--steps", "5"], tmp_path, monkeypatch, capsys)
    line = err.splitlines()[-1]
    assert code == 2 and line.startswith("error: --checkpoint-dir: no verified checkpoint in"), err
    assert "--resume" not in line and "rank-00000.bin: checksum mismatch" in line, line


@pytest.mark.parametrize("field, value, words", [
    ("step", -1, "manifest.json: step: -1 is not a whole number >= 0"),
    ("keys", ["param", "exp_avg"], "manifest.json: keys: ['param', 'exp_avg'] is neither"),
    ("tensors", {"layers.0.weight": [2, 0]}, "manifest.json: tensors.layers.0.weight: [2, 0] is not a shape"),
    ("format", "sailor-checkpoint-9", "manifest.json: format: unknown format 'sailor-checkpoint-9'"),
    ("ranks", {}, "manifest.json: ranks: not a non-empty mapping"),
    ("loss_scaler", {"scale": 0.0, "clean_steps": 0, "skipped": 0}, "manifest.json: loss_scaler.scale: 0.0 is not"),
    ("loss_scaler", {"scale": 2.0, "clean_steps": -1}, "manifest.json: loss_scaler.clean_steps: -1 is not"),
    ("loss_scaler", {"scale": 2.0, "growth": 3}, "manifest.json: loss_scaler: {'scale': 2.0, 'growth': 3} is not"),
])
def test_resume_names_the_malformed_manifest_field(tmp_path, monkeypatch, capsys, field, value, words):
    """The manifest is not hashed: a hand-edited field is refused naming the file and the field."""
    _base(tmp_path)
    _checkpoint(tmp_path / "ck", 3, JOB, seed=0)
    m = tmp_path / "ck" / "step-00000003" / "manifest.json"
    m.write_text(json.dumps(json.loads(m.read_text()) | {field: value}))
    line = _refused(["train", "cpu_plan.json", "--checkpoint-dir", "ck", "--resume", "--steps", "5", "--dry-run"],
                    tmp_path, monkeypatch, capsys)
    assert "--resume: no verified checkpoint in ck (" in line and words in line, line


# ---- warnings and internal errors are one line -----------------------------------------------------
def test_uneven_sailor_plan_is_spread_and_said_in_one_line(tmp_path, monkeypatch, capsys):
    _base(tmp_path)
    _write(tmp_path, {"s.json": mutate.SAILOR_PLAN | {"gbs": 9}, "j.yaml": JOB | {"global_batch_size": 9}})
    code, out, err = _main(["simulate", "s.json", "--job", "j.yaml", "--json"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert err.splitlines() == ["warning: s.json: gbs: gbs 9 / mbs 1 = 9 micro-batches do not split evenly over 2"
                                " pipelines: spread as evenly as possible, 1 x 5 and 1 x 4"]
    assert json.loads(out)["gpus"] == 8


def test_validate_skips_a_bad_run_in_one_line(tmp_path, monkeypatch, capsys):
    _base(tmp_path)
    _write(tmp_path, {"runs-tiny/plan_config_b.json": b'{"mbs": 1, "gbs": 8, "real": 1.0, "max_mem": 1e9, "note": "\xff"}'})
    code, _, err = _main(["validate", "runs-tiny", "--profiles", "profile.json", "--network", "network.json"], tmp_path,
                         monkeypatch, capsys)
    assert code == 0, err
    assert err.splitlines() == ["warning: skipped: runs-tiny/plan_config_b.json: not UTF-8 text (byte 0xff at offset 59)"
                                " (save it as UTF-8)"]


def test_an_internal_error_is_one_line_with_the_traceback_in_a_file(tmp_path, monkeypatch, capsys):
    import sailor.cli.plan

    def broken(*a, **k):
        raise RuntimeError("boom\nsecond line")
    monkeypatch.setattr(sailor.cli.plan, "plan_job", broken)
    monkeypatch.setenv("SAILOR_TRACEBACK_DIR", str(tmp_path / "tb"))
    _base(tmp_path)
    code, _, err = _main(["plan", "--job", "job.yaml", "--cluster", "local.yaml", "--profiles", "profile.json", "--json"],
                         tmp_path, monkeypatch, capsys)  # --profiles: no note of profiling this machine first
    lines = err.splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: internal error (RuntimeError: boom\\nsecond line); traceback saved to ")
    saved = Path(lines[0].split("traceback saved to ")[1].split(";")[0])
    assert saved.parent == tmp_path / "tb" and "Traceback" in saved.read_text() and "boom" in saved.read_text()


# ---- the real entry point ---------------------------------------------------------------------------
def _console(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    if not SAILOR.exists():
        pytest.skip(f"console script {SAILOR} is not installed (pip install -e .)")
    return subprocess.run([str(SAILOR), *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("files, args, words", [
    ({"c.yaml": "provider: local\nzones: {local: {cpu: .inf}}\n"}, ["plan", "--job", "job.yaml", "--cluster", "c.yaml"],
     "zones.local.cpu: must be a finite number, got .inf"),
    ({"deep.json": "[" * 100000 + "]" * 100000}, ["simulate", "deep.json"], "nested deeper than"),
    ({"runs-tiny/plan_config_a.json": b"\xff\xfe{}"}, ["validate", "runs-tiny", "--profiles", "profile.json"],
     "not UTF-8 text"),
])
@pytest.mark.integration
def test_console_script_refuses_in_one_line(tmp_path, files, args, words):
    _base(tmp_path)
    _write(tmp_path, files)
    r = _console(args, tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.integration
def test_console_internal_error_is_one_line(tmp_path):
    # A bug anywhere (here: the planner raising ZeroDivisionError) ends in one line and exit 1.
    _base(tmp_path)
    code = ("import sys, sailor.cli.plan as p; p.plan_job = lambda *a, **k: 1 / 0; from sailor.cli import main;"
            " sys.argv = ['sailor', 'plan', '--job', 'job.yaml', '--cluster', 'local.yaml', '--profiles', 'profile.json'];"
            " main()")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SAILOR_TRACEBACK_DIR": str(tmp_path / "tb")})
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "internal error (ZeroDivisionError: division by zero)" in r.stderr
    assert len(list((tmp_path / "tb").glob("sailor-traceback-*.txt"))) == 1


# ---- every worker checks before its first step -----------------------------------------------------
def _worker(tmp_path: Path, plan: dict, env: dict) -> subprocess.CompletedProcess:
    (tmp_path / "p.json").write_text(json.dumps(plan))
    return subprocess.run([sys.executable, "-m", "sailor.runtime.worker", "--plan", str(tmp_path / "p.json"),
                           "--steps", "1"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": "1", **env})


@pytest.mark.parametrize("plan, env, words", [
    (CPU_PLAN, {"WORLD_SIZE": "3"}, "torchrun started 3 ranks but the plan has 2"),
    (CPU_PLAN | {"stages": [[0, 3], [3, 5]]}, {"WORLD_SIZE": "2"}, "stages cover layers [0, 5) but tiny has 6 layers"),
    (CPU_PLAN | {"micro_batch_size": 1}, {"WORLD_SIZE": "2"}, "the job's global batch is 8"),
    ({k: v for k, v in CPU_PLAN.items() if k != "job"}, {"WORLD_SIZE": "2"}, "the plan carries no job"),
])
@pytest.mark.integration
def test_a_worker_checks_plan_job_and_world_size_before_its_first_step(tmp_path, plan, env, words):
    r = _worker(tmp_path, plan, env)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and words in r.stderr, r.stderr
    events = [json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines() if line.startswith("SAILOR_EVENT ")]
    assert [e["event"] for e in events] == ["joined", "error"] and words in events[1]["error"]


# ---- settings take effect ---------------------------------------------------------------------------
@pytest.mark.integration
def test_same_node_link_of_a_local_cluster_takes_effect(tmp_path, monkeypatch, capsys):
    _base(tmp_path)
    slow = LOCAL | {"network": {"same_node": {"latency_s": 0.5, "bandwidth_bytes_per_s": 1000.0}}}
    _write(tmp_path, {"slow.yaml": slow})
    times = []
    for cluster in ("local.yaml", "slow.yaml"):
        code, out, err = _main(["simulate", "cpu_plan.json", "--cluster", cluster, "--json"], tmp_path, monkeypatch,
                               capsys)
        assert code == 0, err
        times.append(json.loads(out)["breakdown"]["pipeline"])
    # 4 micro-batches cross the one stage boundary forward and backward: at least 2 x 4 x 0.5 s more
    assert times[1] >= times[0] + 4.0


def test_hosts_file_node_size_is_used_not_the_plans_tp(tmp_path, monkeypatch, capsys):
    _base(tmp_path)
    _write(tmp_path, {"h.yaml": {"groups": [{"zone": "local", "gpu": "cpu", "gpus_per_node": 1,
                                             "hosts": ["a", "b", "c"]}]}})
    code, out, err = _main(["launch", "cpu_plan.json", "--backend", "torchrun", "--hosts", "h.yaml", "--dry-run",
                            "--steps", "10"],
                           tmp_path, monkeypatch, capsys)
    assert code == 0, err
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert sorted(d["host"] for d in docs) == ["a", "b"]  # TP 1 on nodes of 1 GPU: one machine per stage


@pytest.mark.integration
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_output_on_a_full_disk_is_one_line_not_an_internal_error():
    """`--json > /dev/full`: writing stdout fails with ENOSPC; one error line, exit 1, no traceback file."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([str(SAILOR), "plan", "--json"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.splitlines() == ["error: the output could not be written: No space left on device"]



def test_an_output_that_is_a_fifo_is_refused_not_replaced(tmp_path, monkeypatch, capsys):
    """An atomic write renames onto its target: onto a FIFO (or, as root, a device such as /dev/full)
    that would replace it with a file."""
    _base(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    line = _refused(["plan", "--out", "fifo"], tmp_path, monkeypatch, capsys)
    assert "fifo is not a regular file (a device, FIFO or socket)" in line, line
    assert (tmp_path / "fifo").is_fifo()


def test_a_symlinked_output_writes_its_target_and_keeps_the_link(tmp_path, monkeypatch, capsys):
    _base(tmp_path)
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    code, _, err = _main(["plan", "--out", "link.json"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert (tmp_path / "link.json").is_symlink() and json.loads((tmp_path / "real.json").read_text())["stages"]


@pytest.mark.integration
def test_closed_stdout_is_one_line():
    r = subprocess.run([str(SAILOR), "plan", "--json"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=120, preexec_fn=lambda: os.close(1))
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["error: stdout: standard output is closed; redirect it (>/dev/null to discard it)"]


def test_resume_refuses_a_manifest_whose_step_is_not_its_folders(tmp_path, monkeypatch, capsys):
    """The manifest is not hashed: a step edited in it must not move the run's step counter."""
    _base(tmp_path)
    _checkpoint(tmp_path / "ck", 2, JOB, seed=0)
    m = tmp_path / "ck" / "step-00000002" / "manifest.json"
    m.write_text(m.read_text().replace('"step": 2', '"step": 9'))
    line = _refused(["train", "cpu_plan.json", "--checkpoint-dir", "ck", "--resume", "--steps", "5", "--dry-run"],
                    tmp_path, monkeypatch, capsys)
    assert "its manifest says step 9" in line, line
