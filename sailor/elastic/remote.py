"""`sailor run --hosts`: the machines of HOSTS.yaml as the GPUs of an elastic run.

The trace says how many GPUs of each (zone, GPU type) are available; HOSTS.yaml
(`sailor.launch.hosts`) names the machines that hold them. A (zone, GPU type) offers at most its
usable machines x GPUs per machine, and a pair without a group offers none. A launch places the
plan's nodes (`sailor.launch.common.launch_layout`) on the group's usable machines in order, one ssh
session per node running that node's torchrun agents against the static rendezvous on rank 0's
machine. A machine is unusable, until the trace reports a different count for its zone and GPU
type (a fresh observation, as for a lost GPU on the local provider), when one of its ranks died, when
it went down whole, when ssh could not reach it, or when its node never started before the launch's
start timeout (`launches.failed_machines` says how each is told).

With live switches (the default, `sailor.elastic.inplace`) every rank is a process of its own, one
ssh session each (`process_command`), started on the machine `place` gives its node: the machines
that hold the run's processes first, so that the ranks that stay keep their process; the ranks'
process groups meet on rank 0's machine (`sailor.runtime.epochs`, ports `rdzv_port` .. +
`epochs.PORTS` - 1 there).

Every host, and the controller's machine, must see the checkpoint folder at the same path (shared
storage): the ranks write and read checkpoints there, and the controller puts each launch's plan and
the stop file in its `control/` subfolder (on NFS, attribute caching can delay a stop by the cache's
few seconds). Rank 0 writes the metrics file on its machine, which changes from launch to launch: give
a path on that shared storage too. Every host needs Sailor and torch for `python`. The ranks run with
the settings `sailor run` would give them on this machine (`Prepared.settings`), paths absolute.
"""

from __future__ import annotations

import json
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from sailor.core.errors import SailorInputError
from sailor.launch.common import LaunchOptions, check_python, launch_layout
from sailor.launch.hosts import HostGroup, HostsFile, bare_host, destination, load_hosts
from sailor.launch.torchrun import node_commands, ssh_argv
from sailor.plan.placement import rank_layout
from sailor.plan.spec import Plan
from sailor.runtime.epochs import PORTS
from sailor.runtime.launcher import EVENT_PREFIX
from sailor.runtime.prepare import Prepared
from sailor.specs.cluster import ClusterSpec

Machine = tuple[str, str, int]
"""(zone, GPU type, index of the host in its HOSTS.yaml group)."""


@dataclass(frozen=True)
class NodeLaunch:
    """How one launch runs on the machines: an ssh command per node, and where everything runs."""

    commands: list[list[str]]  # each prints a `node_up` event ({"node": its index}) first
    hosts: list[str]  # the host of each command
    node_machine: list[Machine]  # the machine of each command
    rank_machine: dict[int, Machine]  # the machine of each rank


