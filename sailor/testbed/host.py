"""Bringing a testbed up and down on this machine: namespaces, veths, qdiscs, cgroups (needs root).

`up` writes the state file (`<state dir>/<name>/state.json`) *before* it creates anything, and
every object it creates carries the state's prefix, so whatever stops it (an error, Ctrl-C, SIGTERM,
a crash or SIGKILL of the tool) leaves something `down` can find: `up` itself undoes its own work on
an error, Ctrl-C or SIGTERM; a later `up` of the same name, `down NAME` or `down --all` removes what a
killed run left. `down` ends every process inside the testbed's namespaces and cgroups (SIGKILL),
deletes the namespaces (which takes their veths and qdiscs with them), removes the cgroups and the
state, then checks that nothing with the prefix is left (`leftovers`).

The state folder also holds what the planner and the launcher need: `cluster.yaml` (the testbed as a
cluster spec, `spec.cluster_spec`), `hosts.yaml` (`spec.hosts_spec`, the nodes' addresses) and
`bin/ssh`, a stand-in ssh (`sailor.testbed.ssh`) to put first on PATH.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from sailor.core.errors import SailorInputError
from sailor.core.fileio import write_atomic
from sailor.testbed import deadline, net
from sailor.testbed.cgroups import create_cgroups, write_cgroup
from sailor.testbed.spec import TestbedSpec, cluster_spec, hosts_spec
from sailor.testbed.state import NodeState, TestbedState, forget_owner, owned, record_owner

STATE_DIR_ENV = "SAILOR_TESTBED_STATE"
DEFAULT_STATE_DIR = "/run/sailor-testbed"
KILL_WAIT_S = 5.0  # how long `down` waits for killed processes to be gone


class TestbedUnsupported(SailorInputError):
    """This machine cannot host a testbed (not root, no `ip`/`tc`, no network namespaces or no
    cgroup v1 cpu controller); the CLI prints it as one line with exit status 2."""

    __test__ = False


def state_root(state_dir: str | Path | None = None) -> Path:
    """The folder of all testbeds' state: `state_dir`, else $SAILOR_TESTBED_STATE, else /run/sailor-testbed.

    Raises:
        SailorInputError: the path is empty, or there but not a folder (naming --state-dir or the
            variable).
    """
    where = "--state-dir" if state_dir is not None else STATE_DIR_ENV if os.environ.get(STATE_DIR_ENV) else None
    if state_dir is not None and not str(state_dir):
        raise SailorInputError("an empty path", source=where, fix="name a folder; a missing one is made")
    root = Path(state_dir or os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)
    if root.exists() and not root.is_dir():
        raise SailorInputError(f"{root} is not a folder", source=where, fix="name a folder; a missing one is made")
    return root


def live_states(state_dir: str | Path | None = None) -> list[TestbedState]:
    """Every testbed whose state file is in the state folder (up, or left by a killed run)."""
    root = state_root(state_dir)
    return [TestbedState.read(p) for p in sorted(root.glob("*/state.json"))] if root.is_dir() else []


# ---- checks -------------------------------------------------------------------------------------
def support_problem() -> str | None:
    """Why this machine cannot host a testbed, in one line; None when it can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "the testbed needs Linux (network namespaces, tc, cgroups)"
    if os.geteuid() != 0:
        return "the testbed needs root (it creates network namespaces, veths, qdiscs and cgroups)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the testbed needs `{tool}` (iproute2) on PATH"
    if not Path("/proc/self/ns/net").exists():
        return "the testbed needs network namespaces (no /proc/self/ns/net)"
    if not Path(net.CGROUP_CPU, "cpu.cfs_quota_us").exists():
        return f"the testbed needs the cgroup v1 cpu controller at {net.CGROUP_CPU} (cpu.cfs_quota_us)"
    return None


def check_support() -> None:
    """Raise TestbedUnsupported (one line) when `support_problem` finds one."""
    problem = support_problem()
    if problem:
        raise TestbedUnsupported(problem, source="sailor testbed")


