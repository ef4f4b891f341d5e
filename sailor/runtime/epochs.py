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
  under it}}: the processes move the state in memory (`inplace`).
Rendezvous files of epoch k (torch FileStores, a fresh one per process group formed) are
`epoch-<k>.<name>` beside it. A file appears whole (written to a temporary name, then renamed), and
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


@dataclass(frozen=True)
class Epoch:
    """One epoch file, read (module docstring). Process ids and ranks are ints."""

    number: int
    argv: list[str]
    ranks: dict[int, int]
    old_plan: str | None = None
    old_ranks: dict[int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        old = None if self.old_plan is None else {"plan": self.old_plan, "ranks": self.old_ranks}
        return {"epoch": self.number, "argv": self.argv, "ranks": self.ranks, "old": old}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Epoch:
        old = d.get("old")
        return Epoch(int(d["epoch"]), list(d["argv"]), {int(p): int(r) for p, r in d["ranks"].items()},
                     None if old is None else old["plan"],
                     None if old is None else {int(p): int(r) for p, r in old["ranks"].items()})


def epoch_file(control: str | Path, k: int) -> Path:
    return Path(control) / f"epoch-{k:04d}.json"


def store_file(control: str | Path, k: int, name: str) -> Path:
    """The FileStore path of rendezvous `name` of epoch `k` (it must not exist before the rendezvous)."""
    return Path(control) / f"epoch-{k:04d}.{name}"


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
