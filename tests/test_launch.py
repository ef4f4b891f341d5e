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

from sailor.errors import SailorInputError
from sailor.launch import Backend, LaunchOptions, dump_documents, launch, launch_specs
from sailor.launch.common import launch_layout
from sailor.plan import Plan, plan_from_dict, rank_layout

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
OPTS = LaunchOptions(plan_path="/data/plan.json", steps=3)
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


def test_skypilot_tasks():
    docs = launch_specs(GEO, Backend.SKYPILOT, OPTS, local_plan="/home/me/plan.json")
    parsed = list(yaml.safe_load_all(dump_documents(docs)))
    assert len(parsed) == 3  # (A100-40, us-central1-a), (V100-16, us-central1-b), (V100-16, us-west1-b)
    for t in parsed:
        assert {"name", "num_nodes", "resources", "setup", "run", "envs", "file_mounts"} <= set(t)
        assert {"cloud", "zone", "accelerators"} <= set(t["resources"])
        assert "$SKYPILOT_NODE_RANK" in t["run"] and t["file_mounts"] == {"/data/plan.json": "/home/me/plan.json"}
    first = parsed[0]
    assert first["resources"]["accelerators"] == "A100:8" and first["resources"]["zone"] == "us-central1-a"
    assert first["resources"]["ports"] == [29500] and 'SKYPILOT_NODE_IPS' in first["run"]
    assert parsed[2]["resources"]["accelerators"] == "V100:2" and parsed[2]["num_nodes"] == 1
    assert all("SAILOR_RDZV_HOST:?" in t["run"] for t in parsed[1:])
    _check_torchrun_ranks([a for t in parsed for a in _agents_in(t["run"])], GEO)