# ---- commands ------------------------------------------------------------------------------------
def run(argv: list[str]) -> str:
    """Run one ip/tc command; its stdout. Raises RuntimeError with the command and its stderr."""
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {p.stderr.strip() or f'exit status {p.returncode}'}")
    return p.stdout


def _root_networks() -> list[str]:
    """Routes (every table) and addresses of this (the root) namespace, in CIDR form."""
    out = []
    for r in json.loads(run(["ip", "-4", "-j", "route", "show", "table", "all"]) or "[]"):
        dst = r.get("dst") or "default"
        if dst != "default":
            out.append(dst if "/" in dst else f"{dst}/32")
    for link in json.loads(run(["ip", "-4", "-j", "addr"]) or "[]"):
        out += [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])]
    return out


def _write_files(spec: TestbedSpec, state: TestbedState) -> None:
    write_atomic(state.cluster_file, yaml.safe_dump(cluster_spec(spec), sort_keys=False))
    write_atomic(state.hosts_file, yaml.safe_dump(hosts_spec(spec, {n.name: n.address for n in state.nodes}),
                                                  sort_keys=False))
    state.bin_dir.mkdir(exist_ok=True)
    here = Path(__file__).resolve().parents[2]  # the folder holding the sailor package
    ssh = state.bin_dir / "ssh"
    write_atomic(ssh, f"#!/bin/sh\n# stand-in ssh of testbed {spec.name}: enters the node's namespace and cgroup\n"
                      f"PYTHONPATH={here}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} -m sailor.testbed.ssh"
                      f" --state-dir {state_root(Path(state.folder).parent)} \"$@\"\n")
    ssh.chmod(0o755)


def _plan_state(spec: TestbedSpec, state_dir: Path) -> TestbedState:
    names = net.Names(f"sbx{secrets.token_hex(2)}")
    block = net.pick_block(_root_networks(), [s.block for s in live_states(state_dir)])
    addresses = net.node_addresses(block, len(spec.nodes))
    nodes = tuple(NodeState(name=n.name, netns=names.netns(n.name), veth=names.node_veth(n.name), address=inner,
                            router_address=outer, cgroup=names.node_cgroup(n.name))
                  for n, (outer, inner) in zip(spec.nodes, addresses))
    return TestbedState(name=spec.name, prefix=names.prefix, block=block, folder=str(state_dir / spec.name),
                        nodes=nodes)


def check_cores(spec: TestbedSpec, source: str | None = None) -> None:
    """Refuse a testbed whose CPU quotas (its ranks' and their communication threads',
    `TestbedSpec.total_cpu_cores`) add up to more cores than `os.cpu_count()`, or whose ranks'
    deadline reservations (each rank's quota under one core, `cgroups.reserve`, and one
    `deadline.GUARD_CORES` per node, `testbed.guard`) add up to more than the kernel admits (`deadline.bandwidth_limit`:
    0.95 of every core by default).

    Raises:
        SailorInputError: at field `devices` of `source` (the testbed file).
    """
    cores = os.cpu_count() or 1
    if spec.total_cpu_cores() > cores:
        raise SailorInputError(f"the quotas of ranks and communication add up to {spec.total_cpu_cores():g} cores,"
                               f" more than the {cores} of this machine", source=source, field="devices",
                               fix="smaller cpu_quota or comm_cpu_quota, or fewer ranks")
    reserved = sum(n.ranks * spec.devices[n.device].cpu_quota for n in spec.nodes
                   if spec.devices[n.device].cpu_quota < 1) + deadline.GUARD_CORES * len(spec.nodes)
    if reserved > deadline.bandwidth_limit(cores):
        raise SailorInputError(f"the ranks' quotas under one core and the nodes' guards add up to {reserved:g}"
                               f" cores, more than the"
                               f" {deadline.bandwidth_limit(cores):g} this kernel lets deadline tasks reserve"
                               f" (kernel.sched_rt_runtime_us)", source=source, field="devices",
                               fix="smaller cpu_quota, or fewer ranks or nodes")


