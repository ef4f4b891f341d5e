"""What every backend shares: a plan's nodes, its torchrun agents and their command lines.

Built on `sailor.plan.placement.rank_layout` (the one place ranks are derived). The runtime's worker
(`python -m sailor.runtime.worker`) takes its *plan* rank straight from torchrun's `RANK` and its
device from `LOCAL_RANK`. A multi-node torchrun with the static rendezvous gives agent (node rank) a
the global ranks [Σ_{a' < a} nproc(a'), ... + nproc(a)) (torch elastic `_assign_worker_ranks`), so
an agent can only host a *contiguous* block of plan ranks. rank_layout orders ranks by pipeline,
stage and TP rank, so one machine may hold several blocks (pipeline 0's stage 0 and pipeline 1's
stage 0 share a node while pipeline 0's stage 1 sits elsewhere). Hence:

- an *agent* is one torchrun process: one maximal block of consecutive plan ranks on one node;
- agents are numbered (torchrun `--node-rank`) by their first rank, so torchrun's global ranks equal
  the plan's ranks exactly and the worker needs no change;
- a node with several agents runs them side by side, each with `CUDA_VISIBLE_DEVICES` set to its
  GPUs, so torchrun's `LOCAL_RANK` k is the k-th of them (the worker picks `cuda:LOCAL_RANK`), and on
  every device with `epochs.AGENT_SLOTS_ENV` listing the same device indices (the testbed gives each
  rank its device's CPU quota by it). A TP group is consecutive ranks on one node, so it never spans
  two agents.
- the static rendezvous store is hosted by agent 0 (it holds rank 0), so the rendezvous endpoint
  is the host of rank 0's node.
Every node also needs the plan file at the same path (`LaunchOptions.worker.plan`) and Sailor
installed. Each agent runs the worker with `LaunchOptions.worker.argv()` (`sailor.runtime.command`,
the one builder of the worker's command line), so every rank gets the same settings.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field

from sailor import catalog
from sailor.core.errors import SailorInputError
from sailor.plan.placement import RankInfo, rank_layout
from sailor.plan.spec import Plan
from sailor.runtime.command import WorkerSettings, option
from sailor.runtime.epochs import AGENT_SLOTS_ENV

RDZV_HOST_VAR = "SAILOR_RDZV_HOST"  # shell variable holding the rendezvous host where none is known yet


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How the workers are started on every node.

    Attributes:
        worker: every rank's settings (the plan, data, initial weights, checkpoint folder, metrics
            file...), paths as seen on the nodes, the same everywhere; device cuda on GPU nodes,
            cpu (gloo) for a CPU test run.
        rdzv_port: TCP port of the static rendezvous store on rank 0's host (torchrun's default 29500).
        python: Python interpreter on the nodes (with Sailor and torch installed).
        rdzv_timeout_s: seconds the rendezvous waits for every agent to join (torchrun's static
            rendezvous `--rdzv-conf timeout`, 600 s by default when None); cloud backends wait
            longer because their nodes are provisioned one group at a time.
        resume_newest: resume from the newest `step-*` checkpoint in `worker.checkpoint_dir` when
            there is one and `worker.resume_from` is None (a Kubernetes JobSet restarted as a whole
            continues instead of starting again).
    """

    worker: WorkerSettings
    rdzv_port: int = 29500
    python: str = "python3"
    rdzv_timeout_s: int | None = None
    resume_newest: bool = False


@dataclass(frozen=True)
class Agent:
    """One torchrun process: `ranks` (consecutive plan ranks) on GPUs `local_gpus` of node `node`."""

    agent_rank: int  # torchrun --node-rank
    node: str
    ranks: tuple[int, ...]
    local_gpus: tuple[int, ...]  # GPU index on the node of each rank (its rank_layout local_rank)


@dataclass(frozen=True)
class Node:
    """One machine of the plan: `gpus_per_node` GPUs of type `gpu` in `zone`, running `agents`."""

    name: str  # rank_layout's "<zone>/<gpu>/<index>"
    zone: str
    gpu: str
    index: int  # node index within its (GPU type, zone) group
    gpus_per_node: int
    agents: tuple[Agent, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for a in self.agents for r in a.ranks)


