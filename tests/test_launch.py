"""`sailor launch`: per-node torchrun commands, SkyPilot tasks and Kubernetes manifests for a plan.

Every generated document parses as YAML and carries its format's required keys; every rank of the
plan appears exactly once, and torchrun's rank assignment (prefix sums of --nproc-per-node in
--node-rank order) reproduces `rank_layout`. The ssh path runs against a fake `ssh` on PATH; one test
runs a real 6-rank CPU job through it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sailor.core.errors import SailorInputError
from sailor.launch import (DEFAULT_IMAGE, Backend, KubernetesOptions, LaunchOptions, dump_documents, launch,
                           launch_files, launch_specs)
from sailor.launch import skypilot
from sailor.launch.common import agent_command, launch_layout
from sailor.launch.skypilot import SkyPilotOptions, source_files
from sailor.plan import plan_from_dict
from sailor.plan.placement import rank_layout
from sailor.plan.spec import Plan
from sailor.runtime.command import WorkerSettings
from sailor.runtime.epochs import AGENT_SLOTS_ENV
from sailor.specs.job import JobSpec

SAILOR = Path(sys.executable).with_name("sailor")


def _rep(stage: int, gpu: str, zone: str, tp: int) -> dict:
    return {"stage": stage, "gpu": gpu, "zone": zone, "tp": tp}


# Three 2-stage pipelines: stage 0 on A100-40 in us-central1-a, stage 1 on V100-16 in us-central1-b
# (the last one on us-west1-b). Node us-central1-a/A100-40/0 holds ranks 0-3 and 8-11: two agents.
GEO = plan_from_dict({"micro_batch_size": 1, "stages": [[0, 10], [10, 26]], "pipelines": [
    {"microbatches": 4, "replicas": [_rep(0, "A100-40", "us-central1-a", 4), _rep(1, "V100-16", "us-central1-b", 4)]},
    {"microbatches": 4, "replicas": [_rep(0, "A100-40", "us-central1-a", 4), _rep(1, "V100-16", "us-central1-b", 4)]},
    {"microbatches": 4, "replicas": [_rep(0, "A100-40", "us-central1-a", 4), _rep(1, "V100-16", "us-west1-b", 2)]},
]})
GEO_JOB = JobSpec(model="opt-350m", global_batch_size=12)
# GEO within one region (us-west1-b -> us-central1-f): what one Kubernetes cluster can hold.
GEO_K8S = plan_from_dict({**GEO.to_dict(), "pipelines": [
    {**p, "replicas": [{**r, "zone": r["zone"].replace("us-west1-b", "us-central1-f")} for r in p["replicas"]]}
    for p in GEO.to_dict()["pipelines"]]})


def _opts(plan_path: str, *, python: str = "python3", rdzv_port: int = 29500, **worker) -> LaunchOptions:
    """Launch options for the worker settings `worker` (default: 10 steps on cuda) of plan `plan_path`."""
    return LaunchOptions(worker=WorkerSettings(plan=plan_path, **{"steps": 10, "device": "cuda", **worker}),
                         python=python, rdzv_port=rdzv_port)


OPTS = _opts("/data/plan.json", steps=3)
HOSTS = {"user": "ubuntu", "groups": [
    {"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["a0", "a1", "a-spare"]},
    {"zone": "us-central1-b", "gpu": "V100-16", "hosts": ["b0", "b1"]},
    {"zone": "us-west1-b", "gpu": "V100-16", "user": "admin", "hosts": ["w0"]},
]}
TORCHRUN = re.compile(r"(?:CUDA_VISIBLE_DEVICES=(\S+) )?\S+ -m sailor\.runtime\.launcher --nnodes (\d+) --node-rank (\d+)"
                      r" --nproc-per-node (\d+) .*?--rdzv-endpoint (\S+):(\d+) -m sailor\.runtime\.worker")


def _write_hosts(tmp_path: Path, data: dict = HOSTS) -> Path:
    p = tmp_path / "hosts.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _agents_in(text: str) -> list[tuple[int, int, int, str | None, str]]:
    """(nnodes, node_rank, nproc, CUDA_VISIBLE_DEVICES, endpoint host) of every torchrun command in `text`."""
    return [(int(n), int(r), int(p), cvd, host) for cvd, n, r, p, host, _port in TORCHRUN.findall(text)]


def _check_torchrun_ranks(agents, plan: Plan) -> dict[int, tuple[int, ...]]:
    """torchrun's global ranks per agent: each plan rank exactly once, agents 0..N-1 once each."""
    agents = sorted(agents, key=lambda a: a[1])
    assert [a[1] for a in agents] == list(range(len(agents)))
    assert {a[0] for a in agents} == {len(agents)}
    out, start = {}, 0
    for _n, r, p, cvd, _h in agents:
        out[r] = tuple(range(start, start + p))
        if cvd is not None:
            assert len(cvd.split(",")) == p
        start += p
    ranks = sorted(x for rs in out.values() for x in rs)
    assert ranks == list(range(plan.world_size))
    return out


