"""What a live testbed is made of, as `sailor.testbed.host.up` writes it to its state file:
its nodes' namespaces, veths, addresses and cgroups, its prefix and folder."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from sailor.core.errors import SailorInputError
from sailor.testbed import net

STATE_SCHEMA = "sailor.testbed-state/1"
OWNERS_DIR = Path("/run/sailor-testbed-owners")
"""One file per live testbed, named by its prefix, holding the path of its state file: the testbeds
of every state folder on this machine, which `down --all` of one state folder must leave alone."""


@dataclass(frozen=True)
class NodeState:
    name: str
    netns: str
    veth: str
    address: str
    router_address: str
    cgroup: str


@dataclass(frozen=True)
class TestbedState:
    """What one live testbed created: enough to enter its nodes and to remove it all."""

    __test__ = False
    name: str
    prefix: str
    block: int
    folder: str
    nodes: tuple[NodeState, ...]

    @property
    def names(self) -> net.Names:
        return net.Names(self.prefix)

    def node(self, name: str) -> NodeState:
        for n in self.nodes:
            if n.name == name or n.address == name:
                return n
        raise SailorInputError(f"testbed {self.name} has no node or address {name!r}",
                               fix=f"nodes: {', '.join(n.name for n in self.nodes)}")

    @property
    def cluster_file(self) -> Path:
        return Path(self.folder) / "cluster.yaml"

    @property
    def hosts_file(self) -> Path:
        return Path(self.folder) / "hosts.yaml"

    @property
    def bin_dir(self) -> Path:
        return Path(self.folder) / "bin"

    def to_json(self) -> str:
        return json.dumps({"schema": STATE_SCHEMA, **asdict(self)}, indent=2) + "\n"

    @classmethod
    def read(cls, path: Path) -> TestbedState:
        d = json.loads(path.read_text(encoding="utf-8"))
        assert d.pop("schema") == STATE_SCHEMA, path
        return cls(**{**d, "nodes": tuple(NodeState(**n) for n in d["nodes"])})


def record_owner(state: TestbedState, owners: Path | None = None) -> None:
    """Record that testbed `state.prefix` belongs to the state file in `state.folder` (`OWNERS_DIR`)."""
    folder = owners or OWNERS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / state.prefix).write_text(str(Path(state.folder).resolve() / "state.json"), encoding="utf-8")


def forget_owner(prefix: str, owners: Path | None = None) -> None:
    """Remove testbed `prefix`'s owner record (a missing one is fine)."""
    (Path(owners or OWNERS_DIR) / prefix).unlink(missing_ok=True)


def owned(prefix: str, owners: Path | None = None) -> bool:
    """Whether testbed `prefix` has an owner record naming a state file that still exists (a live
    testbed of some state folder); False for one without a record (made before records, or by a run
    killed before it wrote one) or whose state file is gone (a deleted state folder)."""
    record = Path(owners or OWNERS_DIR) / prefix
    try:
        return Path(record.read_text(encoding="utf-8").strip()).is_file()
    except (FileNotFoundError, NotADirectoryError):
        return False
