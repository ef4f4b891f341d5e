"""`sailor profile network`: point-to-point and all-reduce sweeps between local processes, fitted
to α–β links and written as our link file ("sailor.network/1", see `sailor.perf.network_files`).

N processes (gloo on CPU, NCCL on CUDA) run, for message sizes 1 KiB .. 64 MiB (powers of 4):
- p2p: ranks 2k and 2k+1 ping-pong (send, then receive the same size back); one-way time = round
  trip / 2. With N >= 4 the N/2 pairs also run at once, which measures N/2 concurrent flows;
- all-reduce of the message over all N ranks.
Each point is the mean of `repeats` timed rounds after `warmup` untimed ones: a training step
pays the mean of its many transfers and collectives, and their times can be two-valued (a process
under a CPU quota, as on the testbed, starts at once or after the rest of its period's gap; the
median would keep one of the two). A link
time(x) = α + x / β is fitted by least squares on relative error (each row divided by its measured
time, so 1 KiB and 64 MiB count alike), α clipped at 0.

The file holds a `links` entry (zone, GPU type) -> itself per measured flow count, marked
`same_node` (the processes share this machine), and the one-flow α–β as the `same_zone` and
`same_node` classes, so `network_for(local_cluster(...), file)` uses it for every pair of local
processes. The all-reduce sweep and its fit are kept under `allreduce`
(with the bus bandwidth 2(N-1)/N · x / t), for comparison with the simulator's ring model.

What the all-reduce takes beyond the simulator's ring over the measured links is the backend's
cost of a collective, the file's `collective` (`fit_collective`: a start-up per call and a
processing rate per byte, `perf.network.CollectiveCost`), which the simulator charges; between
machines (`profile_pairs`, two processes per link) it is fitted on all the links' sweeps together.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from typing import Any

import numpy as np

from sailor.perf.network import SCHEMA, CollectiveCost, NetworkModel, backend_for
from sailor.perf.network_files import network_from_ours

SIZES_BYTES = tuple(1024 * 4**k for k in range(9))  # 1 KiB .. 64 MiB
HOST_SIZES_BYTES = SIZES_BYTES[:7]  # 1 KiB .. 4 MiB between machines: 4 MiB over 50 Mbit/s is 0.7 s


def _nonnegative_line(x, y, scale) -> tuple[float, float]:
    """(a, b) >= 0 of y = a + b·x minimising sum(((a + b·x - y) / scale)²) (least squares on error
    relative to `scale`): the unconstrained solution when both are >= 0, else the better of the
    fits with a = 0 or b = 0 (each clipped at 0)."""
    x, y, w = (np.asarray(v, dtype=float) for v in (x, y, scale))
    (a, b), *_ = np.linalg.lstsq(np.stack([1.0 / w, x / w], axis=1), y / w, rcond=None)
    if a >= 0 and b >= 0:
        return float(a), float(b)
    candidates = [(0.0, max(0.0, float(np.sum(x * y / w**2) / np.sum((x / w) ** 2)))),
                  (max(0.0, float(np.sum(y / w**2) / np.sum(1.0 / w**2))), 0.0)]
    return min(candidates, key=lambda ab: float(np.sum(((ab[0] + ab[1] * x - y) / w) ** 2)))


def fit_alpha_beta(sizes_bytes, times_s) -> tuple[float, float]:
    """Fit time = α + bytes / β to measured points; returns (α seconds, β bytes/s).

    Least squares on relative error; α is clipped at 0 (β refitted alone then). Raises ValueError
    when the points do not give a positive bandwidth.
    """
    alpha, inv_beta = _nonnegative_line(sizes_bytes, times_s, times_s)
    if inv_beta <= 0:
        raise ValueError("the sweep does not give a positive bandwidth (time does not grow with size)")
    return alpha, 1.0 / inv_beta


def simulated_ring_s(net: NetworkModel, members: list, sizes_bytes) -> np.ndarray:
    """Seconds the simulator's flat ring (`simulator.collectives.ring_allreduce_s`) gives an
    all-reduce of each size over `members` (`simulator.collectives.Member`s: zone, GPU type, node)
    on `net`'s links, without any collective cost `net` carries: the ring's steps and bytes alone."""
    from sailor.simulator.collectives import group_members, ring_allreduce_s

    bare = dataclasses.replace(net, collective=CollectiveCost())  # the same links (and their memo)
    groups = group_members(members)
    return np.array([ring_allreduce_s(groups, float(x), bare) for x in sizes_bytes])


def pair_members(link: dict[str, Any]) -> list:
    """The two members of a measured pair (a `links` entry of `profile_pairs`), on one node or two."""
    from sailor.simulator.collectives import Member

    return [Member(zone=link["src_zone"], gpu=link["src_gpu"], tp=1, node="src"),
            Member(zone=link["dst_zone"], gpu=link["dst_gpu"], tp=1, node="src" if link["same_node"] else "dst")]


def collective_of_pairs(net: NetworkModel, data: dict[str, Any]) -> dict[str, Any] | None:
    """`fit_collective` of the all-reduce sweeps of `profile_pairs`' file content `data` (its
    `sweep.pairs`, each measured between the ends of the `links` entry of the same index) against
    the ring the simulator runs over `net` for each pair: `net` with the file's links
    (`perf.network_files.network_from_ours`) gives the file's own entry; the cluster's spec links alone
    (`network_for(cluster)`) give the entry for a file that carries no links. None without pairs."""
    sizes, pairs = data["sweep"]["sizes_bytes"], data["sweep"]["pairs"]
    if not pairs:
        return None
    rings = [simulated_ring_s(net, pair_members(link), sizes) for link in data["links"]]
    return fit_collective(list(sizes) * len(pairs), [t for p in pairs for t in p["allreduce_s"]], np.concatenate(rings),
                          data["sweep"].get("backend"))


def fit_collective(flow_bytes, measured_s, ring_s, backend: str | None = None) -> dict[str, Any]:
    """The backend's cost of a collective beyond its ring (`perf.network.CollectiveCost`) from
    all-reduce sweeps: measured = α_c + ring + B / ρ, with B the bytes each member sends
    (2(N-1)/N · x), `ring_s` the simulator's ring over the links it will use with the file
    (`simulated_ring_s`); α_c and 1/ρ >= 0 fitted on the residual by least squares on error
    relative to the ring's time (not the measured one: a point whose rounds happened to be fast
    would weigh more, and under a CPU quota small points are two-valued). Points of several sweeps
    (links) may be pooled: α_c and ρ are the backend's, not a link's.

    Returns the file's `collective` entry: {"startup_s", "processing_bytes_per_s" (absent when the
    residual does not grow with the bytes), "backend" (the backend measured, `perf.network.backend_for`; absent
    when not given), "fit_relative_error" (mean |model - measured| / measured over the points)}."""
    b, t, ring = (np.asarray(v, dtype=float) for v in (flow_bytes, measured_s, ring_s))
    startup, inv_rate = _nonnegative_line(b, t - ring, ring)
    model = ring + startup + b * inv_rate
    out: dict[str, Any] = {"startup_s": startup}
    if inv_rate > 0:
        out["processing_bytes_per_s"] = 1.0 / inv_rate
    if backend is not None:
        out["backend"] = backend
    out["fit_relative_error"] = float(np.mean(np.abs(model - t) / t))
    return out


def describe_collective(collective: dict[str, Any] | None) -> str:
    """One line for people about a `fit_collective` entry."""
    if not collective:
        return "collective: no all-reduce measured"
    rate = collective.get("processing_bytes_per_s")
    return (f"collective: start-up {collective['startup_s'] * 1e3:.2f} ms per call, "
            + (f"processing {rate / 1e6:.1f} MB/s" if rate else "no per-byte cost beyond the links")
            + f" (mean error of the fit {100 * collective['fit_relative_error']:.0f} %)")


def network_rank(rank: int, world: int, port: int, o: dict[str, Any]) -> None:
    """One rank of the sweep (run by `sailor.runtime.ranks.run_ranks`); rank 0 writes
    {"p2p": {flows: [seconds per size]}, "allreduce": [seconds per size]} to `o["out"]`, or without
    one sends it as a rank message {"result": ...} (a rank on another machine). The rendezvous is on
    `o["master_addr"]` (default this machine)."""
    import json
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from sailor.runtime.device import rank_device, synchronize
    from sailor.runtime.ranks import init_rank, rank_message
    from sailor.runtime.timing import Stopwatch

    cuda = o["device"] == "cuda"
    device = rank_device("cuda", rank) if cuda else torch.device("cpu")  # arch check, current device
    init_rank(rank, world, port, backend_for(o["device"]), o["timeout_s"], o.get("master_addr", "127.0.0.1"))
    watch = Stopwatch(device)  # CUDA events on the compute stream, which waits for NCCL's

    def timed(fn) -> float:
        out = []
        for r in range(o["warmup"] + o["repeats"]):
            dist.barrier()
            synchronize(device)
            watch.start()
            fn()
            out.append(watch.stop())
        return float(np.mean(out[o["warmup"]:]))

    result: dict[str, Any] = {"p2p": {}, "allreduce": []}
    pair_counts = sorted({1, world // 2})
    for size in o["sizes"]:
        buf = torch.zeros(size // 4, dtype=torch.float32, device=device)
        for flows in pair_counts:
            peer = rank ^ 1
            active = rank < 2 * flows

            def ping_pong() -> None:
                if not active:
                    return
                if rank % 2 == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)

            # statistics on the group's device: NCCL reduces CUDA tensors only
            t = torch.tensor([timed(ping_pong) / 2 if active else 0.0], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest of the concurrent flows
            result["p2p"].setdefault(str(flows), []).append(t.item())
        t = torch.tensor([timed(lambda: dist.all_reduce(buf))], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        result["allreduce"].append(t.item())
        if rank == 0:
            rank_message({"tick": 1})
    if rank == 0 and o.get("out"):
        Path(o["out"]).write_text(json.dumps(result))
    elif rank == 0:
        rank_message({"result": result})
    dist.barrier()


def profile_network(nproc: int, *, device: str = "cpu", zone: str = "local", warmup: int = 2, repeats: int = 5,
                    sizes_bytes: tuple[int, ...] = SIZES_BYTES, timeout_s: float = 300.0,
                    progress=None) -> dict[str, Any]:
    """Run the sweep with `nproc` local processes and return our link file as a dict.

    `progress(n)` is called as sizes finish (len(sizes_bytes) in all). Raises SailorInputError for
    bad arguments (fewer than 2 processes, sizes not multiples of 4 bytes), RuntimeError if a rank
    fails.
    """
    import json
    from pathlib import Path

    from sailor.catalog import Link, LinkClass
    from sailor.core.errors import SailorInputError
    from sailor.core.limits import MAX_PROFILE_PASSES, max_local_processes
    from sailor.core.scratch import scratch_dir
    from sailor.runtime.profiler import device_description, device_gpu_type, versions
    from sailor.runtime.ranks import run_ranks
    from sailor.simulator.collectives import Member
    from sailor.specs.cluster import local_cluster

    if nproc < 2:
        raise SailorInputError(f"need at least 2 processes, got {nproc}", field="--nproc")
    if nproc > max_local_processes():
        raise SailorInputError(f"{nproc} processes, more than this machine can run ({max_local_processes()},"
                               " 4 per CPU core)", field="--nproc")
    if warmup < 0 or repeats < 1 or max(warmup, repeats) > MAX_PROFILE_PASSES:
        raise SailorInputError(f"need 0 <= warmup <= {MAX_PROFILE_PASSES} and 1 <= repeats <= {MAX_PROFILE_PASSES}",
                               field="--warmup/--repeats")
    if not sizes_bytes or any(s < 4 or s % 4 for s in sizes_bytes):
        raise SailorInputError("message sizes must be multiples of 4 bytes", field="sizes")
    gpu = device_gpu_type(device)  # type: ignore[arg-type]
    if device == "cuda":
        import torch
        if torch.cuda.device_count() < nproc:
            raise SailorInputError(f"{nproc} processes need {nproc} CUDA devices, this machine has"
                                   f" {torch.cuda.device_count()}", field="--nproc")
    with scratch_dir("sailor-netprofile-") as tmp:
        out = Path(tmp) / "net.json"
        run_ranks("sailor.runtime.netprofile:network_rank", nproc,
                  {"device": device, "warmup": warmup, "repeats": repeats, "sizes": list(sizes_bytes),
                   "timeout_s": timeout_s, "out": str(out)},
                  timeout_s=timeout_s * 4, on_message=(lambda m: progress(m["tick"])) if progress else None)
        res = json.loads(out.read_text())
    links, fits = [], {}
    for flows, times in sorted(res["p2p"].items(), key=lambda kv: int(kv[0])):
        alpha, beta = fit_alpha_beta(sizes_bytes, times)
        # β is per flow here; the file gives the aggregate bandwidth of `flows` concurrent flows.
        fits[int(flows)] = (alpha, beta)
        links.append({"src_zone": zone, "src_gpu": gpu, "dst_zone": zone, "dst_gpu": gpu, "flows": int(flows),
                      "latency_s": alpha, "bandwidth_bytes_per_s": beta * int(flows), "same_node": True})
    alpha1, beta1 = fits[1]
    bus = [2 * (nproc - 1) / nproc * x for x in sizes_bytes]
    ar_alpha, ar_beta = fit_alpha_beta(bus, res["allreduce"])
    data = {"schema": SCHEMA, "source": f"sailor profile network ({gpu}, {nproc} processes)",
            "device": device_description(device), "versions": versions(),  # type: ignore[arg-type]
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "classes": {"same_node": {"latency_s": alpha1, "bandwidth_bytes_per_s": beta1},
                        "same_zone": {"latency_s": alpha1, "bandwidth_bytes_per_s": beta1}},
            "links": links,
            "sweep": {"sizes_bytes": list(sizes_bytes), "p2p_one_way_s": res["p2p"], "allreduce_s": res["allreduce"]},
            "allreduce": {"processes": nproc, "latency_s": ar_alpha, "bus_bandwidth_bytes_per_s": ar_beta}}
    # the simulator's ring for these processes: all on one node, over the measured one-flow link
    net = NetworkModel(cluster=local_cluster(nproc), class_links={LinkClass.SAME_NODE: Link(alpha1, beta1)})
    members = [Member(zone="local", gpu="cpu", tp=1, node="local")] * nproc
    data["collective"] = fit_collective(bus, res["allreduce"], simulated_ring_s(net, members, sizes_bytes),
                                        backend_for(device))
    return data


def profile_pairs(pairs, launch, *, cluster, port: int, device: str = "cpu", warmup: int = 1, repeats: int = 3,
                  sizes_bytes: tuple[int, ...] = HOST_SIZES_BYTES, timeout_s: float = 300.0,
                  progress=None) -> dict[str, Any]:
    """Measure the link of each pair of machines with two processes, one on each, and return our link
    file as a dict: one `links` entry per pair (one flow), its α–β fitted to the one-way p2p times,
    and the backend's `collective` cost fitted on the pairs' all-reduce sweeps against the
    simulator's ring over those links in `cluster` (the machines' cluster spec; `collective_of_pairs`).

    `pairs`: `sailor.launch.hosts.LinkPair`s (src and dst (zone, GPU type), same_node, the two ssh
    destinations, the rendezvous address); `launch(destination, argv)`: the command that runs
    `python argv` on that machine (ssh). The rendezvous is on the first machine, port `port`.
    `progress(n)` is called as sizes finish (len(sizes_bytes) per pair). Raises RuntimeError (naming
    the pair) if a process fails or times out.
    """
    from sailor.runtime.profiler import versions
    from sailor.runtime.ranks import run_ranks

    links, sweeps = [], []
    for pair in pairs:
        got: dict[str, Any] = {}

        def on_message(m: dict[str, Any]) -> None:
            if "result" in m:
                got.update(m["result"])
            elif progress:
                progress(m["tick"])

        where = f"{pair.hosts[0]} -> {pair.hosts[1]}"
        try:
            run_ranks("sailor.runtime.netprofile:network_rank", 2,
                      {"device": device, "warmup": warmup, "repeats": repeats, "sizes": list(sizes_bytes),
                       "timeout_s": timeout_s, "out": None, "master_addr": pair.rendezvous},
                      timeout_s=timeout_s * 4, port=port, on_message=on_message,
                      launch=lambda rank, argv: launch(pair.hosts[rank], argv))
        except RuntimeError as e:
            raise RuntimeError(f"link {where}: {e}") from None
        alpha, beta = fit_alpha_beta(sizes_bytes, got["p2p"]["1"])
        links.append({"src_zone": pair.src[0], "src_gpu": pair.src[1], "dst_zone": pair.dst[0], "dst_gpu": pair.dst[1],
                      "flows": 1, "latency_s": alpha, "bandwidth_bytes_per_s": beta, "same_node": pair.same_node})
        sweeps.append({"hosts": list(pair.hosts), "p2p_one_way_s": got["p2p"]["1"], "allreduce_s": got["allreduce"]})
    data = {"schema": SCHEMA, "source": f"sailor profile network --hosts ({len(links)} links, {device})",
            "versions": versions(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "links": links, "sweep": {"sizes_bytes": list(sizes_bytes), "backend": backend_for(device), "pairs": sweeps}}
    data["collective"] = collective_of_pairs(network_from_ours(cluster, data, data["source"]), data)
    return data
