"""The testbed file: an emulated cluster of network namespaces on this machine (`sailor testbed up`).

```yaml
name: box                      # 1-12 of a-z 0-9 -; names the state files of this testbed
cfs_period_us: 10000           # optional; CFS period of every quota (µs); default per quota, below
comm_cpu_quota: 0.4            # optional; cores all ranks' communication threads share; default: no limit
devices:                       # device classes: the catalog GPU type each stands for, and its speed
  fast: {gpu: A100-40, cpu_quota: 0.45}     # cores per rank (0.45 = 45 % of one core)
  slow: {gpu: V100-16, cpu_quota: 0.15}
links:                         # wire rates per link class, Mbit/s (1 Mbit = 1e6 bit, as tc counts)
  same_zone_mbit_per_s: 400
  cross_zone_mbit_per_s: 200
  cross_region_mbit_per_s: 50
  same_node_mbit_per_s: 1000   # optional: a node's loopback (between its own ranks); default unshaped
nodes:                         # every node: a namespace, one NIC, `ranks` ranks of its device class
  - {name: a0, zone: us-central1-a, region: us-central1, device: fast, ranks: 1, nic_mbit_per_s: 300}
  - {name: b0, zone: us-west1-b, region: us-west1, device: slow, ranks: 2, nic_mbit_per_s: 300}
```

Zones and regions are the `gcp` provider's (`sailor/catalog/gcp.yaml`), so the cluster spec the
testbed writes (`cluster_spec`) plans and prices them as usual: two nodes in one zone are `same_zone`,
in two zones of one region `same_region` (the testbed's cross-zone class), in two regions
`same_continent` or `intercontinental` (its cross-region class). A device class becomes its GPU
type in that spec, so two classes may not name one type, and every node of a class holds the same
number of ranks (the spec's `gpus_per_node` is per type).
"""

from __future__ import annotations

import math
import re
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from sailor import catalog
from sailor.catalog import LinkClass
from sailor.core.errors import SailorInputError, show
from sailor.core.fileio import load_mapping
from sailor.core.schema import SPEC_CONFIG, Real, Whole, parse_model
from sailor.specs.cluster import not_offered

MAX_NODES = 64  # one /24 per node in the testbed's /16 (sailor.testbed.net.node_addresses)
MAX_MBIT_PER_S = 100_000.0  # 100 Gbit/s: far beyond what a veth pair shaped by htb carries here
NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,11}")
MIN_QUOTA_US = 1000  # the kernel refuses a smaller cpu.cfs_quota_us (kernel/sched/core.c, min_cfs_quota_period)
MAX_PERIOD_US = 1_000_000  # the longest cpu.cfs_period_us the kernel takes (kernel/sched/core.c, max_cfs_quota_period)
DEVICE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")  # a device class: named in messages and plans' notes
NODE_NAME = re.compile(r"[a-z0-9]{1,6}")  # short: it is part of interface names (15 characters at most)


class TestbedLink(str, Enum):
    """Where two nodes of the testbed sit relative to each other."""

    __test__ = False  # not a pytest test class, despite its name
    SAME_ZONE = "same_zone"
    CROSS_ZONE = "cross_zone"
    CROSS_REGION = "cross_region"


class DeviceClass(BaseModel):
    """A device speed: the catalog GPU type it stands for in the cluster spec, and the CPU quota of
    each of its ranks (cores; 0.45 = 45 % of one core in every CFS period)."""

    model_config = SPEC_CONFIG
    gpu: str
    cpu_quota: Real(0.01, 64.0)

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: str) -> str:
        gpu = catalog.canonical_gpu(v)
        if gpu == "cpu":  # the testbed's cluster spec is a gcp one, which prices (and plans) GPU types only
            raise ValueError("GPU type cpu has no gcp price, so the testbed's cluster spec could not be planned;"
                             " name the catalog GPU type the class stands for, e.g. A100-40")
        return gpu


class Links(BaseModel):
    """Wire rate of each link class in Mbit/s (Ethernet frames as the qdisc counts them)."""

    model_config = SPEC_CONFIG
    same_zone_mbit_per_s: Real(0.1, MAX_MBIT_PER_S)
    cross_zone_mbit_per_s: Real(0.1, MAX_MBIT_PER_S)
    cross_region_mbit_per_s: Real(0.1, MAX_MBIT_PER_S)
    # inside a node (its loopback, the testbed's NVLink); None: unshaped, the catalog's intra-node link
    same_node_mbit_per_s: Real(0.1, MAX_MBIT_PER_S) | None = None

    def mbit_per_s(self, link: TestbedLink) -> float:
        return float(getattr(self, f"{link.value}_mbit_per_s"))


