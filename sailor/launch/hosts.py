"""HOSTS.yaml: which machines run a plan's nodes (for `sailor launch --backend torchrun`).

```yaml
user: ubuntu                  # ssh user for every host (optional; per group or host too)
groups:                       # machines per (zone, GPU type), used in order for node 0, 1, ...
  - zone: us-central1-a
    gpu: A100-40
    gpus_per_node: 8          # optional: GPUs per machine (`sailor launch`: default the plan's cluster,
                              # else the catalog; `sailor run` only checks it equals the cluster's)
    hosts: [10.0.0.11, 10.0.0.12]
  - zone: us-west1-b
    gpu: V100-16
    user: admin
    hosts: [10.1.0.5]
```
A group may list more machines than the plan needs (spares stay unused); fewer is an error naming
the group. Hosts are what `ssh` takes: names from ~/.ssh/config or addresses (letters, digits and
`.-_:%[]`, optionally `user@` first; never starting with `-`, which ssh would read as an option), each
listed once in the whole file.

The rendezvous store (torchrun's c10d store on node 0's machine, rank 0) takes any connection
without authentication (torch docs, "torchrun (Elastic Launch)": the store is meant for a trusted
network). `check_rendezvous` refuses a node 0 given as a public IP address (not private, loopback,
link-local or shared, Python's `ipaddress.is_global`) unless the caller accepts it
(`sailor launch --allow-public-rendezvous`); host names are not resolved, so they pass.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from sailor import catalog
from sailor.core.errors import SailorInputError, did_you_mean, show
from sailor.core.fileio import load_mapping
from sailor.core.limits import MAX_GPUS_PER_NODE
from sailor.core.schema import SPEC_CONFIG, Whole, parse_model
from sailor.launch.common import LaunchLayout, Node

_HOST = re.compile(r"(?:[A-Za-z0-9._-]+@)?[A-Za-z0-9._:%\[\]][A-Za-z0-9._:%\[\]-]*")
_USER = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]*")


def _check_user(v: str | None) -> str | None:
    if v is not None and (len(v) > 64 or not _USER.fullmatch(v)):
        raise ValueError(f"{show(v)} is not a user name")
    return v


class HostGroup(BaseModel):
    """The machines of one (zone, GPU type)."""

    model_config = SPEC_CONFIG
    zone: str = Field(min_length=1, max_length=200)
    gpu: str
    hosts: tuple[str, ...] = Field(min_length=1)
    user: str | None = None
    gpus_per_node: Whole(1, MAX_GPUS_PER_NODE) | None = None

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: str) -> str:
        return catalog.canonical_gpu(v)

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for h in v:
            if len(h) > 255 or not _HOST.fullmatch(h) or h.startswith("-"):
                raise ValueError(f"{show(h)} is not a host name or address ssh can take")
        return v

    _user = field_validator("user")(classmethod(lambda cls, v: _check_user(v)))


class HostsFile(BaseModel):
    """A HOSTS.yaml file (module docstring)."""

    model_config = SPEC_CONFIG
    user: str | None = None
    groups: tuple[HostGroup, ...] = Field(min_length=1)

    _user = field_validator("user")(classmethod(lambda cls, v: _check_user(v)))

    def gpus_per_node(self) -> dict[str, int]:
        """GPUs per node per GPU type given in the file (types without one are left out)."""
        return {g.gpu: g.gpus_per_node for g in self.groups if g.gpus_per_node}


def load_hosts(path: str | Path) -> HostsFile:
    """Read HOSTS.yaml; raises SailorInputError naming the file and field."""
    hosts = parse_model(HostsFile, load_mapping(path), str(path))
    seen: dict[tuple[str, str], int] = {}
    for k, g in enumerate(hosts.groups):
        if (g.zone, g.gpu) in seen:
            raise SailorInputError(f"{g.gpu} in {g.zone} is listed twice (groups {seen[(g.zone, g.gpu)]} and {k})",
                                   source=str(path), field=f"groups.{k}", fix="merge their hosts")
        seen[(g.zone, g.gpu)] = k
    where: dict[str, str] = {}
    for k, g in enumerate(hosts.groups):
        for i, h in enumerate(g.hosts):
            if bare_host(h) in where:  # one machine in two places would run two nodes' ranks on its GPUs
                raise SailorInputError(f"host {bare_host(h)} is listed twice ({where[bare_host(h)]} and groups.{k}.hosts.{i})",
                                       source=str(path), field=f"groups.{k}.hosts.{i}", fix="list every machine once")
            where[bare_host(h)] = f"groups.{k}.hosts.{i}"
    return hosts


def check_group_zones(hosts: HostsFile, plan_zones: set[str], source: str = "HOSTS.yaml") -> None:
    """Raise SailorInputError for a group in a zone neither the plan (its cluster's and its replicas'
    zones, `plan_zones`) nor the catalog knows: a misspelt zone would leave the group's machines
    silently unused (a spare group in a known zone is fine).

    Raises:
        SailorInputError: naming `source` and groups.<k>.zone, with the closest known zone.
    """
    for k, g in enumerate(hosts.groups):
        if g.zone in plan_zones or g.zone in catalog.known_zones():
            continue
        hint = did_you_mean(g.zone, plan_zones | catalog.known_zones())
        raise SailorInputError(f"unknown zone {show(g.zone)}: neither the plan nor the catalog has it", source=source,
                               field=f"groups.{k}.zone",
                               fix=hint or f"the plan's zones: {', '.join(sorted(plan_zones))}")


def assign_hosts(layout: LaunchLayout, hosts: HostsFile, source: str = "HOSTS.yaml") -> dict[str, str]:
    """ssh destination ("user@host" or "host") of every node of `layout`, keyed by node name.

    Raises:
        SailorInputError: a (zone, GPU type) of the plan has no group, or fewer hosts than nodes.
    """
    groups = {(g.zone, g.gpu): g for g in hosts.groups}
    out: dict[str, str] = {}
    needed: dict[tuple[str, str], list[Node]] = {}
    for n in layout.nodes:
        needed.setdefault((n.zone, n.gpu), []).append(n)
    for (zone, gpu), nodes in needed.items():
        g = groups.get((zone, gpu))
        if g is None:
            have = ", ".join(f"{x.gpu} in {x.zone}" for x in hosts.groups)
            raise SailorInputError(f"the plan runs {len(nodes)} {gpu} node(s) in {zone} but no group lists them"
                                   f" (groups: {have})", source=source, field="groups",
                                   fix=f"add a group with zone: {zone}, gpu: {gpu}")
        if len(g.hosts) < len(nodes):
            raise SailorInputError(f"the plan needs {len(nodes)} {gpu} node(s) in {zone} but {len(g.hosts)}"
                                   f" host(s) are listed", source=source, field=f"groups.{zone}/{gpu}.hosts")
        for n in nodes:
            out[n.name] = destination(hosts, g, n.index)
    return out


def destination(hosts: HostsFile, group: HostGroup, index: int) -> str:
    """ssh destination ("user@host" or "host") of machine `index` of `group`."""
    user, host = group.user or hosts.user, group.hosts[index]
    return f"{user}@{host}" if user and "@" not in host else host


@dataclass(frozen=True)
class LinkPair:
    """Two machines whose link `sailor profile network --hosts` measures (ssh destinations; one
    machine twice for a link inside a node), and the (zone, GPU type) ends the link stands for."""

    src: tuple[str, str]
    dst: tuple[str, str]
    same_node: bool
    hosts: tuple[str, str]

    @property
    def rendezvous(self) -> str:
        """The first machine's address, where the two processes meet."""
        return bare_host(self.hosts[0])