def test_kubernetes_manifests():
    opts = LaunchOptions(plan_path="/etc/sailor/plan.json", steps=3)
    docs = launch_specs(GEO, Backend.KUBERNETES, opts, image="example.com/sailor:1")
    parsed = list(yaml.safe_load_all(dump_documents(docs)))
    kinds = [d["kind"] for d in parsed]
    assert kinds == ["ConfigMap", "Service", "Job", "Job", "Job"]
    assert plan_from_dict(json.loads(parsed[0]["data"]["plan.json"])) == GEO.with_specs(None, None)
    assert parsed[1]["spec"]["clusterIP"] == "None"
    agents = []
    for job in parsed[2:]:
        assert job["apiVersion"] == "batch/v1" and {"name", "namespace"} <= set(job["metadata"])
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
        pod = spec["template"]["spec"]
        assert set(pod["nodeSelector"]) == {"cloud.google.com/gke-accelerator", "topology.kubernetes.io/zone"}
        (c,) = pod["containers"]
        assert c["image"] == "example.com/sailor:1" and c["resources"]["limits"]["nvidia.com/gpu"] >= 1
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["SAILOR_RDZV_HOST"] == "sailor-a100-40-us-central1-a-0.sailor-nodes.default.svc.cluster.local"
        assert "$JOB_COMPLETION_INDEX" in c["command"][-1]
        agents += _agents_in(c["command"][-1])
    assert parsed[2]["spec"]["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-tesla-a100"
    assert parsed[3]["spec"]["template"]["spec"]["nodeSelector"]["topology.kubernetes.io/zone"] == "us-central1-b"
    _check_torchrun_ranks(agents, GEO)


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
        launch_specs(cpu, Backend.KUBERNETES, LaunchOptions(plan_path="/etc/sailor/plan.json", device="cpu"))
    with pytest.raises(SailorInputError, match="no SkyPilot accelerator"):
        launch_specs(cpu, Backend.SKYPILOT, LaunchOptions(plan_path="/data/plan.json", device="cpu"))
    with pytest.raises(SailorInputError, match="plan runs on GPU type cpu"):
        launch_specs(cpu, Backend.TORCHRUN, OPTS)
    with pytest.raises(SailorInputError, match="mounted from a ConfigMap"):
        launch_specs(GEO, Backend.KUBERNETES, LaunchOptions(plan_path="/data/my-plan.json"))
    with pytest.raises(SailorInputError, match="unknown device"):
        launch_specs(GEO, Backend.TORCHRUN, LaunchOptions(plan_path="p", device="tpu"))


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    if not SAILOR.exists():
        pytest.skip(f"console script {SAILOR} is not installed (pip install -e .)")
    return subprocess.run([str(SAILOR), *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_errors_are_one_line(tmp_path):
    plan = tmp_path / "plan.json"
    GEO.save(plan)
    for args, match in [(["--backend", "slurm", "--dry-run"], "unknown backend 'slurm'"),
                        (["--backend", "torchrun"], "needs --hosts"),
                        (["--backend", "skypilot"], "only writes specs")]:
        r = _cli("launch", str(plan), *args)
        assert r.returncode == 2 and match in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    bad = _write_hosts(tmp_path, {"groups": [{"zone": "us-central1-a", "gpu": "A100-40", "hosts": ["a0", "a1"]}]})
    r = _cli("launch", str(plan), "--backend", "torchrun", "--hosts", str(bad), "--dry-run")
    assert r.returncode == 2 and "us-central1-b" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # A plan on GPU type cpu: --device cuda is refused up front; by default its ranks get --device cpu.
    cpu = tmp_path / "cpu.json"
    plan_from_dict({"micro_batch_size": 1, "stages": [[0, 6]],
                    "pipelines": [{"microbatches": 1, "replicas": [_rep(0, "cpu", "local", 1)]}]}).save(cpu)
    r = _cli("launch", str(cpu), "--backend", "torchrun", "--device", "cuda", "--dry-run")
    assert r.returncode == 2 and "--device: the plan runs on GPU type cpu" in r.stderr, r.stderr
    r = _cli("launch", str(cpu), "--backend", "torchrun", "--dry-run")
    assert r.returncode == 0 and "--device cpu" in r.stdout and "CUDA_VISIBLE_DEVICES" not in r.stdout, r.stderr
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


def test_cli_starts_every_node_over_ssh(tmp_path):
    plan = tmp_path / "plan.json"
    GEO.save(plan)
    env = _fake_ssh(tmp_path, "sys.exit(0)\n")
    r = _cli("launch", str(plan), "--backend", "torchrun", "--hosts", str(_write_hosts(tmp_path)), "--steps", "7",
             env=env)
    assert r.returncode == 0, r.stderr
    calls = _calls(tmp_path)
    assert sorted(c[-2] for c in calls) == ["admin@w0", "ubuntu@a0", "ubuntu@a1", "ubuntu@b0"]
    assert all(c[1:3] == ["-o", "BatchMode=yes"] and c[-4:-2] == ["-tt", "--"] and c[-1].startswith("bash -c ")
               for c in calls)
    _check_torchrun_ranks([a for c in calls for a in _agents_in(c[-1])], GEO)
    assert all("--steps 7" in c[-1] and f"--plan {plan.resolve()}" in c[-1] for c in calls)


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


def test_real_cpu_job_through_the_launcher(tmp_path):
    """6 gloo ranks on this machine as 4 torchrun agents (node size 2 splits node 0 in two blocks),
    started by `launch` through an ssh that runs the command locally: the worker trains to the end."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    from sailor.specs import JobSpec

    job = JobSpec(model="tiny", global_batch_size=8)
    plan = plan_from_dict({"micro_batch_size": 2, "stages": [[0, 3], [3, 6]], "pipelines": [
        {"microbatches": 2, "replicas": [_rep(0, "cpu", "local", 1), _rep(1, "cpu", "local", 2)]},
        {"microbatches": 2, "replicas": [_rep(0, "cpu", "local", 1), _rep(1, "cpu", "local", 2)]}]})
    plan = plan.with_specs(job, None)
    path = tmp_path / "plan.json"
    plan.save(path)
    hosts = _write_hosts(tmp_path, {"groups": [{"zone": "local", "gpu": "cpu", "gpus_per_node": 2,
                                                "hosts": ["127.0.0.1", "127.0.0.2", "127.0.0.3"]}]})
    cpu_opts = LaunchOptions(plan_path=str(path), device="cpu")
    layout_agents = [a for d in launch_specs(plan, Backend.TORCHRUN, cpu_opts, hosts_path=hosts) for a in d["agents"]]
    assert len(layout_agents) == 4  # ranks {0}, {1, 2}, {3}, {4, 5}
    port = 29000 + os.getpid() % 1000
    opts = LaunchOptions(plan_path=str(path), steps=2, device="cpu", python=sys.executable, rdzv_port=port,
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
