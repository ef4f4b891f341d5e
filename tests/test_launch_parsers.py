"""Generated launch files read by the tools that will read them, offline.

- SkyPilot (`pip install skypilot`): each task file through the function `sky launch` builds its task
  with (`sky.client.cli.command._make_task_or_dag_from_entrypoint_with_overrides`), `sky.Task.from_yaml`
  and the chain / job-group loaders of `sky.utils.dag_utils`.
- Kubernetes (`pip install kubernetes-validate`): `kubernetes-validate --strict` against its newest
  Kubernetes version, for every built-in kind. The JobSet is a CRD whose schema no PyPI package ships:
  each replicated job's template is validated strictly as the batch/v1 Job the JobSet controller
  creates from it (name `<jobset>-<replicated job>-0`), and the JobSet's own fields are checked here
  against the v1alpha2 API (jobset.sigs.k8s.io, `api/jobset/v1alpha2/jobset_types.go`).
- torchrun: the generated shell is run with bash, with `--python` a stand-in that records its argv,
  and every recorded command is parsed by `torch.distributed.run.get_args_parser()`; torchrun's rank
  assignment from the parsed values must give each plan rank exactly once.
Each test skips, saying which package to install, when its tool is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_launch import GEO, GEO_K8S, HOSTS, _check_torchrun_ranks, _opts, _write_hosts

from sailor.launch import Backend, KubernetesOptions, launch_files, launch_specs
from sailor.launch.skypilot import SkyPilotOptions
from sailor.plan import load_plan, plan_from_dict
from sailor.runtime.command import WorkerSettings, parse

INSTALL = "pip install 'sailor-train[launch-check]'"


def _stand_in_python(tmp_path: Path) -> tuple[str, Path]:
    """An executable that records (argv, CUDA_VISIBLE_DEVICES) as one JSON line and exits 0."""
    calls = tmp_path / "calls.jsonl"
    exe = tmp_path / "bin" / "python3"
    exe.parent.mkdir(exist_ok=True)
    exe.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                   f"open({str(calls)!r}, 'a').write(json.dumps([sys.argv[1:], os.environ.get('CUDA_VISIBLE_DEVICES')])"
                   " + '\\n')\n")
    exe.chmod(0o755)
    return str(exe), calls


def _bash(script: str, env: dict[str, str], cwd: Path | None = None) -> None:
    if shutil.which("bash") is None:
        pytest.skip("needs bash to run the generated scripts")
    r = subprocess.run(["bash", "-c", script], env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True,
                       timeout=60, cwd=cwd)
    assert r.returncode == 0, r.stderr


def _torchrun_args(calls: Path) -> list[tuple[argparse.Namespace, str | None]]:
    """Every recorded launcher command parsed by torchrun's own parser, with its CUDA_VISIBLE_DEVICES."""
    run = pytest.importorskip("torch.distributed.run", reason="torch is not installed (pip install 'sailor-train[train]')")
    out = []
    for argv, cvd in (json.loads(line) for line in calls.read_text().splitlines()):
        assert argv[:2] == ["-m", "sailor.runtime.launcher"]  # which runs torch.distributed.run.main(argv[2:])
        out.append((run.get_args_parser().parse_args(argv[2:]), cvd))
    return out


def _worker_settings(calls: Path) -> list[WorkerSettings]:
    """The worker's settings in every recorded command: torchrun's parser, then the worker's own."""
    return [parse(args.training_script_args) for args, _cvd in _torchrun_args(calls)]


def _torchrun_agents(calls: Path, endpoint: str, plan: str = "/etc/sailor/plan.json"
                     ) -> list[tuple[int, int, int, str | None, str]]:
    """Every recorded launcher command parsed by torchrun's own parser, as `_check_torchrun_ranks` wants."""
    out = []
    for args, cvd in _torchrun_args(calls):
        assert args.rdzv_backend == "static" and args.rdzv_endpoint == endpoint and args.max_restarts == 0
        assert args.module and args.training_script == "sailor.runtime.worker"
        assert parse(args.training_script_args).plan == plan
        out.append((int(args.nnodes), args.node_rank, int(args.nproc_per_node), cvd, args.rdzv_conf))
    return out


def _ranks_once(agents, plan=GEO) -> None:
    _check_torchrun_ranks([(n, r, p, cvd, "") for n, r, p, cvd, _conf in agents], plan)


# ---- SkyPilot ----------------------------------------------------------------------------------
@pytest.fixture
def sky():
    return pytest.importorskip("sky", reason=f"SkyPilot is not installed ({INSTALL})")