def test_layout_matches_rank_layout_and_splits_noncontiguous_nodes():
    layout = launch_layout(GEO)
    infos = {i.rank: i for i in rank_layout(GEO, {"A100-40": 8, "V100-16": 8})}
    assert [a.ranks for a in layout.agents if a.node == "us-central1-a/A100-40/0"] == [(0, 1, 2, 3), (8, 9, 10, 11)]
    for a in layout.agents:
        for rank, gpu in zip(a.ranks, a.local_gpus):
            assert infos[rank].node == a.node and infos[rank].local_rank == gpu
    assert layout.rdzv_node.name == "us-central1-a/A100-40/0"


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_each_agent_of_a_node_names_its_own_device_slots(device):
    """Two agents on one node both count LOCAL_RANK from 0: on every device each names the node's
    device indices of its ranks (the testbed's per-rank quota needs them on CPU too)."""
    from sailor.testbed.cgroups import rank_slot

    layout = launch_layout(GEO)
    agents = [a for a in layout.agents if a.node == "us-central1-a/A100-40/0"]
    assert [a.local_gpus for a in agents] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for a in agents:
        cmd = agent_command(a, layout, _opts("/data/plan.json", device=device), "a0")
        slots = ",".join(map(str, a.local_gpus))
        assert f"{AGENT_SLOTS_ENV}={slots} " in cmd
        assert (f"CUDA_VISIBLE_DEVICES={slots} " in cmd) == (device == "cuda")
        # what torchrun's rank k of this agent sees: the testbed puts it under device slot a.local_gpus[k]
        env = dict(w.split("=", 1) for w in cmd.split(" -m ")[0].split()[1:] if "=" in w)
        for k, gpu in enumerate(a.local_gpus):
            assert rank_slot({**env, "TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": str(k)}) == gpu


def test_every_agents_torchrun_logs_into_a_scratch_folder_it_removes(tmp_path, monkeypatch):
    """torchrun given no --log-dir makes a torchelastic_XXXX folder in each node's temp folder and
    never removes it: the launcher a node's agent command runs gives it a scratch folder instead,
    removed when it ends; the local launch's own --log-dir (its scratch folder) is kept."""
    import contextlib
    import shlex

    import torch.distributed.run as torchrun

    from sailor.runtime import launcher

    made: list[Path] = []

    @contextlib.contextmanager
    def scratch(prefix):  # core.scratch without its watcher process (test_scratch covers that one)
        made.append(tmp_path / f"{prefix}{len(made)}")
        made[-1].mkdir()
        yield str(made[-1])
        shutil.rmtree(made[-1])

    got: list[list[str]] = []
    monkeypatch.setattr(launcher, "die_with_parent", lambda sig: None)
    monkeypatch.setattr(launcher, "scratch_dir", scratch)
    monkeypatch.setattr(torchrun, "main", lambda argv: got.append(argv))
    layout = launch_layout(GEO)
    for a in layout.agents:
        words = shlex.split(agent_command(a, layout, OPTS, "a0"))
        argv = words[words.index("sailor.runtime.launcher") + 1:]
        launcher._main(argv)
        assert got[-1] == ["--log-dir", str(made[-1]), *argv]  # the folder scratch() made, then removed
        assert torchrun.parse_args(got[-1]).log_dir == str(made[-1])
    assert len(made) == len(layout.agents) and not any(p.exists() for p in made)  # one each, all removed
    local = ["--standalone", "--log-dir", "/run/scratch/torchrun", "--nproc-per-node", "2", *OPTS.worker.argv()]
    launcher._main(local)
    assert got[-1] == local and len(made) == len(layout.agents)


def test_torchrun_dry_run_documents(tmp_path):
    docs = launch_specs(GEO, Backend.TORCHRUN, OPTS, hosts_path=_write_hosts(tmp_path))
    parsed = list(yaml.safe_load_all(dump_documents(docs, header="test")))
    assert parsed == docs
    for d in parsed:
        assert {"node", "host", "zone", "gpu", "agents", "command", "rendezvous"} <= set(d)
    listed = sorted(r for d in parsed for a in d["agents"] for r in a["ranks"])
    assert listed == list(range(GEO.world_size))
    by_rank = _check_torchrun_ranks([a for d in parsed for a in _agents_in(d["command"])], GEO)
    for d in parsed:  # the ranks a document lists are the ones its torchrun commands get
        for a in d["agents"]:
            assert tuple(a["ranks"]) == by_rank[a["node_rank"]]
    assert {d["host"] for d in parsed} == {"ubuntu@a0", "ubuntu@a1", "ubuntu@b0", "admin@w0"}  # b1, a-spare unused
    assert {h for d in parsed for *_, h in _agents_in(d["command"])} == {"a0"}  # rank 0's host
    two = next(d for d in parsed if d["node"] == "us-central1-a/A100-40/0")
    assert len(two["agents"]) == 2 and "wait" in two["command"]