@dataclass(frozen=True)
class Group:
    """The nodes of one (GPU type, zone): one SkyPilot task or one Kubernetes Job."""

    gpu: str
    zone: str
    nodes: tuple[Node, ...]

    @property
    def name(self) -> str:
        """A DNS-1123 label, e.g. "a100-40-us-central1-a"."""
        return f"{self.gpu}-{self.zone}".lower().replace("_", "-")

    @property
    def gpus_per_node_used(self) -> int:
        """Most GPUs any node of the group uses."""
        return max(len(n.ranks) for n in self.nodes)


@dataclass(frozen=True)
class LaunchLayout:
    """A plan's nodes and agents; `agents` is indexed by torchrun node rank."""

    plan: Plan
    ranks: tuple[RankInfo, ...]
    nodes: tuple[Node, ...]
    agents: tuple[Agent, ...] = field(repr=False)

    @property
    def rdzv_node(self) -> Node:
        """The node holding rank 0: it hosts the rendezvous store."""
        return next(n for n in self.nodes if 0 in n.ranks)

    def groups(self) -> list[Group]:
        """Nodes grouped by (GPU type, zone), the group of rank 0 first, then in plan order."""
        out: dict[tuple[str, str], list[Node]] = {}
        first = self.rdzv_node
        out[(first.gpu, first.zone)] = []
        for n in self.nodes:
            out.setdefault((n.gpu, n.zone), []).append(n)
        return [Group(gpu=g, zone=z, nodes=tuple(ns)) for (g, z), ns in out.items()]


def node_sizes(plan: Plan, overrides: dict[str, int] | None = None) -> dict[str, int]:
    """GPUs per node of each GPU type: `overrides`, else the plan's cluster, else the catalog."""
    sizes: dict[str, int] = {}
    for p in plan.pipelines:
        for r in p.replicas:
            if overrides and r.gpu in overrides:
                sizes[r.gpu] = overrides[r.gpu]
            elif plan.cluster is not None:
                sizes[r.gpu] = plan.cluster.node_size(r.gpu)
            else:
                sizes[r.gpu] = catalog.gpu(r.gpu).gpus_per_node
    return sizes


def launch_layout(plan: Plan, gpus_per_node: dict[str, int] | None = None) -> LaunchLayout:
    """Nodes and torchrun agents of `plan` (module docstring).

    Args:
        plan: the plan.
        gpus_per_node: GPUs per node per GPU type (default: `node_sizes(plan)`).
    Returns:
        LaunchLayout; asserts that every plan rank is in exactly one agent and that agent a starts
        at rank Σ_{a' < a} nproc(a') (what torchrun assigns).
    """
    sizes = gpus_per_node or node_sizes(plan)
    ranks = rank_layout(plan, sizes)
    by_node: dict[str, list[RankInfo]] = {}
    for info in ranks:
        by_node.setdefault(info.node, []).append(info)
    blocks: list[tuple[str, list[RankInfo]]] = []  # maximal runs of consecutive ranks on one node
    for name, infos in by_node.items():
        run = [infos[0]]
        for info in infos[1:]:
            if info.rank == run[-1].rank + 1:
                run.append(info)
            else:
                blocks.append((name, run))
                run = [info]
        blocks.append((name, run))
    blocks.sort(key=lambda b: b[1][0].rank)
    agents = [Agent(agent_rank=a, node=name, ranks=tuple(i.rank for i in run),
                    local_gpus=tuple(i.local_rank for i in run)) for a, (name, run) in enumerate(blocks)]
    nodes = []
    for name, infos in by_node.items():
        zone, gpu, index = infos[0].zone, infos[0].gpu, int(name.rsplit("/", 1)[1])
        nodes.append(Node(name=name, zone=zone, gpu=gpu, index=index, gpus_per_node=max(sizes[gpu], infos[0].tp),
                          agents=tuple(a for a in agents if a.node == name)))
    start = 0
    for a in agents:  # torchrun's rank assignment reproduces the plan's ranks
        assert a.ranks == tuple(range(start, start + len(a.ranks)))
        start += len(a.ranks)
    assert start == plan.world_size
    return LaunchLayout(plan=plan, ranks=tuple(ranks), nodes=tuple(nodes), agents=tuple(agents))