def _sky_files(tmp_path: Path, **kwargs) -> Path:
    """`sailor launch --out` of GEO with checkpoints in a bucket: the tasks' working directory."""
    out = tmp_path / "sky"
    opts = _opts("plan.json", steps=3, checkpoint_dir="/ckpt", **kwargs)
    sky = SkyPilotOptions(workdir=str(out), checkpoint_bucket="gs://team-ck/opt350")
    for name, data in launch_files(GEO, Backend.SKYPILOT, opts, sky=sky).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data.encode() if isinstance(data, str) else data)
    return out


@pytest.mark.integration
def test_skypilot_loads_each_task_as_sky_launch_does(tmp_path, sky):
    from sky.client.cli import command
    from sky.data import storage
    from sky.utils import dag_utils

    out = _sky_files(tmp_path)
    files = sorted(out.glob("*.yaml"))
    zones = ["us-central1-a", "us-central1-b", "us-west1-b"]
    for k, path in enumerate(files):
        env = [("SAILOR_RDZV_HOST", "10.128.0.7")] if k else []
        task = command._make_task_or_dag_from_entrypoint_with_overrides((str(path),), env=env)
        assert isinstance(task, sky.Task), f"`sky launch` would refuse {path.name}: {task}"  # a Dag is refused
        (res,) = task.resources
        assert (str(res.cloud), res.region, res.zone) == ("GCP", zones[k].rsplit("-", 1)[0], zones[k])
        assert res.ports is None  # nothing opened
        assert task.workdir == str(out)  # synced to every node: the plan and Sailor's source in it
        # installs the synced source tree, named by path: nothing is looked up on a package index
        assert task.setup == "python3 -m pip install --quiet './sailor-train[train]'"
        # the checkpoint folder: one bucket, mounted on every node of every group
        assert not task.file_mounts and set(task.storage_mounts) == {"/ckpt"}
        mount = task.storage_mounts["/ckpt"]
        assert (mount.source, mount.mode) == ("gs://team-ck/opt350", storage.StorageMode.MOUNT)
        assert res.accelerators == ({"A100": 8} if k == 0 else {"V100": 8 if k == 1 else 2})
        assert not dag_utils.is_job_group_yaml(str(path))
        assert len(dag_utils.load_chain_dag_from_yaml(str(path), env_overrides=env).tasks) == 1
        if k == 0:
            assert sky.Task.from_yaml(str(path)).num_nodes == 2
        else:  # the rendezvous host is required: refused before anything is provisioned
            with pytest.raises(ValueError, match="Environment variable 'SAILOR_RDZV_HOST' is None"):
                sky.Task.from_yaml(str(path))


@pytest.mark.integration
def test_skypilot_places_groups_of_three_providers_as_sky_launch_does(tmp_path, sky):
    """A plan across GCP, AWS and Azure: each task file loads as `sky launch` loads it, on its own
    cloud, region and zone (Azure: region only, SkyPilot has no Azure zones)."""
    from sky.client.cli import command

    def rep(stage: int, gpu: str, zone: str) -> dict:
        return {"stage": stage, "gpu": gpu, "zone": zone, "tp": 8}

    zones = {"us-central1-a": {"A100-40": 16}, "us-east-1a": {"A100-40": 8}, "eastus": {"V100-32": 8}}
    plan = plan_from_dict({"micro_batch_size": 1, "stages": [[0, 10], [10, 26]], "pipelines": [
        {"microbatches": 4, "replicas": [rep(0, "A100-40", "us-central1-a"), rep(1, "A100-40", "us-east-1a")]},
        {"microbatches": 4, "replicas": [rep(0, "A100-40", "us-central1-a"), rep(1, "V100-32", "eastus")]},
    ], "job": {"model": "opt-350m", "global_batch_size": 8},
        "cluster": {"provider": ["gcp", "aws", "azure"], "zones": zones}})
    out = tmp_path / "sky"
    files = launch_files(plan, Backend.SKYPILOT, _opts("plan.json", steps=3), sky=SkyPilotOptions(workdir=str(out)),
                         image="example.com/sailor:1")
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(data)
    placed = []
    for k, path in enumerate(sorted(out.glob("*.yaml"))):
        env = [("SAILOR_RDZV_HOST", "10.128.0.7")] if k else []
        task = command._make_task_or_dag_from_entrypoint_with_overrides((str(path),), env=env)
        assert isinstance(task, sky.Task), f"`sky launch` would refuse {path.name}: {task}"
        (res,) = task.resources
        placed.append((str(res.cloud), res.region, res.zone, res.accelerators, task.num_nodes))
    assert placed == [("GCP", "us-central1", "us-central1-a", {"A100": 8}, 2),
                      ("AWS", "us-east-1", "us-east-1a", {"A100": 8}, 1),
                      ("Azure", "eastus", None, {"V100-32GB": 8}, 1)]