def test_torchrun_without_hosts_uses_a_rendezvous_variable():
    docs = launch_specs(GEO, Backend.TORCHRUN, OPTS)
    assert all(d["host"] is None and "${SAILOR_RDZV_HOST}:29500" in d["command"] for d in docs)


SKY_OPTS = _opts("plan.json", steps=3)  # SkyPilot: the plan lies in the tasks' working directory


def test_skypilot_tasks():
    docs = launch_specs(GEO, Backend.SKYPILOT, SKY_OPTS, sky=SkyPilotOptions(workdir="/home/me/sky"))
    parsed = list(yaml.safe_load_all(dump_documents(docs)))
    assert len(parsed) == 3  # (A100-40, us-central1-a), (V100-16, us-central1-b), (V100-16, us-west1-b)
    for t in parsed:
        assert {"name", "workdir", "num_nodes", "resources", "setup", "run"} == set(t) - {"envs"}
        assert set(t["resources"]) == {"infra", "accelerators"}  # no ports: nothing opened to the outside
        # synced to ~/sky_workdir on every node, where setup and run start: the plan and Sailor come with it
        assert t["workdir"] == "/home/me/sky" and "--plan=plan.json" in t["run"] and "$SKYPILOT_NODE_RANK" in t["run"]
        assert t["setup"] == "python3 -m pip install --quiet './sailor-train[train]'"  # a path, no name on an index
    first = parsed[0]
    assert first["resources"] == {"infra": "gcp/us-central1/us-central1-a", "accelerators": "A100:8"}
    assert "envs" not in first and 'SKYPILOT_NODE_IPS' in first["run"]  # its head's internal address
    assert parsed[2]["resources"] == {"infra": "gcp/us-west1/us-west1-b", "accelerators": "V100:2"}
    assert parsed[2]["num_nodes"] == 1
    assert all(t["envs"] == {"SAILOR_RDZV_HOST": None} for t in parsed[1:])  # required at `sky launch`
    assert "SAILOR_RESUME" not in first["run"]  # no checkpoint folder: nothing to resume from
    _check_torchrun_ranks([a for t in parsed for a in _agents_in(t["run"])], GEO)
    # With an image: SkyPilot runs the tasks in it, nothing to install.
    imaged = launch_specs(GEO, Backend.SKYPILOT, SKY_OPTS, image="example.com/sailor-train:0.1.0")
    assert all(t["resources"]["image_id"] == "docker:example.com/sailor-train:0.1.0" and "setup" not in t
               for t in imaged)


def test_skypilot_checkpoints_go_to_one_bucket_mounted_on_every_node():
    opts = _opts("plan.json", checkpoint_dir="/ckpt")
    with pytest.raises(SailorInputError, match="--checkpoint-dir: each SkyPilot VM has its own disk"):
        launch_specs(GEO, Backend.SKYPILOT, opts)
    docs = launch_specs(GEO, Backend.SKYPILOT, opts, sky=SkyPilotOptions(checkpoint_bucket="gs://team-ck/opt350"))
    for t in docs:
        assert t["file_mounts"] == {"/ckpt": {"source": "gs://team-ck/opt350", "mode": "MOUNT"}}
        # launch.sh run again, or a recovered job, continues from the bucket's newest checkpoint
        assert "SAILOR_RESUME=$(ls -d -- /ckpt/step-[0-9]*" in t["run"] and '--resume-from=$SAILOR_RESUME' in t["run"]


@pytest.mark.parametrize("worker, sky, match", [
    ({"plan": "/home/me/plan.json"}, {}, "--remote-plan: '/home/me/plan.json': on SkyPilot the plan lies in the task's"),
    ({"plan": "../plan.json"}, {}, "on SkyPilot the plan lies in the task's working directory"),
    ({}, {"checkpoint_bucket": "gs://b1/x"}, "--checkpoint-bucket: a checkpoint bucket needs a folder"),
    ({"checkpoint_dir": "/ck"}, {"checkpoint_bucket": "https://b1/x"}, "'https://b1/x': is not a gs:// or s3:// bucket"),
    ({"checkpoint_dir": "/ck"}, {"checkpoint_bucket": "gs://Big-Bucket"}, "'gs://Big-Bucket': is not a gs:// or s3://"),
    ({"checkpoint_dir": "/ck"}, {"checkpoint_bucket": "s3://b/p"},
     "'s3://b/p': its bucket name 'b' has 1 characters; bucket names have 3 to 63"),
    ({"checkpoint_dir": "ck"}, {"checkpoint_bucket": "s3://b12"}, "--checkpoint-dir: 'ck': a bucket is mounted at an"),
    ({"checkpoint_dir": "/ck"}, {"checkpoint_bucket": "gs://b12", "managed": True},
     "--managed: a managed job needs a plan of one .GPU type, zone. group; this plan has 3"),
])
def test_skypilot_bad_options(worker, sky, match):
    opts = _opts(worker.pop("plan", "plan.json"), **worker)
    with pytest.raises(SailorInputError, match=match) as e:
        launch_specs(GEO, Backend.SKYPILOT, opts, sky=SkyPilotOptions(**sky))
    assert "\n" not in e.value.one_line()


