"""Packaging and the Python API: the wheel without torch plans and simulates; `sailor --version`,
`python -m sailor`, `-h`, shell completion; the README's API example runs and returns what the CLI prints."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sailor
from sailor.core.errors import SailorInputError

REPO = Path(__file__).resolve().parents[1]
SAILOR = Path(sys.executable).with_name("sailor")
JOB = "model: tiny\nglobal_batch_size: 8\n"
CLUSTER = "provider: gcp\nzones:\n  us-central1-a: {A100-40: 8}\n  us-central1-b: {V100-16: 8}\n"


def _run(argv: list[str], cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout)


@pytest.mark.integration
def test_wheel_without_torch_plans_and_simulates(tmp_path):
    """Build the wheel, install it into a fresh venv without torch (offline when the dependencies are
    at hand, else from the index), and plan and simulate from a folder outside the checkout."""
    dist = tmp_path / "dist"
    r = _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(dist),
              str(REPO)])
    assert r.returncode == 0, r.stderr
    (wheel,) = dist.glob("sailor_train-*.whl")
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    pip, py, cli = (str(venv / "bin" / x) for x in ("pip", "python", "sailor"))
    r = _run([pip, "install", "--quiet", "--no-index", "--find-links", str(dist), str(wheel)])
    if r.returncode != 0:  # the dependencies (numpy, scipy, pydantic...) are not on this machine: use the index
        r = _run([pip, "install", "--quiet", str(wheel)], timeout=600)
    assert r.returncode == 0, r.stderr
    assert _run([py, "-c", "import torch"]).returncode != 0  # the plain install has no torch
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "job.yaml").write_text(JOB)
    (work / "cluster.yaml").write_text(CLUSTER)
    r = _run([cli, "plan", "--job", "job.yaml", "--cluster", "cluster.yaml", "--out", "plan.json", "--json"], cwd=work)
    assert r.returncode == 0, r.stderr
    planned = json.loads(r.stdout)
    r = _run([cli, "simulate", "plan.json", "--json"], cwd=work)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["iteration_time_s"] == pytest.approx(planned["estimate"]["iteration_time_s"], rel=1e-12)
    # the installed package, not the checkout; typed; `python -m sailor` and --version
    r = _run([py, "-c", "import sailor, pathlib; p = pathlib.Path(sailor.__file__).parent;"
              " print(p, (p / 'py.typed').exists(), (p / 'catalog' / 'gpus.yaml').exists())"], cwd=work)
    where, typed, catalog = r.stdout.split()
    assert str(venv) in where and typed == catalog == "True", r.stdout
    assert _run([py, "-m", "sailor", "--version"], cwd=work).stdout.strip() == f"sailor {sailor.__version__}"
    # training needs torch: one line, exit 2, naming the extra
    for argv in (["train", "plan.json"], ["profile", "--job", "job.yaml"]):
        r = _run([cli, *argv], cwd=work)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            f"error: `sailor {argv[0]}` needs torch, which is not installed (pip install 'sailor-train[train]')"], r.stderr


@pytest.mark.integration
def test_planning_imports_no_torch():
    code = ("import sys, sailor\n"
            "r = sailor.find_plan({'model': 'tiny', 'global_batch_size': 8}, {'zones': {'us-central1-a': {'A100-40': 4}}})\n"
            "sailor.simulate(r.plan)\n"
            "from sailor.cli import _register; _register()\n"
            "from sailor.launch import launch_specs, Backend, LaunchOptions\n"
            "from sailor.runtime.command import WorkerSettings\n"
            "worker = WorkerSettings(plan='/etc/sailor/plan.json', steps=10, device='cuda')\n"
            "launch_specs(r.plan, Backend.KUBERNETES, LaunchOptions(worker=worker))\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n")
    r = _run([sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr


@pytest.mark.integration
def test_version_help_and_completion():
    if not SAILOR.exists():
        pytest.skip(f"console script {SAILOR} is not installed (pip install -e .)")
    assert sailor.__version__ == importlib.metadata.version("sailor-train")
    assert _run([str(SAILOR), "--version"]).stdout == f"sailor {sailor.__version__}\n"
    assert _run([sys.executable, "-m", "sailor", "--version"]).stdout == f"sailor {sailor.__version__}\n"
    for argv in (["-h"], ["plan", "-h"], ["launch", "-h"]):
        r = _run([str(SAILOR), *argv])
        assert r.returncode == 0 and "Usage: sailor" in r.stdout, r.stderr
    # --show-completion guesses the shell from the parent processes (none under nohup or CI runners);
    # the variable it documents names the shell outright
    r = subprocess.run([str(SAILOR)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "_SAILOR_COMPLETE": "source_bash"})
    assert r.returncode == 0 and "_SAILOR_COMPLETE=complete_bash" in r.stdout, r.stdout + r.stderr


def test_a_command_that_trains_without_torch_says_which_extra(monkeypatch):
    import importlib.util

    from sailor.cli.common import require_torch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(SailorInputError, match=re.escape("`sailor run` needs torch, which is not installed"
                                                         " (pip install 'sailor-train[train]')")):
        require_torch("run")


def _readme_api_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


@pytest.mark.integration
def test_readme_api_example_returns_what_the_cli_prints(tmp_path, monkeypatch):
    if not SAILOR.exists():
        pytest.skip(f"console script {SAILOR} is not installed (pip install -e .)")
    monkeypatch.chdir(REPO)  # the example reads examples/ like the README's commands
    scope: dict = {}
    exec(compile(_readme_api_example(), "README.md", "exec"), scope)
    result, estimate = scope["result"], scope["estimate"]
    assert isinstance(result, sailor.PlanResult) and isinstance(estimate, sailor.Estimate)
    assert estimate.to_dict() == result.estimate.to_dict()  # the plan carries its job and cluster
    # the same search through the CLI prints the same plan and estimate
    argv = scope["CLI"].split()
    assert argv[0] == "sailor"
    r = _run([str(SAILOR), *argv[1:], "--json"])
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)
    assert printed["plan"] == result.plan.to_dict() and printed["estimate"] == result.estimate.to_dict()
    with pytest.raises(SailorInputError, match="unknown objective 'fastest'"):
        sailor.find_plan(scope["job"], scope["cluster"], objective="fastest")
    # every expression line followed by a `# (...)` comment returns what the comment says
    lines = _readme_api_example().splitlines()
    shown = [(expr, re.match(r"# (\(.*?\))", comment).group(1)) for expr, comment in zip(lines, lines[1:])
             if comment.startswith("# (")]
    assert len(shown) == 2
    for expr, value in shown:
        assert eval(expr, scope) == eval(value), expr


def test_dockerfile_matches_the_package_and_the_default_image():
    """The image the launch backends default to is the one the Dockerfile documents, with the torch
    of the `train` extra on a CUDA base (no docker here to build it)."""
    import tomllib

    from sailor.launch import DEFAULT_IMAGE

    docker = (REPO / "Dockerfile").read_text()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (torch_pin,) = [d for d in extras["train"] if d.startswith("torch")]
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+$", docker, flags=re.M)
    assert f"ARG TORCH_VERSION={torch_pin.split('==')[1]}\n" in docker and torch_pin == "torch==2.13.0"
    build = f"docker build -t {DEFAULT_IMAGE} ."
    assert DEFAULT_IMAGE == f"sailor-train:{sailor.__version__}"
    assert build in docker and build in (REPO / "README.md").read_text()
    assert 'pip install "/tmp/sailor-src[train]"' in docker  # a wheel of this package, not an editable checkout


def test_docker_base_image_asks_no_newer_cuda_than_the_torch_build():
    """The base image's CUDA version (its NVIDIA_REQUIRE_CUDA, checked against the host's driver by
    the container toolkit) must not exceed the CUDA of the torch index the Dockerfile installs from,
    or the image refuses hosts whose driver runs that torch build."""
    docker = (REPO / "Dockerfile").read_text()
    base = re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.(\d+)\.\d+-\S+$", docker, flags=re.MULTILINE)
    index = re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cu(\d+)(\d)$", docker, flags=re.MULTILINE)
    assert base and index, "CUDA_IMAGE or TORCH_INDEX not in the expected form"
    assert (int(base.group(1)), int(base.group(2))) <= (int(index.group(1)), int(index.group(2)))


def test_readme_claims_no_autocast_and_no_1f1b_only_large_models():
    """Two README claims the code had outgrown: the runtime casts its weights (bf16/fp16) and never
    calls torch.autocast, and `benchmarks/large_models.py` simulates interleaved 1F1B rows."""
    readme = (REPO / "README.md").read_text()
    runtime = "".join(f.read_text() for f in (REPO / "sailor" / "runtime").glob("*.py"))
    assert "torch.autocast(" not in runtime and "bf16 autocast" not in readme
    assert "interleaved-1f1b" in (REPO / "benchmarks" / "large_models.py").read_text()
    assert "every schedule is 1F1B" not in readme


def test_readme_cluster_example_loads_with_its_exponents(tmp_path):
    """The README's cluster block, as written (`5.0e9`, which YAML 1.1 reads as a string), is a valid
    cluster whose overrides are the numbers it shows."""
    from sailor.catalog import LinkClass
    from sailor.specs import load_cluster

    section = (REPO / "README.md").read_text().split("A **cluster**", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, flags=re.S).group(1)
    (tmp_path / "cluster.yaml").write_text(block)
    c = load_cluster(tmp_path / "cluster.yaml")
    link = c.link(LinkClass.SAME_REGION)
    assert (link.bandwidth_bytes_per_s, link.flow_bandwidth_bytes_per_s) == (5.0e9, 1.3e9)
    assert c.available("us-central1-a", "V100-16") == 96