def link_pairs(hosts: HostsFile, node_size: Mapping[str, int]) -> list[LinkPair]:
    """The links the network model looks up between the machines of `hosts`, one pair of machines
    each: inside the first machine of every group whose nodes hold 2 or more GPUs (`node_size` per GPU
    type), between the first two machines of every group that has two, and between the first machines
    of every two groups (the model's links are the same both ways, `perf.network`)."""
    out = []
    for k, g in enumerate(hosts.groups):
        end, first = (g.zone, g.gpu), destination(hosts, g, 0)
        if node_size.get(g.gpu, 1) >= 2:
            out.append(LinkPair(end, end, True, (first, first)))
        if len(g.hosts) >= 2:
            out.append(LinkPair(end, end, False, (first, destination(hosts, g, 1))))
        out += [LinkPair(end, (h.zone, h.gpu), False, (first, destination(hosts, h, 0))) for h in hosts.groups[k + 1:]]
    return out


def bare_host(destination: str) -> str:
    """The host part of an ssh destination ("user@host" -> "host")."""
    return destination.rsplit("@", 1)[-1]


def check_rendezvous(layout: LaunchLayout, hosts: HostsFile, *, source: str = "HOSTS.yaml",
                     allow_public: bool = False) -> None:
    """Raise SailorInputError naming the host's field when the rendezvous node (`layout.rdzv_node`)
    is a public IP address and `allow_public` is False (module docstring)."""
    node = layout.rdzv_node
    host = bare_host(assign_hosts(layout, hosts, source)[node.name])
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return  # a name: not resolved here
    if allow_public or not address.is_global:
        return
    k = next(k for k, g in enumerate(hosts.groups) if (g.zone, g.gpu) == (node.zone, node.gpu))
    raise SailorInputError(f"{host} is a public address, and the rendezvous store on it takes connections without"
                           " authentication", source=source, field=f"groups.{k}.hosts.{node.index}",
                           fix="list the nodes by their private (VPC) addresses, or pass --allow-public-rendezvous"
                               " if a firewall guards the port")