ONE_GROUP = plan_from_dict({"micro_batch_size": 1, "stages": [[0, 26]], "pipelines": [
    {"microbatches": 4, "replicas": [_rep(0, "A100-40", "us-central1-a", 4)]}] * 3})


def test_skypilot_managed_job_recovers_spot_vms_and_resumes():
    with pytest.raises(SailorInputError, match="--managed: a recovered managed job without checkpoints starts again"):
        launch_specs(ONE_GROUP, Backend.SKYPILOT, SKY_OPTS, sky=SkyPilotOptions(managed=True))
    opts = _opts("plan.json", checkpoint_dir="/ckpt")
    sky = SkyPilotOptions(managed=True, checkpoint_bucket="gs://team-ck/run1")
    (task,) = launch_specs(ONE_GROUP, Backend.SKYPILOT, opts, sky=sky)
    assert task["resources"]["use_spot"] is True
    assert task["resources"]["job_recovery"] == {"strategy": "FAILOVER", "max_restarts_on_errors": 0}
    assert "SAILOR_RESUME=$(ls -d -- /ckpt/step-[0-9]*" in task["run"]
    files = launch_files(ONE_GROUP, Backend.SKYPILOT, opts, sky=sky, name="run1")
    (launch_line,) = [x for x in files["launch.sh"].splitlines() if x.startswith("sky ")]
    assert launch_line == "sky jobs launch --yes --name run1 0-a100-40-us-central1-a.yaml"


def test_skypilot_source_files_are_a_checkout_or_a_wheel(tmp_path):
    install, files = source_files()  # the checkout these tests run from
    assert install == "sailor-train"
    assert {"sailor-train/pyproject.toml", "sailor-train/README.md", "sailor-train/sailor/__init__.py",
            "sailor-train/sailor/catalog/gcp.yaml", "sailor-train/sailor/launch/skypilot.py"} <= set(files)
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]
    assert files["sailor-train/sailor/launch/skypilot.py"] == (Path(skypilot.__file__)).read_bytes()
    wheel = tmp_path / "sailor_train-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK\x03\x04 a zip")
    assert source_files(wheel) == (wheel.name, {wheel.name: b"PK\x03\x04 a zip"})
    for bad in (tmp_path, tmp_path / "other-0.1.0-py3-none-any.whl", tmp_path / "missing"):
        if bad.suffix:
            bad.write_bytes(b"x")
        with pytest.raises(SailorInputError, match="--install-from: .* is not a Sailor source checkout"):
            source_files(bad)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "sailor"\n')  # the unrelated index package's name
    (tmp_path / "README.md").write_text("")
    (tmp_path / "sailor").mkdir()
    (tmp_path / "sailor" / "__init__.py").write_text("")
    with pytest.raises(SailorInputError, match="is not a Sailor source checkout"):
        source_files(tmp_path)


@pytest.mark.integration
def test_skypilot_files_and_script(tmp_path):
    files = launch_files(GEO, Backend.SKYPILOT, SKY_OPTS, header="test", name="opt")
    names = ["0-a100-40-us-central1-a.yaml", "1-v100-16-us-central1-b.yaml", "2-v100-16-us-west1-b.yaml"]
    assert list(files)[:6] == [*names, "launch.sh", ".skyignore", "plan.json"]
    assert plan_from_dict(json.loads(files["plan.json"])) == GEO  # the plan, in the working directory
    assert "sailor-train/pyproject.toml" in files
    script = files["launch.sh"]
    launches = [line for line in script.splitlines() if line.startswith("sky launch")]
    # the rendezvous group first and alone, then the others at once with its head's internal address
    assert launches[0] == f"sky launch --yes --detach-run --cluster opt-0 {names[0]}"
    assert all(f"--cluster opt-{k} {names[k]} --env SAILOR_RDZV_HOST=\"$rdzv\" &" in launches[k] for k in (1, 2))
    assert script.index("hostname -I") < script.index(launches[1])
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # bash parses it
    with pytest.raises(SailorInputError, match="--install-from and --image exclude each other"):
        launch_files(ONE_GROUP, Backend.SKYPILOT, SKY_OPTS, image="example.com/sailor:1", install_from=tmp_path)
    single = launch_files(ONE_GROUP, Backend.SKYPILOT, SKY_OPTS, image="example.com/sailor:1")
    assert list(single) == ["0-a100-40-us-central1-a.yaml", "launch.sh", ".skyignore", "plan.json"]  # no source
    assert "SAILOR_RDZV_HOST" not in single["launch.sh"]  # one group: nothing to pass on


def _jobset_pods(jobset: dict) -> list[tuple[str, dict]]:
    """(replicated job name, pod template) of every replicated job."""
    return [(r["name"], r["template"]["spec"]["template"]) for r in jobset["spec"]["replicatedJobs"]]