class TestbedNode(BaseModel):
    """One emulated machine: a network namespace with one NIC, running `ranks` ranks of `device`."""

    __test__ = False
    model_config = SPEC_CONFIG
    name: str
    zone: str
    region: str
    device: str
    ranks: Whole(1, 64)
    nic_mbit_per_s: Real(0.1, MAX_MBIT_PER_S)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NODE_NAME.fullmatch(v):
            raise ValueError(f"{show(v)} is not 1-6 of a-z 0-9 (it becomes part of interface names)")
        return v


class TestbedSpec(BaseModel):
    """A testbed file (module docstring)."""

    __test__ = False
    model_config = SPEC_CONFIG
    name: str
    cfs_period_us: Whole(1000, 1_000_000) | None = None
    """CFS period (µs) of every quota; each quota must be >= the kernel's 1 ms. None (the default):
    each quota's shortest period (`period_us`): a rank of 0.3 cores runs 1 ms of every 3.3 ms. The
    quota caps a rank's threads but its compute thread, which runs under a deadline reservation of
    the same share in periods of 500 µs (`testbed.deadline`: a quota's unspent budget let a rank
    that waited compute at a full core)."""
    comm_cpu_quota: Real(0.01, 64.0) | None = None
    """Cores that the communication threads of all ranks share (gloo's socket loop and work threads,
    the rendezvous store, the runtime's thread posting pipeline transfers); None (the default): no limit. A device class's quota throttles a rank's
    compute only, as a GPU's NIC and copy engines move data beside its busy SMs (`cgroups.place_ranks`).
    A limit is one CFS period for all of them; measured on `examples/testbed.yaml`, 0.3 cores starved
    a TP 2 plan's per-layer all-reduces (`benchmarks/testbed.py`'s tp2_node: 1.59 s per step, against
    0.37 s with no limit)."""
    devices: dict[str, DeviceClass] = Field(min_length=1)
    links: Links
    nodes: tuple[TestbedNode, ...] = Field(min_length=1, max_length=MAX_NODES)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.fullmatch(v):
            raise ValueError(f"{show(v)} is not 1-12 of a-z 0-9 - (starting with a letter or digit)")
        return v

    @model_validator(mode="after")
    def _check(self) -> TestbedSpec:
        gcp = catalog.provider("gcp")
        seen: set[str] = set()
        ranks_of: dict[str, tuple[int, int]] = {}
        for i, n in enumerate(self.nodes):
            where = f"nodes.{i}"
            if n.name in seen:
                raise SailorInputError(f"node {n.name!r} is listed twice", field=f"{where}.name")
            seen.add(n.name)
            if n.device not in self.devices:
                raise SailorInputError(f"unknown device class {show(n.device)}", field=f"{where}.device",
                                       fix=f"known: {', '.join(sorted(self.devices))}")
            try:
                region = gcp.region(n.zone)
            except SailorInputError as e:
                raise e.located(field_prefix=f"{where}.zone") from None
            if region != n.region:
                raise SailorInputError(f"zone {n.zone} is in region {region}, not {n.region!r}", field=f"{where}.region")
            if gcp.offers(n.zone, self.devices[n.device].gpu) is False:  # its cluster spec would be refused
                raise not_offered(gcp, n.zone, self.devices[n.device].gpu, None).located(field_prefix=f"{where}.zone")
            if n.device in ranks_of and ranks_of[n.device][0] != n.ranks:
                raise SailorInputError(f"{n.ranks} ranks, but node {ranks_of[n.device][1]} of device class"
                                       f" {n.device!r} has {ranks_of[n.device][0]}", field=f"{where}.ranks",
                                       fix="every node of a device class holds the same number of ranks")
            ranks_of.setdefault(n.device, (n.ranks, i))
        gpus: dict[str, str] = {}
        for name, d in self.devices.items():
            if not DEVICE_NAME.fullmatch(name):
                raise SailorInputError(f"device class name {show(name)} is not 1-32 of A-Z a-z 0-9 _ . -",
                                       field="devices")
            if self.cfs_period_us is not None and d.cpu_quota * self.cfs_period_us < MIN_QUOTA_US:
                raise SailorInputError(f"a quota of {d.cpu_quota:g} core(s) is {d.cpu_quota * self.cfs_period_us:g} µs"
                                       f" per CFS period of {self.cfs_period_us} µs, below the kernel's"
                                       f" {MIN_QUOTA_US} µs", field=f"devices.{name}.cpu_quota",
                                       fix=f"cfs_period_us >= {math.ceil(MIN_QUOTA_US / d.cpu_quota)}")
            if d.gpu in gpus:
                raise SailorInputError(f"device classes {gpus[d.gpu]!r} and {name!r} both stand for {d.gpu}",
                                       field=f"devices.{name}.gpu", fix="one GPU type per device class")
            gpus[d.gpu] = name
        if (self.comm_cpu_quota is not None and self.cfs_period_us is not None
                and self.comm_cpu_quota * self.cfs_period_us < MIN_QUOTA_US):
            raise SailorInputError(f"a quota of {self.comm_cpu_quota:g} core(s) is below the kernel's {MIN_QUOTA_US} µs"
                                   f" per CFS period of {self.cfs_period_us} µs", field="comm_cpu_quota",
                                   fix=f"comm_cpu_quota >= {MIN_QUOTA_US / self.cfs_period_us:g}")
        return self

    # ---- derived -------------------------------------------------------------------------------
    def period_us(self, cores: float) -> int:
        """The CFS period (µs) of a quota of `cores`: `cfs_period_us` where given, else the shortest
        whose quota is the kernel's minimum of 1 ms (1000 / cores µs, at least 1 ms, at most 1 s)."""
        if self.cfs_period_us is not None:
            return self.cfs_period_us
        return min(MAX_PERIOD_US, max(MIN_QUOTA_US, math.ceil(MIN_QUOTA_US / cores)))

    def node(self, name: str) -> TestbedNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise SailorInputError(f"no node {show(name)}", field="nodes", fix=f"nodes: {', '.join(n.name for n in self.nodes)}")

    def link_between(self, a: TestbedNode, b: TestbedNode) -> TestbedLink:
        """The link class between two different nodes."""
        if a.zone == b.zone:
            return TestbedLink.SAME_ZONE
        if a.region == b.region:
            return TestbedLink.CROSS_ZONE
        return TestbedLink.CROSS_REGION

    def total_cpu_cores(self) -> float:
        """Cores the testbed's quotas allow together: Σ ranks × quota of their class, plus the
        communication threads' shared quota where it has one."""
        return sum(n.ranks * self.devices[n.device].cpu_quota for n in self.nodes) + (self.comm_cpu_quota or 0.0)


