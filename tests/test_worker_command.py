"""The worker's one command builder (sailor.runtime.command): every launch path puts the user's
training settings into every rank's command, read back with torchrun's parser and then the worker's
own; settings -> argv -> settings is the identity. Unit tests: no process is started (the CLI runs
in-process through typer's CliRunner, and the generated shell is read with shlex, not run)."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from test_launch import GEO, GEO_JOB, GEO_K8S, _opts
from typer.testing import CliRunner

from sailor.cli import _register, app
from sailor.core.errors import SailorInputError
from sailor.core.limits import MAX_SECONDS, MAX_STEPS
from sailor.launch import Backend, KubernetesOptions, launch_specs
from sailor.launch.common import RESUME_VAR, launch_layout
from sailor.launch.skypilot import SkyPilotOptions
from sailor.runtime.command import WorkerSettings, parse
from sailor.runtime.prepare import TrainOptions, worker_settings

SHELL_OPERATORS = {"&", "&&", ";", ";;", "|", "||"}
LAUNCHER = ["-m", "sailor.runtime.launcher"]


def _agent_argvs(script: str) -> list[list[str]]:
    """The arguments after `python -m sailor.runtime.launcher` (torchrun's) of every agent in a
    generated shell script, up to the next shell operator; scripts nested in a word (`bash -c '...'`)
    are read too."""
    words = shlex.split(script)
    out = []
    for i, word in enumerate(words):
        if " " in word and "sailor.runtime.launcher" in word:
            out += _agent_argvs(word)
        elif words[i - 1:i + 1] == LAUNCHER:
            rest = words[i + 1:]
            out.append(rest[:next((k for k, w in enumerate(rest) if w in SHELL_OPERATORS), len(rest))])
    return out


def _scripts(backend: Backend, docs: list[dict]) -> list[str]:
    """The shell scripts of a backend's documents: per node (torchrun), per task (SkyPilot), per pod
    template (Kubernetes)."""
    if backend is Backend.TORCHRUN:
        return [d["command"] for d in docs]
    if backend is Backend.SKYPILOT:
        return [d["run"] for d in docs]
    (js,) = [d for d in docs if d["kind"] == "JobSet"]
    return [r["template"]["spec"]["template"]["spec"]["containers"][0]["command"][-1]
            for r in js["spec"]["replicatedJobs"]]


def _rank_settings(backend: Backend, docs: list[dict]) -> list[WorkerSettings]:
    """Every agent's worker settings: its command parsed by torchrun's own parser, then the training
    script's arguments by the worker's. The one shell expansion allowed among them is the newest
    checkpoint a restarted JobSet resumes from."""
    run = pytest.importorskip("torch.distributed.run", reason="torch is not installed (pip install 'sailor-train[train]')")
    out = []
    for argv in (a for script in _scripts(backend, docs) for a in _agent_argvs(script)):
        args = run.get_args_parser().parse_args(argv)
        assert args.module and args.training_script == "sailor.runtime.worker"
        worker = [a for a in args.training_script_args if not a.startswith("${")]
        expansions = [a for a in args.training_script_args if a.startswith("${")]
        assert expansions in ([], [f"${{{RESUME_VAR}:+--resume-from=${RESUME_VAR}}}"]), expansions
        out.append(parse(worker))
    return out


TRAINING = {"--steps": "7", "--seed": "1234", "--data": "/data/tokens.bin", "--init-from": "/weights/opt-350m",
            "--checkpoint-dir": "/ck", "--checkpoint-every": "5", "--metrics": "/ck/metrics.jsonl", "--log-every": "3",
            "--tensorboard": "/ck/tb", "--timeout-s": "90"}
WANT = WorkerSettings(plan="/etc/sailor/plan.json", steps=7, seed=1234, device="cuda", data="/data/tokens.bin",
                      init_from="/weights/opt-350m", checkpoint_dir="/ck", checkpoint_every=5,
                      metrics="/ck/metrics.jsonl", log_every=3, tensorboard="/ck/tb", timeout_s=90.0)


@pytest.mark.parametrize("backend", list(Backend))
def test_launch_dry_run_gives_every_rank_the_training_settings(tmp_path, backend):
    plan = tmp_path / "plan.json"
    (GEO_K8S if backend is Backend.KUBERNETES else GEO).with_specs(GEO_JOB, None).save(plan)  # one region on Kubernetes
    remote = "plan.json" if backend is Backend.SKYPILOT else "/etc/sailor/plan.json"
    extra = {Backend.KUBERNETES: ["--checkpoint-claim", "ck"],
             Backend.SKYPILOT: ["--checkpoint-bucket", "gs://ck-bucket", "--out", str(tmp_path / "sky")]}.get(backend, [])
    _register()
    r = CliRunner().invoke(app, ["launch", str(plan), "--backend", backend.value, "--dry-run", "--remote-plan",
                                 remote, *[x for kv in TRAINING.items() for x in kv], *extra])
    assert r.exit_code == 0, r.output
    ranks = _rank_settings(backend, list(yaml.safe_load_all(r.stdout)))
    assert len(ranks) == len(launch_layout(GEO).agents)  # one command per torchrun agent, none missed
    assert all(s == dataclasses.replace(WANT, plan=remote) for s in ranks), {str(s) for s in ranks}


def test_launch_passes_what_train_passes():
    """The gap the old launch builder had (no data, seed or initial weights; every torchrun, SkyPilot
    and Kubernetes run trained the built-in corpus from random weights): the settings `sailor train`
    gives its ranks reach every rank of a launch, field by field."""
    train = worker_settings(TrainOptions(plan="/etc/sailor/plan.json", steps=7, seed=1234, device="cuda",
                                         data="/data/tokens.bin", init_from="/weights/opt-350m", checkpoint_dir="/ck",
                                         checkpoint_every=5, metrics="/ck/metrics.jsonl", log_every=3,
                                         tensorboard="/ck/tb", timeout_s=90))
    assert train == WANT  # absolute already: `absolute()` leaves them as they are
    opts = _opts("/etc/sailor/plan.json", steps=7)
    plain = _rank_settings(Backend.TORCHRUN, launch_specs(GEO, Backend.TORCHRUN, opts))
    assert {s.data for s in plain} == {None}  # none given: the worker's default corpus, said by its absence
    sky = dataclasses.replace(train, plan="plan.json")  # in the tasks' working directory
    launched = _rank_settings(Backend.SKYPILOT, launch_specs(GEO, Backend.SKYPILOT, dataclasses.replace(opts, worker=sky),
                                                             sky=SkyPilotOptions(checkpoint_bucket="gs://ck-bucket")))
    assert launched and all(s == sky for s in launched)


def test_a_restarted_jobset_resumes_through_the_same_option():
    opts = _opts("/etc/sailor/plan.json", checkpoint_dir="/ck")
    docs = launch_specs(GEO_K8S, Backend.KUBERNETES, opts, k8s=KubernetesOptions(checkpoint_claim="ck"))
    scripts = _scripts(Backend.KUBERNETES, docs)
    assert all(f'"--resume-from=${RESUME_VAR}"' in s for s in scripts)
    assert all(s.resume_from is None and s.checkpoint_dir == "/ck" for s in _rank_settings(Backend.KUBERNETES, docs))


@pytest.mark.parametrize("option, path", [("--metrics", "/logs/m.jsonl"), ("--tensorboard", "/ck/../tb")])
def test_kubernetes_refuses_outputs_lost_with_the_pod(option, path):
    name = option[2:]
    opts = _opts("/etc/sailor/plan.json", checkpoint_dir="/ck", **{name: path})
    with pytest.raises(SailorInputError, match=f"{option}: {path} would be in a pod's own file system"):
        launch_specs(GEO_K8S, Backend.KUBERNETES, opts, k8s=KubernetesOptions(checkpoint_claim="ck"))


# Text a command line can carry (no NUL, no lone surrogates), including values that start with "-".
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
PATH = st.none() | TEXT.filter(str.strip)  # an empty path is refused (test below)
FIELDS = {
    "plan": TEXT.filter(str.strip), "steps": st.integers(1, MAX_STEPS), "job": PATH, "seed": st.integers(0, 2**70),
    "device": st.sampled_from(["cpu", "cuda"]), "data": PATH, "init_from": PATH, "checkpoint_dir": PATH,
    "checkpoint_every": st.integers(0, MAX_STEPS), "resume_from": PATH, "metrics": PATH,
    "log_every": st.integers(0, MAX_STEPS), "tensorboard": PATH, "stop_file": PATH,
    "timeout_s": st.floats(0, MAX_SECONDS, exclude_min=True) | st.integers(1, int(MAX_SECONDS)),
}


def test_the_round_trip_covers_every_setting():
    assert set(FIELDS) == {f.name for f in dataclasses.fields(WorkerSettings)}


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries(FIELDS))
def test_settings_argv_parse_round_trip(values):
    s = WorkerSettings(**values)
    argv = s.argv()
    assert argv[:2] == ["-m", "sailor.runtime.worker"]
    assert parse(argv[2:]) == s


@pytest.mark.parametrize("args, match", [
    (["--plan=p", "--steps=0"], "--steps: must be between 1 and"),
    (["--plan=p", "--steps=3", "--seed=-1"], "--seed: must be >= 0, got -1"),
    (["--plan=p", "--steps=3", "--log-every=-2"], "--log-every: must be between 0 and"),
    (["--plan=p", "--steps=3", "--timeout-s=nan"], "--timeout-s: must be a number of seconds > 0"),
    (["--plan=p", "--steps=3", "--device=tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--plan=p", "--steps=3", "--sed=1"], "unrecognized arguments: --sed=1"),
    (["--plan=p"], "the following arguments are required: --steps"),
    (["--plan=p", "--steps=3", "--data="], "--data: is an empty path"),
    (["--plan=p", "--steps=3", "--init-from= "], "--init-from: is an empty path"),
])
def test_the_worker_refuses_bad_arguments_in_one_line(args, match):
    with pytest.raises(SailorInputError, match=match) as e:
        parse(args)
    assert "\n" not in e.value.one_line()


@pytest.mark.parametrize("backend", list(Backend))
def test_launch_takes_the_job_of_a_plan_that_carries_none(tmp_path, backend):
    # a plan without its job (Sailor's plan_config has none) launches with --job; every rank gets it:
    # by path (torchrun) or inside the plan: its ConfigMap (kubernetes), the working directory (skypilot)
    plan, job = tmp_path / "plan.json", tmp_path / "job.yaml"
    (GEO_K8S if backend is Backend.KUBERNETES else GEO).save(plan)
    job.write_text(yaml.safe_dump(GEO_JOB.to_dict()))
    _register()
    base = ["launch", str(plan), "--backend", backend.value, "--dry-run", "--remote-plan",
            "plan.json" if backend is Backend.SKYPILOT else "/etc/sailor/plan.json", "--steps", "10"]
    if backend is Backend.SKYPILOT:
        base += ["--out", str(tmp_path / "sky")]
    r = CliRunner().invoke(app, base)  # in-process: `sailor.cli.main` turns this error into one line, exit 2
    assert isinstance(r.exception, SailorInputError) and "the plan carries no job" in str(r.exception)
    r = CliRunner().invoke(app, [*base, "--job", str(job)])
    assert r.exit_code == 0, r.output
    docs = list(yaml.safe_load_all(r.stdout))
    ranks = _rank_settings(backend, docs)
    if backend is Backend.KUBERNETES:
        (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
        assert json.loads(config["data"]["plan.json"])["job"] == GEO_JOB.to_dict()
        assert {s.job for s in ranks} == {None}
    elif backend is Backend.SKYPILOT:  # the plan in the working directory carries it
        assert json.loads((tmp_path / "sky" / "plan.json").read_text())["job"] == GEO_JOB.to_dict()
        assert {s.job for s in ranks} == {None}
    else:
        assert {s.job for s in ranks} == {str(job.resolve())}