@pytest.mark.integration
def test_skypilot_managed_job_loads_as_sky_jobs_launch_does(tmp_path, sky):
    from sky.utils import dag_utils

    one = plan_from_dict({"micro_batch_size": 1, "stages": [[0, 26]], "pipelines": [
        {"microbatches": 4, "replicas": [{"stage": 0, "gpu": "A100-40", "zone": "us-central1-a", "tp": 4}]}] * 3})
    opts = _opts("plan.json", steps=3, checkpoint_dir="/ckpt")
    sky_opts = SkyPilotOptions(workdir=str(tmp_path), checkpoint_bucket="s3://team-ck/run1", managed=True)
    files = launch_files(one, Backend.SKYPILOT, opts, sky=sky_opts, image="example.com/sailor:1")
    path = tmp_path / "0-a100-40-us-central1-a.yaml"
    path.write_text(files[path.name])
    (task,) = dag_utils.load_chain_dag_from_yaml(str(path)).tasks  # what `sky jobs launch FILE` reads
    (res,) = task.resources
    assert res.use_spot and res.job_recovery == {"strategy": "FAILOVER", "max_restarts_on_errors": 0}
    assert task.storage_mounts["/ckpt"].source == "s3://team-ck/run1" and task.setup is None  # the image holds Sailor
    assert "sky jobs launch --yes --name sailor 0-a100-40-us-central1-a.yaml" in files["launch.sh"]


@pytest.mark.integration
def test_skypilot_setup_installs_the_synced_source_as_sailor_train(tmp_path, sky):
    """pip resolves `setup`'s argument, run in the working directory as SkyPilot runs it, to the
    distribution sailor-train of this version built from the synced source (offline: no index)."""
    import sailor

    out = _sky_files(tmp_path)
    task = sky.Task.from_yaml(str(out / "0-a100-40-us-central1-a.yaml"))
    argv = shlex.split(task.setup)
    assert argv[:5] == ["python3", "-m", "pip", "install", "--quiet"] and argv[5:] == ["./sailor-train[train]"]
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
                        "--no-build-isolation", "--report", str(report), *argv[5:]], cwd=out, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (item,) = json.loads(report.read_text())["install"]
    meta = item["metadata"]
    assert (meta["name"], meta["version"]) == ("sailor-train", sailor.__version__)
    assert item["requested_extras"] == ["train"] and item["download_info"]["url"].startswith("file://")
    assert any(d.startswith("torch") and "extra == \"train\"" in d for d in meta["requires_dist"])


@pytest.mark.integration
def test_skypilot_refuses_one_file_for_all_groups(tmp_path, sky):
    """Why the groups are separate files: `sky launch` refuses a file holding them all, as a chain
    or as a job group (`execution: parallel`, which only `sky jobs launch` runs)."""
    from sky.client.cli import command
    from sky.utils import dag_utils

    tasks = [t.read_text() for t in sorted(_sky_files(tmp_path).glob("*.yaml"))]
    env = [("SAILOR_RDZV_HOST", "10.128.0.7")]
    chain = tmp_path / "chain.yaml"
    chain.write_text("".join(tasks))
    group = tmp_path / "group.yaml"
    group.write_text("---\nname: sailor\nexecution: parallel\n" + "".join(tasks))
    assert dag_utils.is_job_group_yaml(str(group)) and not dag_utils.is_job_group_yaml(str(chain))
    assert len(dag_utils.load_job_group_from_yaml(str(group), env_overrides=env).tasks) == 3
    for path in (chain, group):
        dag = command._make_task_or_dag_from_entrypoint_with_overrides((str(path),), env=env)
        assert isinstance(dag, sky.Dag) and len(dag.tasks) == 3  # `sky launch` raises its DAG UsageError