def agent_command(agent: Agent, layout: LaunchLayout, opts: LaunchOptions, rdzv_host: str) -> str:
    """The shell command that starts `agent`: `env SAILOR_AGENT_SLOTS=.. [CUDA_VISIBLE_DEVICES=..] python -m
    sailor.runtime.launcher ...` running the worker (`torchrun_command`; both list the agent's
    device indices on its node, `epochs.AGENT_SLOTS_ENV`; CUDA_VISIBLE_DEVICES on cuda only).

    `rdzv_host` is put in literally, except a string starting with `$` (a shell variable), which
    is left for the shell to expand.
    """
    slots = ",".join(map(str, agent.local_gpus))
    env = {AGENT_SLOTS_ENV: slots, **({"CUDA_VISIBLE_DEVICES": slots} if opts.worker.device == "cuda" else {})}
    cmd = torchrun_command(opts.python, opts.worker.argv(), nnodes=len(layout.agents), node_rank=agent.agent_rank,
                           nproc=len(agent.ranks), rdzv_host=rdzv_host, rdzv_port=opts.rdzv_port,
                           rdzv_timeout_s=opts.rdzv_timeout_s, env=env)
    if _resumes(opts):  # set by node_script; no checkpoint yet: no --resume-from
        cmd += f' ${{{RESUME_VAR}:+"{option("resume_from")}=${RESUME_VAR}"}}'
    return cmd


def torchrun_command(python: str, entry: list[str], *, nnodes: int, node_rank: int, nproc: int, rdzv_host: str,
                     rdzv_port: int, rdzv_timeout_s: int | None = None, env: dict[str, str] | None = None) -> str:
    """The shell command of one torchrun agent of a static rendezvous on `rdzv_host`:`rdzv_port`:
    `env OMP_NUM_THREADS=1 [env] python -m sailor.runtime.launcher --nnodes N --node-rank K
    --nproc-per-node P --rdzv-backend static --max-restarts 0 [--rdzv-conf timeout=T] --rdzv-endpoint
    HOST:PORT ENTRY...` (torchrun, made to end when the shell that started it ends, so no agent
    outlives its ssh session; it keeps torchrun's logs in a scratch folder of its own on the node,
    removed when it ends, `runtime.launcher._main`). `entry`: what torchrun runs (`-m MODULE ARGS` or `SCRIPT ARGS`).
    `rdzv_host` is put in literally, except a string starting with `$` (a shell variable), which is
    left for the shell to expand."""
    host = f"${{{rdzv_host[1:]}}}" if rdzv_host.startswith("$") else shlex.quote(rdzv_host)
    env = {"OMP_NUM_THREADS": "1", **(env or {})}  # torchrun's default too, said explicitly so every rank gets it
    torchrun = [python, "-m", "sailor.runtime.launcher", "--nnodes", str(nnodes), "--node-rank", str(node_rank),
                "--nproc-per-node", str(nproc), "--rdzv-backend", "static", "--max-restarts", "0"]
    if rdzv_timeout_s is not None:
        torchrun += ["--rdzv-conf", f"timeout={rdzv_timeout_s}"]
    return " ".join(["env", *(f"{k}={v}" for k, v in env.items()), *map(shlex.quote, torchrun),
                     "--rdzv-endpoint", f"{host}:{rdzv_port}", *map(shlex.quote, entry)])


RESUME_VAR = "SAILOR_RESUME"  # shell variable: the newest checkpoint folder, or empty


def _resumes(opts: LaunchOptions) -> bool:
    return opts.resume_newest and bool(opts.worker.checkpoint_dir) and opts.worker.resume_from is None


