"""Names, addresses and the `ip`/`tc` commands of a testbed, as data (nothing here runs a command).

Topology: one router namespace `<prefix>-rt` and one namespace per node `<prefix>-<node>`. Each node
has one veth pair, its NIC: `<prefix>n<node>` inside the node (its address `10.B.(i+1).2/24`, default
route via the router) and `<prefix>r<node>` in the router (`10.B.(i+1).1/24`), which forwards between
the nodes. Every name starts with the prefix (`sbx` and 4 hex digits, random per `up`), so a sweep
finds what a killed run left (`PREFIX_PATTERN`).

Shaping (htb, rates of Ethernet frames as the qdisc counts them, Mbit = 1e6 bit):
- leaving node A, on `<prefix>n<A>`: class 1:1 at A's NIC rate (every flow leaving A shares it);
  below it one class per link class (1:10 same zone, 1:20 cross zone, 1:30 cross region) with ceil
  min(link class, NIC), and 1:99 for whatever matches no peer (ARP, the router); a u32 filter sends
  packets for each other node to the class of the link between them. Each child's guaranteed rate
  is its ceil split evenly against the NIC (Σ rates <= NIC: htb lets a class under its own rate
  send without asking its parent, so larger rates would overrun the NIC);
- arriving at node B, on `<prefix>r<B>` in the router: one class at B's NIC rate (everything B
  receives shares it).
So one flow from A to B reaches min(NIC_A, link class, NIC_B); flows leaving one node share its
NIC, and flows of one link class leaving it share that class's rate.

Segmentation offload is turned off on every veth (`gso_max_segs 1`): each TCP segment is one
frame of at most 1514 bytes on the wire, so the byte counters and the qdiscs see real frames, and
the overhead per byte of payload is known (`spec.MSS_BYTES`, `spec.FRAME_BYTES`).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from sailor.testbed.spec import TestbedLink, TestbedSpec

PREFIX_PATTERN = re.compile(r"sbx[0-9a-f]{4}")
# Candidate second octets of the testbed's 10.B.0.0/16 (RFC 1918); one is taken only when no route
# or address of this machine, and no other live testbed, overlaps it (`pick_block`).
BLOCKS = tuple(range(200, 250))
CGROUP_CPU = "/sys/fs/cgroup/cpu"
CLASS_ID = {TestbedLink.SAME_ZONE: 10, TestbedLink.CROSS_ZONE: 20, TestbedLink.CROSS_REGION: 30}
OTHER_CLASS = 99
BURST_S = 1e-3


@dataclass(frozen=True)
class Names:
    """Every name one testbed uses, from its prefix."""

    prefix: str

    def __post_init__(self) -> None:
        assert PREFIX_PATTERN.fullmatch(self.prefix), self.prefix

    @property
    def router(self) -> str:
        return f"{self.prefix}-rt"

    def netns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def node_veth(self, node: str) -> str:
        """The node's end of its NIC (inside the node's namespace)."""
        return f"{self.prefix}n{node}"

    def router_veth(self, node: str) -> str:
        """The router's end of the node's NIC (inside the router's namespace)."""
        return f"{self.prefix}r{node}"

    @property
    def cgroup(self) -> str:
        return f"{CGROUP_CPU}/{self.prefix}"

    def node_cgroup(self, node: str) -> str:
        return f"{self.cgroup}/{node}"


def pick_block(used: Iterable[str], taken: Iterable[int] = ()) -> int:
    """The first B of BLOCKS whose 10.B.0.0/16 overlaps none of `used` (networks or addresses in
    CIDR form, e.g. the routes and addresses of this machine's namespace) and is not in `taken`
    (the blocks of other live testbeds).

    Raises:
        RuntimeError: every candidate overlaps.
    """
    nets = []
    for u in used:
        try:
            nets.append(ipaddress.ip_network(u, strict=False))
        except ValueError:  # not an address (a route type ip prints in place of one): overlaps nothing
            continue
    nets = [n for n in nets if n.version == 4]
    busy = set(taken)
    for b in BLOCKS:
        block = ipaddress.ip_network(f"10.{b}.0.0/16")
        if b not in busy and not any(block.overlaps(n) for n in nets):
            return b
    raise RuntimeError(f"no free 10.B.0.0/16 for B in {BLOCKS[0]}..{BLOCKS[-1]}")


def node_addresses(block: int, count: int) -> list[tuple[str, str]]:
    """(router side, node side) address of each of `count` nodes, in node order: node i has
    10.B.(i+1).1 on the router and 10.B.(i+1).2 inside, each a /24."""
    assert 0 < count < 255 and block in BLOCKS
    return [(f"10.{block}.{i + 1}.1", f"10.{block}.{i + 1}.2") for i in range(count)]


def _rate(mbit_per_s: float) -> str:
    return f"{round(mbit_per_s * 1e6)}bit"


def _htb_class(ns: str, dev: str, parent: str, classid: str, rate_mbit: float, ceil_mbit: float) -> list[str]:
    # quantum: one full frame per round, so htb's deficit round robin shares a parent fairly
    # burst: what a class may send at once, 1 ms at its rate (two frames at least): htb's timer is
    # not exact, and a bucket smaller than one tick's worth of bytes would hold the rate below the setting
    return ["ip", "netns", "exec", ns, "tc", "class", "add", "dev", dev, "parent", parent, "classid", classid,
            "htb", "rate", _rate(rate_mbit), "ceil", _rate(ceil_mbit), "burst", _burst(rate_mbit),
            "cburst", _burst(ceil_mbit), "quantum", "1514"]


def _burst(mbit_per_s: float) -> str:
    return f"{max(2 * 1514, round(mbit_per_s * 1e6 / 8 * BURST_S))}b"


def egress_commands(spec: TestbedSpec, names: Names, node: str, peers: dict[str, str]) -> list[list[str]]:
    """tc commands shaping what leaves `node` (module docstring); `peers`: other node -> its address."""
    me = spec.node(node)
    ns, dev, nic = names.netns(node), names.node_veth(node), me.nic_mbit_per_s
    classes = [TestbedLink.SAME_ZONE, TestbedLink.CROSS_ZONE, TestbedLink.CROSS_REGION]
    share = nic / (len(classes) + 1)  # guaranteed rates add up to the NIC
    cmds = [["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
             "default", str(OTHER_CLASS)],
            _htb_class(ns, dev, "1:", "1:1", nic, nic)]
    for link in classes:
        ceil = min(spec.links.mbit_per_s(link), nic)
        cmds.append(_htb_class(ns, dev, "1:1", f"1:{CLASS_ID[link]}", min(share, ceil), ceil))
    cmds.append(_htb_class(ns, dev, "1:1", f"1:{OTHER_CLASS}", share, nic))
    for peer, address in peers.items():
        link = spec.link_between(me, spec.node(peer))
        cmds.append(["ip", "netns", "exec", ns, "tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                     "prio", "1", "u32", "match", "ip", "dst", f"{address}/32", "flowid", f"1:{CLASS_ID[link]}"])
    return cmds


def ingress_commands(spec: TestbedSpec, names: Names, node: str) -> list[list[str]]:
    """tc commands shaping what arrives at `node`: its NIC rate, on the router's end of its veth."""
    ns, dev, nic = names.router, names.router_veth(node), spec.node(node).nic_mbit_per_s
    return [["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
             "default", "1"],
            _htb_class(ns, dev, "1:", "1:1", nic, nic)]


def loopback_commands(spec: TestbedSpec, names: Names, node: str) -> list[list[str]]:
    """Commands shaping `node`'s loopback, the link between its own ranks, to
    `links.same_node_mbit_per_s` (none when the spec leaves it unset): one htb class whose bucket
    holds two of the loopback's 64 KiB packets. Both directions of a pair of ranks pass this one
    queue; its packets carry 0.1 % of headers (66 bytes in 65,536)."""
    rate = spec.links.same_node_mbit_per_s
    if rate is None:
        return []
    ns, burst = names.netns(node), f"{max(2 * 65536, round(rate * 1e6 / 8 * BURST_S))}b"
    return [["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1"],
            ["ip", "netns", "exec", ns, "tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb",
             "rate", _rate(rate), "ceil", _rate(rate), "burst", burst, "cburst", burst, "quantum", "65536"]]


def node_link_commands(names: Names, node: str, router_addr: str, node_addr: str) -> list[list[str]]:
    """ip commands creating `node`'s namespace and NIC (the router namespace exists already)."""
    ns, nd, rd = names.netns(node), names.node_veth(node), names.router_veth(node)
    return [["ip", "netns", "add", ns],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "link", "add", nd, "netns", ns, "gso_max_segs", "1", "type", "veth", "peer", "name", rd,
             "netns", names.router, "gso_max_segs", "1"],
            ["ip", "-n", ns, "addr", "add", f"{node_addr}/24", "dev", nd],
            ["ip", "-n", names.router, "addr", "add", f"{router_addr}/24", "dev", rd],
            ["ip", "-n", ns, "link", "set", nd, "up"],
            ["ip", "-n", names.router, "link", "set", rd, "up"],
            ["ip", "-n", ns, "route", "add", "default", "via", router_addr]]


def router_commands(names: Names) -> list[list[str]]:
    """ip commands creating the router namespace, forwarding between its veths."""
    return [["ip", "netns", "add", names.router],
            ["ip", "-n", names.router, "link", "set", "lo", "up"],
            ["ip", "netns", "exec", names.router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]]


def cpu_quota_us(quota_cores: float, period_us: int) -> int:
    """cpu.cfs_quota_us for `quota_cores` cores in a CFS period of `period_us` (the spec keeps it >= 1 ms)."""
    return round(quota_cores * period_us)