def up(spec: TestbedSpec, state_dir: str | Path | None = None, *, source: str | None = None) -> TestbedState:
    """Create the testbed `spec` describes (module docstring); removes a previous one of the same name
    first. On any error, Ctrl-C or SIGTERM it removes what it made and re-raises. `source`: the
    testbed file, named in errors about the spec.

    Raises:
        TestbedUnsupported: this machine cannot host a testbed.
        SailorInputError: the quotas add up to more cores than this machine has (`check_cores`), or
            the state folder is empty or cannot be made.
        RuntimeError: an ip/tc command failed (everything made so far is removed).
    """
    check_support()
    check_cores(spec, source)  # before anything on the host is touched
    with contextlib.suppress(OSError):  # a bandwidth the kernel lost before (`deadline.rebuild_accounting`)
        deadline.rebuild_accounting()
    root = state_root(state_dir)
    for old in live_states(root):
        if old.name == spec.name:
            down(old)
    state = _plan_state(spec, root)
    try:
        Path(state.folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        where = "--state-dir" if state_dir is not None else STATE_DIR_ENV if os.environ.get(STATE_DIR_ENV) else None
        raise SailorInputError(f"{state.folder} cannot be made ({e.strerror})", source=where,
                               fix="name a folder this user can write") from None
    write_atomic(Path(state.folder) / "state.json", state.to_json())  # first: whatever happens next, down finds it
    record_owner(state)  # so that `down --all` of another state folder leaves this testbed alone
    previous = signal.getsignal(signal.SIGTERM) if _main_thread() else None
    try:
        if previous is not None:
            signal.signal(signal.SIGTERM, _interrupt)
        _create(spec, state)
        _write_files(spec, state)
    except BaseException:
        down(state)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return state


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _create(spec: TestbedSpec, state: TestbedState) -> None:
    names = state.names
    for argv in net.router_commands(names):
        run(argv)
    for n in state.nodes:
        for argv in net.node_link_commands(names, n.name, n.router_address, n.address):
            run(argv)
    for n in state.nodes:
        peers = {p.name: p.address for p in state.nodes if p.name != n.name}
        for argv in (net.egress_commands(spec, names, n.name, peers) + net.ingress_commands(spec, names, n.name)
                     + net.loopback_commands(spec, names, n.name)):
            run(argv)
    for n in state.nodes:
        _write_hosts(n)
    create_cgroups(spec, state)


NETNS_ETC = "/etc/netns"  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc (ip-netns(8))


def _write_hosts(node: NodeState) -> None:
    """/etc/hosts as the node sees it: this machine's hostname is the node's address, as on a real
    machine (gloo and torchrun find their own address from the hostname; else they would take
    127.0.0.1, which the other nodes cannot reach)."""
    folder = Path(NETNS_ETC, node.netns)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "hosts", f"127.0.0.1 localhost\n{node.address} {socket.gethostname()}\n")


# ---- down ----------------------------------------------------------------------------------------
def _cgroup_dirs(top: str) -> list[str]:
    """`top` and its descendants, deepest first (the order rmdir needs)."""
    if not os.path.isdir(top):
        return []
    found = [d for d, _, _ in os.walk(top)]
    return sorted(found, key=lambda d: d.count("/"), reverse=True)


def _netns_inode(name: str) -> int | None:
    with contextlib.suppress(OSError):
        return os.stat(f"/run/netns/{name}").st_ino
    return None


def processes(prefix: str) -> list[int]:
    """Processes inside a testbed's cgroups or network namespaces (never this process)."""
    inodes = {i for i in (_netns_inode(ns) for ns in _netns_names(prefix)) if i is not None}
    return _processes_in(inodes, f"/{prefix}")


def node_processes(node: NodeState) -> list[int]:
    """Processes inside `node`'s network namespace: its torchrun agent and ranks (never this process)."""
    inode = _netns_inode(node.netns)
    return _processes_in({inode} if inode is not None else set(), None)