def load_testbed(path: str | Path) -> TestbedSpec:
    """Read a testbed file; raises SailorInputError naming the file and field."""
    return parse_model(TestbedSpec, load_mapping(path), str(path))


def parse_testbed(data: dict[str, Any], source: str | None = None) -> TestbedSpec:
    """A testbed spec from a dict in the file's format; raises SailorInputError naming the field."""
    return parse_model(TestbedSpec, data, source)


# ---- what the planner sees -------------------------------------------------------------------------
# A full-sized TCP segment on a 1500-byte MTU with timestamps (Linux's default): 1448 bytes of payload
# in a 1514-byte frame as the qdisc and the veth counters see it (14 Ethernet + 20 IPv4 + 32 TCP with
# the timestamp option; RFC 791, RFC 793, RFC 7323 §3; preamble and FCS never reach a veth).
MSS_BYTES = 1448
FRAME_BYTES = 1514
HEADER_BYTES = FRAME_BYTES - MSS_BYTES  # 66 bytes of headers per frame, data or ACK
# A receiver acknowledges at least every second full-sized segment (delayed ACKs: RFC 1122 §4.2.3.2,
# RFC 5681 §4.2); Linux does so in bulk transfers (it may stretch ACKs further: then fewer).
SEGMENTS_PER_ACK = 2
# No delay is added to a link (netem is not in this kernel): a veth hop and the router namespace's
# forwarding cost tens of µs. A placeholder of that order, until `sailor profile network` measures it.
LINK_LATENCY_S = 1e-4


def payload_bytes_per_s(mbit_per_s: float) -> float:
    """TCP payload bytes/s of a wire rate in Mbit/s (full-sized segments, MSS_BYTES per FRAME_BYTES)."""
    return mbit_per_s * 1e6 / 8 * MSS_BYTES / FRAME_BYTES


LOOPBACK_PACKET_BYTES = 65536  # a loopback packet, HEADER_BYTES of it headers


def loopback_payload_bytes_per_s(mbit_per_s: float) -> float:
    """TCP payload bytes/s of a shaped loopback (`net.loopback_commands`) at `mbit_per_s`: 64 KiB
    packets, HEADER_BYTES of headers each."""
    return mbit_per_s * 1e6 / 8 * (LOOPBACK_PACKET_BYTES - HEADER_BYTES) / LOOPBACK_PACKET_BYTES