@dataclass(frozen=True)
class HostPool:
    """The machines of HOSTS.yaml and how to start ranks on them (module docstring).

    Attributes:
        hosts: the parsed HOSTS.yaml.
        source: its path (for messages).
        node_size: GPUs per machine per GPU type (the cluster's, which the planner placed TP groups by).
        python: the interpreter on the hosts.
        rdzv_port: TCP port of the rendezvous store on rank 0's machine (live switches: the first of
            `epochs.PORTS`).
        ssh: the ssh client to run.
    """

    hosts: HostsFile
    source: str
    node_size: dict[str, int]
    python: str = "python3"
    rdzv_port: int = 29500
    ssh: str = "ssh"

    @classmethod
    def load(cls, path: str | Path, cluster: ClusterSpec, *, python: str = "python3", rdzv_port: int = 29500,
             ssh: str = "ssh") -> HostPool:
        """Read HOSTS.yaml for `cluster`.

        Raises:
            SailorInputError: a bad file, a zone the cluster's provider does not have, a group's
                gpus_per_node different from the cluster's node size (the planner keeps TP groups
                inside a node of that size), a `python` that is neither an absolute path nor a
                command name (a relative path would be taken from the remote home folder), a bad port.
        """
        hosts = load_hosts(path)
        for k, g in enumerate(hosts.groups):
            try:
                cluster.prov.region(g.zone)
            except SailorInputError as e:
                raise e.located(source=str(path), field_prefix=f"groups.{k}.zone") from None
            want = cluster.node_size(g.gpu)
            if g.gpus_per_node is not None and g.gpus_per_node != want:
                raise SailorInputError(f"{g.gpus_per_node} GPUs per node, but the cluster plans {g.gpu} nodes of {want}",
                                       source=str(path), field=f"groups.{k}.gpus_per_node",
                                       fix=f"make them agree (cluster gpus_per_node: {{{g.gpu}: ...}})")
        check_python(python)
        if not 0 < rdzv_port <= 65536 - PORTS:
            raise SailorInputError(f"must be a TCP port from 1 to {65536 - PORTS} (live switches also use the"
                                   f" {PORTS - 1} above it), got {rdzv_port}", source="--rdzv-port")
        sizes = {g.gpu: cluster.node_size(g.gpu) for g in hosts.groups}
        return cls(hosts=hosts, source=str(path), node_size=sizes, python=python, rdzv_port=rdzv_port, ssh=ssh)

    def check_covers(self, offered: set[tuple[str, str]]) -> None:
        """Raise SailorInputError unless some group has machines for a (zone, GPU type) in `offered`
        (the pairs a trace ever offers): otherwise no plan could ever run."""
        if not any(self._group(z, g) for z, g in offered):
            have = ", ".join(f"{g.gpu} in {g.zone}" for g in self.hosts.groups)
            want = ", ".join(f"{g} in {z}" for z, g in sorted(offered)) or "nothing"
            raise SailorInputError(f"no group holds GPUs the trace offers (groups: {have}; trace: {want})",
                                   source=self.source, field="groups", fix="list machines of the trace's zones and GPU types")

    def _group(self, zone: str, gpu: str) -> HostGroup | None:
        return next((g for g in self.hosts.groups if (g.zone, g.gpu) == (zone, gpu)), None)

    def usable(self, zone: str, gpu: str, lost: set[Machine]) -> list[int]:
        """Indices of the group's hosts not lost to crashes, in file order."""
        g = self._group(zone, gpu)
        return [i for i in range(len(g.hosts)) if (zone, gpu, i) not in lost] if g else []

    def capacity(self, zone: str, gpu: str, lost: set[Machine]) -> int:
        """GPUs the usable machines of (zone, GPU type) hold."""
        return len(self.usable(zone, gpu, lost)) * self.node_size.get(gpu, 0)

    def commands(self, prep: Prepared, stop_file: str, lost: set[Machine]) -> NodeLaunch:
        """The ssh command of every node of `prep.plan` on the usable machines, and where each runs.

        Raises:
            SailorInputError: the usable machines cannot hold the plan (a bug: plans follow `capacity`).
        """
        usable = {(g.zone, g.gpu): self.usable(g.zone, g.gpu, lost) for g in self.hosts.groups}
        hosts = self.hosts.model_copy(update={"groups": tuple(
            g.model_copy(update={"hosts": tuple(g.hosts[i] for i in usable[(g.zone, g.gpu)])})
            for g in self.hosts.groups if usable[(g.zone, g.gpu)])})
        layout = launch_layout(prep.plan, self.node_size)
        opts = LaunchOptions(worker=prep.settings(stop_file), rdzv_port=self.rdzv_port, python=self.python)
        cmds = node_commands(layout, opts, hosts, self.source)

        def machine(node: str) -> Machine:  # "<zone>/<gpu>/<index among the usable machines>"
            zone, gpu, index = node.rsplit("/", 2)
            return zone, gpu, usable[(zone, gpu)][int(index)]

        return NodeLaunch(commands=[ssh_argv(c.destination, f"{_say_up(k)}{c.script}", self.ssh)
                                    for k, c in enumerate(cmds)],
                          hosts=[bare_host(c.destination) for c in cmds], node_machine=[machine(c.node) for c in cmds],
                          rank_machine={info.rank: machine(info.node) for info in layout.ranks})

    def place(self, plan: Plan, lost: set[Machine], held: Counter[Machine]) -> dict[str, Machine]:
        """The machine of each node of `plan` (`rank_layout`'s node names) for a live pool: the nodes
        with the most ranks first, each on the usable machine of its (zone, GPU type) that holds the
        most of the pool's live processes (`held`), the first in file order among equals.

        Raises:
            SailorInputError: the usable machines cannot hold the plan (a bug: plans follow `capacity`).
        """
        nodes: dict[str, list[int]] = {}
        for info in rank_layout(plan, self.node_size):
            nodes.setdefault(info.node, []).append(info.rank)
        out: dict[str, Machine] = {}
        for name in sorted(nodes, key=lambda n: (-len(nodes[n]), nodes[n][0])):
            zone, gpu, _ = name.rsplit("/", 2)
            free = [m for m in ((zone, gpu, i) for i in self.usable(zone, gpu, lost)) if m not in out.values()]
            if not free:
                raise SailorInputError(f"the plan needs more {gpu} machines in {zone} than are usable",
                                       source=self.source, field="groups")
            out[name] = max(free, key=lambda m: held[m])  # (max keeps the first of equals)
        return out

    def process_command(self, m: Machine, argv: list[str], env: dict[str, str], node: int) -> list[str]:
        """The ssh command running `argv` (`env` set) on machine `m` in place of the login shell, after
        saying that node `node` is up (the `node_up` event, as `commands`' nodes do)."""
        script = " ".join(["exec", "env", *(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)])
        return ssh_argv(destination(self.hosts, self._group(m[0], m[1]), m[2]), _say_up(node) + script, self.ssh)

    def host(self, m: Machine) -> str:
        """The host name of machine `m`."""
        return self._group(m[0], m[1]).hosts[m[2]]


def _say_up(node: int) -> str:
    """Shell words printing node `node`'s `node_up` event, said first (before any rendezvous, which
    waits for every node): after a start timeout, the nodes that never said so are the ones that hung."""
    return f"echo {shlex.quote(EVENT_PREFIX + json.dumps({'event': 'node_up', 'node': node}))}; "