def node_script(node: Node, layout: LaunchLayout, opts: LaunchOptions, rdzv_host: str) -> str:
    """The shell script one node runs: its agents side by side; exits non-zero if any agent fails."""
    cmds = [agent_command(a, layout, opts, rdzv_host) for a in node.agents]
    # Checkpoint folders are step-<8 digits> (renamed into place when complete): the last in sorted order is the newest.
    find = (f"{RESUME_VAR}=$(ls -d -- {shlex.quote(opts.worker.checkpoint_dir)}/step-[0-9]* 2>/dev/null | tail -n 1); "
            if _resumes(opts) else "")
    if len(cmds) == 1:
        return find + cmds[0]
    started = " & ".join(cmds) + " &"
    return f"{find}fail=0; {started} for p in $(jobs -p); do wait $p || fail=1; done; exit $fail"


def ranks_doc(node: Node) -> dict:
    """The YAML-ready summary of a node's agents (torchrun node rank, plan ranks, GPUs)."""
    return {"agents": [{"node_rank": a.agent_rank, "ranks": list(a.ranks), "gpus": list(a.local_gpus)}
                       for a in node.agents]}


PYTHON = re.compile(r"/[\w.+/-]+|\w[\w.+-]*")  # an absolute path, or a command looked up on the nodes' PATH


def check_python(python: str) -> None:
    """Raise SailorInputError unless `python` is an absolute path or a command name (a relative path
    would be taken from the remote home folder; anything else would be read by the remote shell)."""
    if not PYTHON.fullmatch(python):
        raise SailorInputError(f"{python!r} is not an absolute path or a command name", source="--python",
                               fix="e.g. /opt/sailor/.venv/bin/python (the same on every node) or python3")


def check_options(opts: LaunchOptions, plan: Plan) -> None:
    """Raise SailorInputError unless the worker's device suits the plan (cuda cannot run GPU type
    cpu; cpu may test-run any plan), and the interpreter and port are valid (`WorkerSettings`
    checked the rest when it was built)."""
    check_python(opts.python)
    catalog.check_device(opts.worker.device, (g for _, g in plan.gpu_usage()), what="the plan runs on",
                         cpu_runs_any=True)
    if not 0 < opts.rdzv_port < 65536:
        raise SailorInputError(f"--rdzv-port must be a TCP port (1-65535), got {opts.rdzv_port}", source="--rdzv-port")


def round_up_pow2(n: int, cap: int) -> int:
    """Smallest power of two >= n, at most `cap` (cloud VM shapes come with 1, 2, 4, 8 ... GPUs)."""
    return min(cap, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def backend_name(table: dict[str, str], gpu: str, what: str) -> str:
    """`gpu`'s name in a backend's `table`; SailorInputError naming `what` (e.g. "GKE accelerator
    label") and the known types when the backend has none."""
    try:
        return table[gpu]
    except KeyError:
        raise SailorInputError(f"GPU type {gpu} has no {what}",
                               fix=f"known: {', '.join(sorted(table))}" if table else "it has none") from None


# An image reference as the OCI distribution spec writes it: [host[:port]/]path[:tag][@algorithm:hex]
# (https://github.com/distribution/reference, "Grammar"); path components lower case.
_IMAGE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]+)?/)?"
                    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
                    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,})?")


def check_image(image: str) -> None:
    """Raise SailorInputError unless `image` is a container image reference (`_IMAGE`), e.g.
    `sailor-train:0.1.0` or `registry.example.com:5000/team/sailor-train:0.1.0`."""
    if not image.strip():
        raise SailorInputError("the container image is empty", source="--image",
                               fix="e.g. sailor-train:0.1.0 built from the Dockerfile and pushed to your registry")
    if len(image) > 255 or not _IMAGE.fullmatch(image):
        raise SailorInputError(f"{image[:80]!r} is not a container image reference", source="--image",
                               fix="e.g. sailor-train:0.1.0 or registry.example.com/team/sailor-train:0.1.0")