@pytest.mark.integration
def test_skypilot_run_scripts_start_torchrun_on_internal_addresses(tmp_path, sky):
    python, calls = _stand_in_python(tmp_path)
    out = _sky_files(tmp_path, python=python)
    files = sorted(out.glob("*.yaml"))
    head_ips = "10.128.0.7\n10.128.0.8"  # SKYPILOT_NODE_IPS of the rendezvous cluster (internal addresses)
    for k, path in enumerate(files):
        task = sky.Task.from_yaml_config(next(yaml.safe_load_all(path.read_text())),
                                         env_overrides={"SAILOR_RDZV_HOST": "10.128.0.7"} if k else None)
        for rank in range(task.num_nodes):
            env = {"SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NODE_IPS": head_ips if k == 0 else "10.132.0.2",
                   **(task.envs or {})}
            _bash(task.run, env, cwd=out)  # SkyPilot runs `run` in the synced working directory
    agents = _torchrun_agents(calls, "10.128.0.7:29500", plan="plan.json")
    assert load_plan(out / "plan.json") == GEO  # the relative path every rank reads names the plan
    assert {conf for *_, conf in agents} == {"timeout=1800"}  # waits for groups provisioned later
    _ranks_once(agents)


# ---- Kubernetes --------------------------------------------------------------------------------
@pytest.fixture
def kubernetes_validate():
    kv = pytest.importorskip("kubernetes_validate", reason=f"kubernetes-validate is not installed ({INSTALL})")
    exe = Path(sys.executable).with_name("kubernetes-validate")
    if not exe.exists():
        pytest.skip(f"{exe} is missing ({INSTALL})")
    return exe, kv.latest_version()


def _validate_strict(kubernetes_validate, docs: list[dict], tmp_path: Path, name: str) -> subprocess.CompletedProcess:
    exe, version = kubernetes_validate
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs))
    return subprocess.run([str(exe), "--strict", "-k", version, str(path)], capture_output=True, text=True, timeout=120)