def test_kubernetes_jobset():
    opts = _opts("/etc/sailor/plan.json", steps=3)
    docs = launch_specs(GEO_K8S, Backend.KUBERNETES, opts, image="example.com/sailor:1", name="opt",
                        k8s=KubernetesOptions(namespace="team-a", max_restarts=2, queue="gpus"))
    parsed = list(yaml.safe_load_all(dump_documents(docs)))
    assert [d["kind"] for d in parsed] == ["ConfigMap", "NetworkPolicy", "JobSet"]
    assert all(d["metadata"]["namespace"] == "team-a" for d in parsed)
    assert plan_from_dict(json.loads(parsed[0]["data"]["plan.json"])) == GEO_K8S.with_specs(None, None)
    policy = parsed[1]["spec"]  # only the job's own pods reach its pods
    assert policy["podSelector"] == {"matchLabels": {"sailor.dev/job": "opt"}}
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"sailor.dev/job": "opt"}}}]}]
    js = parsed[2]
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["metadata"]["name"] == "opt"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpus"  # Kueue admits it all or nothing
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 2, "restartStrategy": "BlockingRecreate"}
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    groups = ["a100-40-us-central1-a", "v100-16-us-central1-b", "v100-16-us-central1-f"]
    assert [r["name"] for r in js["spec"]["replicatedJobs"]] == groups
    agents = []
    for r in js["spec"]["replicatedJobs"]:
        job = r["template"]["spec"]
        assert r["replicas"] == 1 and job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"]
    for group, pod in _jobset_pods(js):
        assert pod["metadata"]["labels"] == {"sailor.dev/job": "opt", "sailor.dev/group": group}
        (c,) = pod["spec"]["containers"]
        assert c["image"] == "example.com/sailor:1"
        assert set(c["resources"]) == {"limits"} and c["resources"]["limits"]["nvidia.com/gpu"] in (2, 8)
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["SAILOR_RDZV_HOST"] == "opt-a100-40-us-central1-a-0-0.opt"  # JobSet's pod 0 of job 0
        assert "$JOB_COMPLETION_INDEX" in c["command"][-1]
        agents += _agents_in(c["command"][-1])
    pods = dict(_jobset_pods(js))
    assert pods[groups[0]]["spec"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100",
                                                        "topology.kubernetes.io/zone": "us-central1-a"}
    _check_torchrun_ranks(agents, GEO_K8S)


@pytest.mark.parametrize("k8s", [KubernetesOptions(), KubernetesOptions(indexed_jobs=True)])
def test_kubernetes_refuses_a_plan_across_regions_naming_them(k8s):
    # GEO's third pipeline ends in us-west1-b: no GKE cluster has node pools in both regions, so
    # one line naming the regions instead of a JobSet whose pods never schedule.
    with pytest.raises(SailorInputError) as e:
        launch_specs(GEO, Backend.KUBERNETES, _opts("/etc/sailor/plan.json"), k8s=k8s)
    assert e.value.one_line().startswith("--backend: the plan spans regions us-central1, us-west1,")
    assert "\n" not in e.value.one_line() and "--backend skypilot" in e.value.one_line()
    # a zone the catalog does not list is not counted (a custom cluster's own zone names)
    odd = plan_from_dict({**GEO_K8S.to_dict(), "pipelines": [
        {**p, "replicas": [{**r, "zone": r["zone"].replace("us-central1-f", "rack-7")} for r in p["replicas"]]}
        for p in GEO_K8S.to_dict()["pipelines"]]})
    assert launch_specs(odd, Backend.KUBERNETES, _opts("/etc/sailor/plan.json"), k8s=k8s)


def test_kubernetes_indexed_jobs_and_default_image():
    opts = _opts("/etc/sailor/plan.json", steps=3)
    docs = launch_specs(GEO_K8S, Backend.KUBERNETES, opts, k8s=KubernetesOptions(indexed_jobs=True))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ConfigMap", "NetworkPolicy", "Service", "Job", "Job", "Job"]
    assert docs[2]["spec"]["clusterIP"] == "None" and "type" not in docs[2]["spec"]  # headless, in-cluster only
    agents = []
    for job in docs[3:]:
        pod = job["spec"]["template"]["spec"]
        assert pod["subdomain"] == "sailor-nodes" and pod["containers"][0]["image"] == DEFAULT_IMAGE == "sailor-train:0.1.0"
        env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
        assert env["SAILOR_RDZV_HOST"] == "sailor-a100-40-us-central1-a-0.sailor-nodes"
        agents += _agents_in(pod["containers"][0]["command"][-1])
    _check_torchrun_ranks(agents, GEO_K8S)


