"""The control channel of live reconfiguration (`sailor run --in-place`): numbered epoch files the
controller writes into a control folder, which the rank processes it started read (torch-free; the
controller side is `sailor.elastic.inplace`, the ranks' side `sailor.runtime.inplace`).

`epoch-<k>.json` says, for epoch k (0 at the start, one more per switch):
- "argv": the worker settings of the epoch (`command.WorkerSettings.argv` less the module), with the
  epoch's plan and its own stop file;
- "ranks": {process id: rank under the epoch's plan} (the other processes of the pool have no rank:
  spares wait for a later epoch, processes of the last epoch leave);
- "old": null when the ranks build their state from the checkpoint or the initial weights (epoch 0,
  and a restart after a failure); else {"plan": the last epoch's plan file, "ranks": {process id: rank
  under it}}: the processes move the state in memory (`inplace`);
- "hosts": null on this machine (the local provider); on named machines (`sailor run --hosts`)
  {process id: the host its process runs on}, with "port": the rendezvous port on them;
- "leave": processes that exit once their part in the epoch's switch is done (their machine is given
  back: no rank of the epoch runs on it).
Each process group an epoch forms (`STORES`: "train", the training world; "move", a switch's move
group) meets at its own rendezvous store (`init_method`): on this machine a torch FileStore
`epoch-<k>.<name>` beside the epoch file; on named machines a TCPStore on the host of the group's
first process, port `store_port` (a fresh port per store, so none is bound twice while an old one
may still hold it). A file appears whole (written to a temporary name, then renamed), and
the controller writes epoch k+1 before it asks epoch k's ranks to stop, so a rank that stops finds it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POLL_S = 0.005  # how often a waiting process looks for the next epoch file
STORES = ("train", "move")  # the rendezvous stores of an epoch (module docstring)
PORTS = 32  # rendezvous ports on named machines: "port" .. "port" + PORTS - 1, in turn
SLOT_ENV = "SAILOR_SLOT"
"""Environment variable of a pool process on a named machine: its device index there (a GPU is a
slot), fixed for the process's life; the rank's LOCAL_RANK (`runtime.inplace.settings`) and the
testbed's per-rank quota (`testbed.cgroups.rank_slot`) follow it."""
FAULT_MOVE_ENV = "SAILOR_FAULT_MOVE"
"""Test hook: "<process id>:<epoch>" makes that pool process die (exit 13) in that switch, once its
move group has formed (`runtime.inplace.switch`). The pool passes the controller's value on in each
process's command on named machines (`elastic.inplace`), since ssh forwards no environment."""
AGENT_SLOTS_ENV = "SAILOR_AGENT_SLOTS"
"""Environment variable of a torchrun agent (`launch.common.agent_command`), on every device: the
device indices on its node of its ranks, comma-separated, in LOCAL_RANK order (on CUDA the same list
as its CUDA_VISIBLE_DEVICES). A node may run several agents, each with LOCAL_RANK from 0, so a rank's
device on the node is this list's LOCAL_RANK-th entry (`testbed.cgroups.rank_slot`)."""


@dataclass(frozen=True)
class Epoch:
    """One epoch file, read (module docstring). Process ids and ranks are ints."""

    number: int
    argv: list[str]
    ranks: dict[int, int]
    old_plan: str | None = None
    old_ranks: dict[int, int] | None = None
    hosts: dict[int, str] | None = None
    port: int = 0
    leave: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        old = None if self.old_plan is None else {"plan": self.old_plan, "ranks": self.old_ranks}
        return {"epoch": self.number, "argv": self.argv, "ranks": self.ranks, "old": old, "hosts": self.hosts,
                "port": self.port, "leave": list(self.leave)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Epoch:
        old, hosts = d.get("old"), d.get("hosts")
        return Epoch(int(d["epoch"]), list(d["argv"]), {int(p): int(r) for p, r in d["ranks"].items()},
                     None if old is None else old["plan"],
                     None if old is None else {int(p): int(r) for p, r in old["ranks"].items()},
                     None if hosts is None else {int(p): str(h) for p, h in hosts.items()}, int(d.get("port", 0)),
                     tuple(int(p) for p in d.get("leave", ())))

    @property
    def first(self) -> int:
        """The process of rank 0."""
        return min(self.ranks, key=self.ranks.get)


def epoch_file(control: str | Path, k: int) -> Path:
    return Path(control) / f"epoch-{k:04d}.json"


def store_file(control: str | Path, k: int, name: str) -> Path:
    """The FileStore path of rendezvous `name` of epoch `k` (it must not exist before the rendezvous)."""
    return Path(control) / f"epoch-{k:04d}.{name}"


def store_port(base: int, k: int, name: str) -> int:
    """The TCP port of rendezvous store `name` of epoch `k` on named machines: `base` + the store's
    turn modulo PORTS (two stores per epoch)."""
    return base + (len(STORES) * k + STORES.index(name)) % PORTS


def init_method(control: str | Path, e: Epoch, name: str, first: int) -> str:
    """`init_process_group`'s init_method for store `name` of epoch `e` whose group's rank 0 is process
    `first`: `file://` the store file on this machine, `tcp://HOST:PORT` on `first`'s host on named
    machines (module docstring)."""
    if e.hosts is None:
        return f"file://{store_file(control, e.number, name)}"
    host = e.hosts[first]
    return f"tcp://{f'[{host}]' if ':' in host else host}:{store_port(e.port, e.number, name)}"


def publish(control: str | Path, epoch: Epoch) -> Path:
    """Write epoch file `epoch.number` whole (temporary name, then rename); returns its path."""
    path = epoch_file(control, epoch.number)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(epoch.to_dict()))
    os.replace(tmp, path)
    return path


def read(control: str | Path, k: int) -> Epoch | None:
    """Epoch `k`, or None while its file does not exist."""
    try:
        return Epoch.from_dict(json.loads(epoch_file(control, k).read_text()))
    except FileNotFoundError:
        return None


def wait(control: str | Path, k: int) -> Epoch:
    """Block until epoch `k` is published (a process waiting here ends with the controller, whose
    death signals it: `core.process.die_with_parent`)."""
    while (e := read(control, k)) is None:
        time.sleep(POLL_S)
    return e