def wire_bytes(payload_bytes: float) -> float:
    """Bytes of Ethernet frames, as a veth's tx_bytes + rx_bytes count them (no preamble or FCS), that
    carry `payload_bytes` of TCP payload over one link, both directions together: every MSS_BYTES
    of payload travel in one FRAME_BYTES frame, and one ACK of HEADER_BYTES goes back per
    SEGMENTS_PER_ACK segments. So 1 MB of payload is 1.0456 MB of data frames and 0.0228 MB of ACKs.
    Full-sized segments are assumed: a message's last, partial segment adds one header (66 bytes)
    per message, which the bulk transfers of gradients and activations make negligible."""
    segments = payload_bytes / MSS_BYTES
    return segments * FRAME_BYTES + segments / SEGMENTS_PER_ACK * HEADER_BYTES


def class_rates_mbit_per_s(spec: TestbedSpec) -> dict[LinkClass, float]:
    """Rate (Mbit/s) one node reaches over each planner link class between nodes: the link class's
    rate capped by the slowest NIC that may sit at either end of it."""
    nic = min(n.nic_mbit_per_s for n in spec.nodes)
    out = {LinkClass.SAME_ZONE: min(spec.links.same_zone_mbit_per_s, nic),
           LinkClass.SAME_REGION: min(spec.links.cross_zone_mbit_per_s, nic)}
    for lc in (LinkClass.SAME_CONTINENT, LinkClass.INTERCONTINENTAL):
        out[lc] = min(spec.links.cross_region_mbit_per_s, nic)
    return out


def cluster_spec(spec: TestbedSpec) -> dict[str, Any]:
    """The cluster spec (a dict in the file's format, `sailor.specs.load_cluster` reads it) that
    offers the testbed to the planner: provider gcp, each device class as its GPU type in its nodes'
    zones, `gpus_per_node` = ranks per node, and per link class a link whose NIC bandwidth and flow
    bandwidth are the payload rate of `class_rates_mbit_per_s` (a same_zone link per zone, capped by
    that zone's slowest NIC). Inside a node ranks talk over the namespace's loopback: shaped like a
    NIC to `links.same_node_mbit_per_s` (`net.loopback_commands`), that rate's payload
    (`loopback_payload_bytes_per_s`: 124.9 MB/s at 1000 Mbit/s, 124.0 measured) as the same_node link;
    without it unshaped, and the catalog's intra-node link applies. All-reduces are pinned to the
    flat ring: the testbed's ranks run gloo, whose all-reduce is a ring over the whole group
    (gloo/allreduce.h, `AllreduceOptions` algorithm UNSPECIFIED unless set, run as RING; torch's
    ProcessGroupGloo does not set it), never the hierarchical one the simulator's `auto` may pick
    for NCCL."""
    zones: dict[str, dict[str, int]] = {}
    per_node: dict[str, int] = {}
    for n in spec.nodes:
        gpu = spec.devices[n.device].gpu
        zones.setdefault(n.zone, {}).setdefault(gpu, 0)
        zones[n.zone][gpu] += n.ranks
        per_node[gpu] = n.ranks

    def link(mbit: float, payload=payload_bytes_per_s) -> dict[str, float]:
        rate = payload(mbit)
        return {"latency_s": LINK_LATENCY_S, "bandwidth_bytes_per_s": rate, "flow_bandwidth_bytes_per_s": rate}

    network = {lc.value: link(mbit) for lc, mbit in class_rates_mbit_per_s(spec).items()}
    if spec.links.same_node_mbit_per_s is not None:  # the shaped loopback (`net.loopback_commands`)
        network[LinkClass.SAME_NODE.value] = link(spec.links.same_node_mbit_per_s, loopback_payload_bytes_per_s)
    zone_network = {}
    for zone in zones:
        nic = min(n.nic_mbit_per_s for n in spec.nodes if n.zone == zone)
        zone_network[zone] = {"same_zone": link(min(spec.links.same_zone_mbit_per_s, nic))}
    return {"provider": "gcp", "zones": zones, "gpus_per_node": per_node, "network": network,
            "zone_network": zone_network, "allreduce": "ring"}


def hosts_spec(spec: TestbedSpec, addresses: dict[str, str]) -> dict[str, Any]:
    """HOSTS.yaml (`sailor.launch.hosts`) for the testbed: one group per (zone, GPU type), its nodes'
    addresses (`addresses`: node name -> address) in file order, GPUs per node = ranks."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for n in spec.nodes:
        gpu = spec.devices[n.device].gpu
        g = groups.setdefault((n.zone, gpu), {"zone": n.zone, "gpu": gpu, "gpus_per_node": n.ranks, "hosts": []})
        g["hosts"].append(addresses[n.name])
    return {"groups": list(groups.values())}