@pytest.mark.parametrize("kwargs, match", [
    ({"name": "x" * 40}, r"--name: the pod hostname 'x{40}-a100-40-us-central1-a-0-0' has 66 characters, more than 63"
                         r" \(--name of at most 37 characters\)"),
    ({"name": "Opt"}, "'Opt' is not a DNS-1123 label"),
    ({"name": "1opt"}, "must start with a letter"),
    ({"image": ""}, "--image: the container image is empty"),
    ({"image": "  "}, "--image: the container image is empty"),
    ({"k8s": KubernetesOptions(namespace="Team_A")}, "--namespace: 'Team_A' is not a DNS-1123 label"),
    ({"k8s": KubernetesOptions(namespace="n" * 64)}, "namespace 'n{64}' has 64 characters"),
    ({"k8s": KubernetesOptions(indexed_jobs=True, max_restarts=1)}, "need a JobSet"),
    ({"k8s": KubernetesOptions(checkpoint_claim="ck")}, "needs a folder"),
])
def test_kubernetes_bad_names_and_options(kwargs, match):
    with pytest.raises(SailorInputError, match=match):
        launch_specs(GEO_K8S, Backend.KUBERNETES, _opts("/etc/sailor/plan.json"), **kwargs)


def test_kubernetes_checkpoints_live_on_a_claim_and_a_restart_resumes():
    opts = _opts("/etc/sailor/plan.json", checkpoint_dir="/ck")
    with pytest.raises(SailorInputError, match="--checkpoint-dir: checkpoints in a pod's own file system are lost"):
        launch_specs(GEO_K8S, Backend.KUBERNETES, opts)
    (js,) = [d for d in launch_specs(GEO_K8S, Backend.KUBERNETES, opts, k8s=KubernetesOptions(checkpoint_claim="ck"))
             if d["kind"] == "JobSet"]
    for _group, pod in _jobset_pods(js):
        assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ck"}} in pod["spec"]["volumes"]
        assert {"name": "checkpoints", "mountPath": "/ck"} in pod["spec"]["containers"][0]["volumeMounts"]
        assert "SAILOR_RESUME=$(ls -d -- /ck/step-[0-9]*" in pod["spec"]["containers"][0]["command"][-1]