def _passes(kubernetes_validate, docs: list[dict], tmp_path: Path, name: str) -> None:
    r = _validate_strict(kubernetes_validate, docs, tmp_path, name)
    assert r.returncode == 0 and r.stdout.count(" passed for resource ") == len(docs), r.stdout + r.stderr
    # --strict is not a no-op: one misplaced field fails the file
    bad = json.loads(json.dumps(docs))
    bad[-1]["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    assert _validate_strict(kubernetes_validate, bad, tmp_path, "bad-" + name).returncode != 0


# The JobSet fields we write, as the v1alpha2 API defines them (types JobSetSpec, Network, FailurePolicy,
# SuccessPolicy, ReplicatedJob) with their allowed values.
JOBSET_SPEC = {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
               "coordinator", "managedBy", "ttlSecondsAfterFinished", "volumeClaimPolicies"}
JOBSET_NETWORK = {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"}
JOBSET_FAILURE = {"maxRestarts", "restartStrategy", "rules"}
JOBSET_RESTART_STRATEGIES = {"Recreate", "BlockingRecreate", "InPlaceRestart"}
REPLICATED_JOB = {"name", "groupName", "template", "replicas", "dependsOn"}


def _check_jobset_fields(js: dict) -> None:
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and set(js) == {"apiVersion", "kind", "metadata", "spec"}
    spec = js["spec"]
    assert set(spec) <= JOBSET_SPEC and set(spec["network"]) <= JOBSET_NETWORK
    assert set(spec["failurePolicy"]) <= JOBSET_FAILURE
    assert spec["failurePolicy"]["restartStrategy"] in JOBSET_RESTART_STRATEGIES
    assert isinstance(spec["failurePolicy"]["maxRestarts"], int) and spec["failurePolicy"]["maxRestarts"] >= 0
    assert set(spec["successPolicy"]) <= {"operator", "targetReplicatedJobs"}
    assert spec["successPolicy"]["operator"] in ("All", "Any")
    names = [r["name"] for r in spec["replicatedJobs"]]
    assert len(set(names)) == len(names)  # listType=map keyed by name
    for r in spec["replicatedJobs"]:
        assert set(r) <= REPLICATED_JOB and isinstance(r["replicas"], int) and set(r["template"]) <= {"metadata", "spec"}


def _child_jobs(js: dict) -> list[dict]:
    """The batch/v1 Jobs the JobSet controller creates (one per replicated job, as replicas is 1)."""
    meta = js["metadata"]
    return [{"apiVersion": "batch/v1", "kind": "Job",
             "metadata": {"name": f"{meta['name']}-{r['name']}-0", "namespace": meta["namespace"],
                          **r["template"].get("metadata", {})},
             "spec": r["template"]["spec"]} for r in js["spec"]["replicatedJobs"]]


def _run_pods(jobs: list[dict], pod_spec_of) -> None:
    """Run every pod's container command with bash, as the kubelet would for each completion index."""
    for job in jobs:
        (c,) = pod_spec_of(job)["containers"]
        assert c["command"][:2] == ["bash", "-c"]
        for index in range(job["spec"]["completions"]):
            _bash(c["command"][2], {"JOB_COMPLETION_INDEX": str(index), **{e["name"]: e["value"] for e in c["env"]}})


@pytest.mark.integration
def test_kubernetes_jobset_passes_kubernetes_validate(tmp_path, kubernetes_validate):
    python, calls = _stand_in_python(tmp_path)
    opts = _opts("/etc/sailor/plan.json", steps=3, python=python, checkpoint_dir="/ck")
    docs = launch_specs(GEO_K8S, Backend.KUBERNETES, opts, name="opt350", image="registry.example.com/sailor-train:0.1.0",
                        k8s=KubernetesOptions(namespace="team-a", max_restarts=3, queue="gpus", checkpoint_claim="ck"))
    builtin = [d for d in docs if d["kind"] != "JobSet"]
    (js,) = [d for d in docs if d["kind"] == "JobSet"]
    _check_jobset_fields(js)
    jobs = _child_jobs(js)
    _passes(kubernetes_validate, builtin + jobs, tmp_path, "manifests.yaml")
    assert [j["metadata"]["name"] for j in jobs] == ["opt350-a100-40-us-central1-a-0", "opt350-v100-16-us-central1-b-0",
                                                     "opt350-v100-16-us-central1-f-0"]
    _run_pods(jobs, lambda j: j["spec"]["template"]["spec"])
    agents = _torchrun_agents(calls, "opt350-a100-40-us-central1-a-0-0.opt350:29500")
    _ranks_once(agents, GEO_K8S)
    assert all(s.resume_from is None for s in _worker_settings(calls))  # no checkpoint in /ck here: a fresh start


@pytest.mark.integration
def test_kubernetes_indexed_jobs_pass_kubernetes_validate(tmp_path, kubernetes_validate):
    python, calls = _stand_in_python(tmp_path)
    opts = _opts("/etc/sailor/plan.json", steps=3, python=python)
    docs = launch_specs(GEO_K8S, Backend.KUBERNETES, opts, k8s=KubernetesOptions(indexed_jobs=True, namespace="ml"))
    _passes(kubernetes_validate, docs, tmp_path, "jobs.yaml")
    _run_pods([d for d in docs if d["kind"] == "Job"], lambda j: j["spec"]["template"]["spec"])
    _ranks_once(_torchrun_agents(calls, "sailor-a100-40-us-central1-a-0.sailor-nodes:29500"), GEO_K8S)


@pytest.mark.integration
def test_restarted_jobset_resumes_from_the_newest_checkpoint(tmp_path):
    """The shell each JobSet pod runs picks the newest complete `step-*` folder (not a `.tmp-` one)."""
    python, calls = _stand_in_python(tmp_path)
    ck = tmp_path / "ck"
    for d in ("step-00000004", "step-00000012", ".tmp-step-00000016"):
        (ck / d).mkdir(parents=True)
    opts = _opts("/etc/sailor/plan.json", python=python, checkpoint_dir=str(ck))
    (js,) = [d for d in launch_specs(GEO_K8S, Backend.KUBERNETES, opts, k8s=KubernetesOptions(checkpoint_claim="ck"))
             if d["kind"] == "JobSet"]
    _run_pods(_child_jobs(js), lambda j: j["spec"]["template"]["spec"])
    settings = _worker_settings(calls)
    assert len(settings) == 6 and all(s.resume_from == str(ck / "step-00000012") for s in settings)


# ---- torchrun over ssh -------------------------------------------------------------------------
@pytest.mark.integration
def test_torchrun_node_commands_parse_with_torchrun(tmp_path):
    python, calls = _stand_in_python(tmp_path)
    opts = _opts("/etc/sailor/plan.json", steps=3, python=python)
    for doc in launch_specs(GEO, Backend.TORCHRUN, opts, hosts_path=_write_hosts(tmp_path, HOSTS)):
        _bash(doc["command"], {})
    agents = _torchrun_agents(calls, "a0:29500")
    assert {conf for *_, conf in agents} == {""}  # torchrun's default rendezvous timeout on known machines
    _ranks_once(agents)