def _processes_in(netns_inodes: set[int], cgroup: str | None) -> list[int]:
    """Processes in one of the network namespaces `netns_inodes` or (with `cgroup`) in that cpu
    cgroup or below it."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            in_cgroup = cgroup is not None and any(
                line.split(":", 2)[2].startswith(cgroup + "/") or line.split(":", 2)[2] == cgroup
                for line in Path(f"/proc/{entry}/cgroup").read_text().splitlines()
                if line.split(":", 2)[1] in ("cpu,cpuacct", "cpu", "cpuacct,cpu"))
            if in_cgroup or os.stat(f"/proc/{entry}/ns/net").st_ino in netns_inodes:
                found.append(int(entry))
    return found


def _netns_names(prefix: str | None) -> list[str]:
    """Named network namespaces of one testbed (`prefix`), or of every testbed (None)."""
    if not os.path.isdir("/run/netns"):
        return []
    names = os.listdir("/run/netns")
    if prefix is None:
        return sorted(n for n in names if net.PREFIX_PATTERN.match(n))
    return sorted(n for n in names if n.startswith(prefix + "-"))


def _kill(prefix: str) -> None:
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        pids = processes(prefix)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def remove(prefix: str) -> None:
    """End the processes of testbed `prefix`, delete its namespaces and cgroups (a missing one is fine)."""
    _kill(prefix)
    for ns in _netns_names(prefix):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    for link in _root_links(prefix):  # a veth still in this namespace (up stopped between two commands)
        subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
    for ns in _etc_names(prefix):
        shutil.rmtree(Path(NETNS_ETC, ns), ignore_errors=True)
    deadline = time.monotonic() + KILL_WAIT_S
    for d in _cgroup_dirs(f"{net.CGROUP_CPU}/{prefix}"):
        while True:  # a killed task leaves its cgroup a moment after it is gone from /proc (EBUSY until then)
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            break


def _etc_names(prefix: str | None) -> list[str]:
    """Folders of /etc/netns of one testbed (`prefix`), or of every testbed (None)."""
    names = os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else []
    return sorted(n for n in names if (n.startswith(prefix + "-") if prefix else net.PREFIX_PATTERN.match(n)))


def _root_links(prefix: str | None) -> list[str]:
    names = os.listdir("/sys/class/net") if os.path.isdir("/sys/class/net") else []
    pattern = net.PREFIX_PATTERN
    return sorted(n for n in names if (n.startswith(prefix) if prefix else pattern.match(n)))


def leftovers(prefix: str | None = None) -> list[str]:
    """What of testbed `prefix` (of every testbed: None) exists: namespaces, links in this namespace,
    cgroups and processes, each as a short description. Empty after a clean `down`."""
    found = [f"netns {n}" for n in _netns_names(prefix)]
    found += [f"link {n}" for n in _root_links(prefix)]
    found += [f"file {NETNS_ETC}/{n}" for n in _etc_names(prefix)]
    cgroups = [d for d in (os.listdir(net.CGROUP_CPU) if os.path.isdir(net.CGROUP_CPU) else [])
               if (d == prefix if prefix else net.PREFIX_PATTERN.fullmatch(d))]
    found += [f"cgroup {net.CGROUP_CPU}/{d}" for d in cgroups]
    for p in ([prefix] if prefix else [c for c in cgroups] + sorted({n.split("-")[0] for n in _netns_names(None)})):
        found += [f"process {pid}" for pid in processes(p)]
    return found


def down(state: TestbedState) -> None:
    """Remove testbed `state` and its state folder.

    Raises:
        RuntimeError: something with its prefix is still there afterwards (named).
    """
    remove(state.prefix)
    left = leftovers(state.prefix)
    if left:
        raise RuntimeError(f"testbed {state.name} ({state.prefix}) could not be removed whole: {', '.join(left)}")
    shutil.rmtree(state.folder, ignore_errors=True)
    forget_owner(state.prefix)


def down_all(state_dir: str | Path | None = None) -> list[str]:
    """Remove every testbed of the state folder `state_dir` (`state_root`), then anything else
    carrying a testbed prefix that no live testbed owns (`state.owned`: a run killed before it wrote
    its state, or a state folder that was deleted). Testbeds of other state folders stay up. Returns
    the prefixes removed.

    Raises:
        RuntimeError: something of a removed prefix is still there afterwards (named).
    """
    removed = []
    for s in live_states(state_dir):
        down(s)
        removed.append(s.prefix)
    stray = {n.split("-")[0] for n in _netns_names(None) + _etc_names(None)} | {n[:7] for n in _root_links(None)}
    stray |= {d for d in (os.listdir(net.CGROUP_CPU) if os.path.isdir(net.CGROUP_CPU) else [])
              if net.PREFIX_PATTERN.fullmatch(d)}
    for prefix in sorted(p for p in stray if not owned(p)):
        remove(prefix)
        forget_owner(prefix)
        removed.append(prefix)
    left = [x for prefix in removed for x in leftovers(prefix)]
    if left:
        raise RuntimeError(f"testbeds could not be removed whole: {', '.join(left)}")
    return removed


def find_state(name_or_file: str, state_dir: str | Path | None = None) -> TestbedState:
    """The live testbed named `name_or_file` (its name, or the testbed file that describes it);
    raises SailorInputError when none is (`testbed_name`, `live_states`)."""
    name = testbed_name(name_or_file)
    for s in live_states(state_dir):
        if s.name == name:
            return s
    raise SailorInputError(f"no testbed {name!r} is up", source=name_or_file,
                           fix=f"sailor testbed up FILE (state in {state_root(state_dir)})")


def testbed_name(name_or_file: str) -> str:
    """The testbed's name: `name_or_file` itself, or the name in the testbed file it is (a path, or a
    name ending in .yaml/.yml/.json; SailorInputError when that file is bad)."""
    if name_or_file.endswith((".yaml", ".yml", ".json")) or os.sep in name_or_file:
        from sailor.testbed.spec import load_testbed
        return load_testbed(name_or_file).name
    return name_or_file


# ---- entering a node -----------------------------------------------------------------------------
def locate(destination: str, state_dir: str | Path | None = None,
           source: str = "ssh") -> tuple[TestbedState, NodeState]:
    """The testbed node an ssh destination ("user@address", an address or a node name) names;
    raises SailorInputError (naming `source`) when none or several do."""
    host = destination.rsplit("@", 1)[-1]
    matches = [(s, n) for s in live_states(state_dir) for n in s.nodes if host in (n.address, n.name)]
    if len(matches) != 1:
        what = "no" if not matches else "more than one"
        raise SailorInputError(f"{what} testbed node has the address or name {host!r}", source=source)
    return matches[0]


def enter_argv(node: NodeState, argv: list[str]) -> list[str]:
    """Join this process to `node`'s cgroup and return the argv that runs `argv` in its namespace
    (exec it: what it starts stays in the cgroup and the namespace)."""
    write_cgroup(node.cgroup, "cgroup.procs", os.getpid())
    return ["ip", "netns", "exec", node.netns, *argv]


def counters(node: NodeState) -> dict[str, int]:
    """Byte and packet counters of `node`'s NIC (its end of the veth): tx = what left the node."""
    (link,) = json.loads(run(["ip", "-n", node.netns, "-s", "-j", "link", "show", "dev", node.veth]))
    s = link["stats64"]
    return {"tx_bytes": s["tx"]["bytes"], "tx_packets": s["tx"]["packets"], "rx_bytes": s["rx"]["bytes"],
            "rx_packets": s["rx"]["packets"]}


def as_dict(state: TestbedState) -> dict[str, Any]:
    """What `sailor testbed up --json` prints."""
    return {"name": state.name, "prefix": state.prefix, "cluster": str(state.cluster_file),
            "hosts": str(state.hosts_file), "ssh": str(state.bin_dir / "ssh"),
            "nodes": [{"name": n.name, "netns": n.netns, "address": n.address} for n in state.nodes]}