@pytest.mark.parametrize("hosts, match", [
    ({"groups": [{"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["a0", "a1"]}]}, "no group lists them"),
    ({"groups": [{"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["a0"]},
                 {"zone": "us-central1-b", "gpu": "V100-16", "hosts": ["b0", "b1"]},
                 {"zone": "us-west1-b", "gpu": "V100-16", "hosts": ["w0"]}]}, "needs 2 A100-40 node"),
    ({"groups": [{"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["a0"]},
                 {"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["a1"]}]}, "listed twice"),
    ({"groups": [{"zone": "us-central1-a", "gpu": "A100-40", "hostz": ["a0"]}]}, "hostz"),
])
def test_bad_hosts(tmp_path, hosts, match):
    with pytest.raises(SailorInputError, match=match):
        launch_specs(GEO, Backend.TORCHRUN, OPTS, hosts_path=_write_hosts(tmp_path, hosts))


def test_bad_backend_inputs():
    cpu = plan_from_dict({"micro_batch_size": 1, "stages": [[0, 6]],
                          "pipelines": [{"microbatches": 1, "replicas": [_rep(0, "cpu", "local", 1)]}]})
    with pytest.raises(SailorInputError, match="no GKE accelerator"):
        launch_specs(cpu, Backend.KUBERNETES, _opts("/etc/sailor/plan.json", device="cpu"))
    with pytest.raises(SailorInputError, match="no SkyPilot accelerator"):
        launch_specs(cpu, Backend.SKYPILOT, _opts("plan.json", device="cpu"))
    with pytest.raises(SailorInputError, match="plan runs on GPU type cpu"):
        launch_specs(cpu, Backend.TORCHRUN, OPTS)
    with pytest.raises(SailorInputError, match="mounted from a ConfigMap"):
        launch_specs(GEO_K8S, Backend.KUBERNETES, _opts("/data/my-plan.json"))
    with pytest.raises(SailorInputError, match="unknown device"):
        launch_specs(GEO, Backend.TORCHRUN, _opts("p", device="tpu"))


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    if not SAILOR.exists():
        pytest.skip(f"console script {SAILOR} is not installed (pip install -e .)")
    return subprocess.run([str(SAILOR), *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.integration
def test_cli_errors_are_one_line(tmp_path):
    plan, one_region = tmp_path / "plan.json", tmp_path / "one-region.json"
    GEO.with_specs(GEO_JOB, None).save(plan)
    GEO_K8S.with_specs(GEO_JOB, None).save(one_region)
    for args, match in [(["--backend", "slurm", "--dry-run"], "unknown backend 'slurm'"),
                        (["--backend", "torchrun"], "needs --hosts"),
                        (["--backend", "skypilot", "--dry-run"], "--out: the skypilot backend needs a new folder"),
                        (["--backend", "skypilot", "--out", str(tmp_path / "s1"), "--checkpoint-dir", "/ck"],
                         "--checkpoint-dir: each SkyPilot VM has its own disk"),
                        (["--backend", "torchrun", "--dry-run", "--checkpoint-bucket", "gs://abc"],
                         "are for the skypilot backend"),
                        (["--backend", "kubernetes", "--dry-run", "--image", ""], "--image: the container image is empty"),
                        (["--backend", "skypilot", "--dry-run", "--image", "", "--out", str(tmp_path / "s2")],
                         "--image: the container image is empty"),
                        (["--backend", "kubernetes", "--dry-run", "--name", "a" * 50], "has 76 characters, more than 63"),
                        (["--backend", "kubernetes", "--dry-run", "--namespace", "ML"], "--namespace: 'ML' is not"),
                        (["--backend", "skypilot", "--dry-run", "--namespace", "ml", "--out", str(tmp_path / "s3")],
                         "are for the kubernetes backend"),
                        (["--backend", "skypilot", "--out", str(one_region)], "exists and is not a folder"),
                        (["--backend", "skypilot", "--out", str(plan)], f"--out: {plan} is the PLAN input"),
                        (["--backend", "kubernetes", "--dry-run"], "--backend: the plan spans regions us-central1,"
                                                                   " us-west1, but a Kubernetes cluster's GPU node pools"
                                                                   " lie in one region")]:
        kube = "kubernetes" in args and "spans regions" not in match
        r = _cli("launch", str(one_region if kube else plan), *args)
        assert r.returncode == 2 and match in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    bad = _write_hosts(tmp_path, {"groups": [{"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["a0", "a1"]}]})
    r = _cli("launch", str(plan), "--backend", "skypilot", "--out", str(tmp_path / "sky"), "--steps", "10")
    assert r.returncode == 0 and os.access(tmp_path / "sky" / "launch.sh", os.X_OK), r.stderr
    assert sorted(p.name for p in (tmp_path / "sky").iterdir()) == [".skyignore", "0-a100-40-us-central1-a.yaml",
                                                                   "1-v100-16-us-central1-b.yaml",
                                                                   "2-v100-16-us-west1-b.yaml", "launch.sh", "plan.json",
                                                                   "sailor-train"]
    assert not [p for p in (tmp_path / "s1").rglob("*") if p.is_file()]  # refused before anything was written
    r = _cli("launch", str(plan), "--backend", "skypilot", "--out", str(tmp_path / "sky"),  # stale files would sync
             "--steps", "10")
    assert r.returncode == 2 and "--out: " in r.stderr and "is not empty" in r.stderr, r.stderr
    r = _cli("launch", str(one_region), "--backend", "kubernetes", "--dry-run", "--namespace", "ml", "--steps", "10")
    assert r.returncode == 0 and [d["kind"] for d in yaml.safe_load_all(r.stdout)] == ["ConfigMap", "NetworkPolicy",
                                                                                       "JobSet"], r.stderr
    r = _cli("launch", str(plan), "--backend", "torchrun", "--hosts", str(bad), "--dry-run")
    assert r.returncode == 2 and "us-central1-b" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # A plan on GPU type cpu: --device cuda is refused up front; by default its ranks get --device cpu.
    cpu = tmp_path / "cpu.json"
    plan_from_dict({"micro_batch_size": 1, "stages": [[0, 6]], "job": {"model": "tiny", "global_batch_size": 1},
                    "pipelines": [{"microbatches": 1, "replicas": [_rep(0, "cpu", "local", 1)]}]}).save(cpu)
    r = _cli("launch", str(cpu), "--backend", "torchrun", "--device", "cuda", "--dry-run")
    assert r.returncode == 2 and "--device: the plan runs on GPU type cpu" in r.stderr, r.stderr
    r = _cli("launch", str(cpu), "--backend", "torchrun", "--dry-run", "--steps", "10")
    assert r.returncode == 0 and "--device=cpu" in r.stdout and "CUDA_VISIBLE_DEVICES" not in r.stdout, r.stderr
    r = _cli("launch", str(cpu), "--backend", "torchrun", "--dry-run", "--python", "venv/bin/python")
    assert r.returncode == 2 and "--python: 'venv/bin/python' is not an absolute path" in r.stderr, r.stderr


def _fake_ssh(tmp_path: Path, body: str) -> dict:
    """A PATH whose `ssh` records its arguments (one JSON line per call) and then runs `body`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                   f"open({str(tmp_path / 'calls.jsonl')!r}, 'a').write(json.dumps([os.getpid()] + sys.argv[1:]) + '\\n')\n"
                   + body)
    ssh.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def _calls(tmp_path: Path) -> list[list]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


@pytest.mark.integration
def test_cli_starts_every_node_over_ssh(tmp_path):
    plan = tmp_path / "plan.json"
    GEO.with_specs(GEO_JOB, None).save(plan)
    env = _fake_ssh(tmp_path, "sys.exit(0)\n")
    r = _cli("launch", str(plan), "--backend", "torchrun", "--hosts", str(_write_hosts(tmp_path)), "--steps", "7",
             env=env)
    assert r.returncode == 0, r.stderr
    calls = _calls(tmp_path)
    assert sorted(c[-2] for c in calls) == ["admin@w0", "ubuntu@a0", "ubuntu@a1", "ubuntu@b0"]
    assert all(c[1:3] == ["-o", "BatchMode=yes"] and c[-4:-2] == ["-tt", "--"] and c[-1].startswith("bash -c ")
               for c in calls)
    _check_torchrun_ranks([a for c in calls for a in _agents_in(c[-1])], GEO)
    assert all("--steps=7" in c[-1] and f"--plan={plan.resolve()}" in c[-1] for c in calls)


@pytest.mark.integration
def test_a_failing_node_stops_the_others(tmp_path):
    # Host a0 fails at once; the others hang until they are ended: none may be left running.
    env = _fake_ssh(tmp_path, "import time\nif sys.argv[-2].endswith('@a0'):\n    sys.exit(5)\ntime.sleep(600)\n")
    hosts = _write_hosts(tmp_path)
    old_path = os.environ["PATH"]
    os.environ["PATH"] = env["PATH"]
    try:
        t0 = time.monotonic()
        status = launch(GEO, OPTS, hosts)
    finally:
        os.environ["PATH"] = old_path
    assert status == 5 and time.monotonic() - t0 < 60
    assert _running(str(tmp_path / "bin" / "ssh")) == []


@pytest.mark.integration
def test_nodes_output_goes_to_the_log_and_nodes_past_the_timeout_are_ended(tmp_path):
    from sailor.launch.torchrun import NodeCommand, run_over_ssh

    # each node writes its line in two pieces, 0.3 s apart: the log must still hold whole lines
    env = _fake_ssh(tmp_path, "import time\nsys.stdout.write('up on'); sys.stdout.flush(); time.sleep(0.3)\n"
                              "print('', sys.argv[-2], flush=True)\n"
                              "time.sleep(600 if sys.argv[-1].endswith('sleep') else 0)\n")
    ssh = str(Path(env["PATH"].split(os.pathsep)[0]) / "ssh")
    nodes = [NodeCommand("a", "h1", "true"), NodeCommand("b", "h2", "true")]
    log = tmp_path / "nodes.log"
    with open(log, "w") as f:
        assert run_over_ssh(nodes, ssh=ssh, log=f, timeout_s=120) == 0
    assert sorted(log.read_text().splitlines()) == ["up on h1", "up on h2"]
    with pytest.raises(TimeoutError, match="past 1 s"):
        run_over_ssh([NodeCommand(n.node, n.destination, "sleep") for n in nodes], ssh=ssh, timeout_s=1)
    assert _running(ssh) == []


def _running(needle: str) -> list[int]:
    """Live (not zombie) processes whose command line contains `needle`."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and needle in (proc / "cmdline").read_bytes().decode(errors="replace") \
                    and "zombie" not in (proc / "status").read_text():
                out.append(int(proc.name))
        except OSError:
            continue
    return out


@pytest.mark.integration
def test_real_cpu_job_through_the_launcher(tmp_path):
    """6 gloo ranks on this machine as 4 torchrun agents (node size 2 splits node 0 in two blocks),
    started by `launch` through an ssh that runs the command locally: the worker trains to the end."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    from sailor.specs.job import JobSpec

    job = JobSpec(model="tiny", global_batch_size=8)
    plan = plan_from_dict({"micro_batch_size": 2, "stages": [[0, 3], [3, 6]], "pipelines": [
        {"microbatches": 2, "replicas": [_rep(0, "cpu", "local", 1), _rep(1, "cpu", "local", 2)]},
        {"microbatches": 2, "replicas": [_rep(0, "cpu", "local", 1), _rep(1, "cpu", "local", 2)]}]})
    plan = plan.with_specs(job, None)
    path = tmp_path / "plan.json"
    plan.save(path)
    hosts = _write_hosts(tmp_path, {"groups": [{"zone": "local", "gpu": "cpu", "gpus_per_node": 2,
                                                "hosts": ["127.0.0.1", "127.0.0.2", "127.0.0.3"]}]})
    cpu_opts = _opts(str(path), device="cpu")
    layout_agents = [a for d in launch_specs(plan, Backend.TORCHRUN, cpu_opts, hosts_path=hosts) for a in d["agents"]]
    assert len(layout_agents) == 4  # ranks {0}, {1, 2}, {3}, {4, 5}
    port = 29000 + os.getpid() % 1000
    opts = _opts(str(path), steps=2, device="cpu", python=sys.executable, rdzv_port=port,
                         checkpoint_dir=str(tmp_path / "ckpt"))
    # Like sshd: the remote command string is run by the user's shell.
    env = _fake_ssh(tmp_path, "os.execvp('sh', ['sh', '-c', sys.argv[-1]])\n")
    old_path = os.environ["PATH"]
    os.environ["PATH"] = env["PATH"]
    try:
        status = launch(plan, opts, hosts)
    finally:
        os.environ["PATH"] = old_path
    assert status == 0
    assert (tmp_path / "ckpt").exists() and any((tmp_path / "ckpt").iterdir())
