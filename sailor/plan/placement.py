"""Where a plan's ranks sit: global rank order (pipeline, stage, TP rank) and first-fit packing of
TP groups onto nodes. The one placement the launcher uses and the simulator and planner score."""

from __future__ import annotations

from dataclasses import dataclass

from sailor import catalog
from sailor.plan.spec import Plan


@dataclass(frozen=True)
class RankInfo:
    """Where a global rank sits: pipeline j, stage i, TP rank, and its node."""

    rank: int
    pipeline: int
    stage: int
    tp_rank: int
    tp: int
    gpu: str
    zone: str
    node: str  # "<zone>/<gpu>/<index>": a machine of `gpus_per_node` GPUs
    local_rank: int  # GPU index within the node



class FirstFit:
    """The launcher's placement, one replica at a time: first-fit on the nodes of the replica's
    (zone, GPU type), `gpus_per_node[gpu]` GPUs each (catalog default), never splitting a TP group;
    a node is named "<zone>/<gpu>/<index>" (`pack_replicas`).

    Linear in the replicas placed: a node's free GPUs only shrink, so once a node has fewer than tp
    free it never takes a TP-tp group again, and the scan for tp starts where the last one stopped."""

    def __init__(self, gpus_per_node: dict[str, int] | None = None) -> None:
        self._sizes = {} if gpus_per_node is None else gpus_per_node
        self._pools: dict[tuple[str, str], tuple[list[int], list[str]]] = {}  # free GPUs, name per node
        self._state: dict[tuple[str, str, int], list] = {}  # (zone, gpu, tp) -> [scan start, free, names, cap, tp, name prefix]

    def put(self, replica: tuple[str, str, int]) -> tuple[str, int]:
        """(node name, first local GPU index) of the next replica (zone, GPU type, TP)."""
        st = self._state.get(replica)
        if st is None:
            zone, gpu, tp = replica
            size = self._sizes.get(gpu) or catalog.gpu(gpu).gpus_per_node
            free, names = self._pools.setdefault((zone, gpu), ([], []))
            st = self._state[replica] = [0, free, names, max(size, tp), tp, f"{zone}/{gpu}/"]
        idx, free, names, cap, tp, prefix = st
        while idx < len(free) and free[idx] < tp:
            idx += 1
        if idx == len(free):
            free.append(cap)
            names.append(prefix + str(idx))
        st[0] = idx
        first = cap - free[idx]
        free[idx] -= tp
        return names[idx], first



def pack_replicas(pipelines: list[list[tuple[str, str, int]]],
                  gpus_per_node: dict[str, int] | None = None) -> list[list[tuple[str, int]]]:
    """Where the launcher puts every replica: [pipeline][stage] -> (node, first local GPU index).

    `pipelines[j][i]` is (zone, GPU type, TP) of stage i of pipeline j. Replicas are placed in order
    pipeline, stage, first-fit on the nodes of their (zone, GPU type), `gpus_per_node[gpu]` GPUs
    each (catalog default), never splitting a TP group (`FirstFit`); a node is named
    "<zone>/<gpu>/<index>". The planner calls this on pipelines it has not built as a Plan yet.
    """
    fit = FirstFit(gpus_per_node)
    return [[fit.put(r) for r in pipe] for pipe in pipelines]



def rank_layout(plan: Plan, gpus_per_node: dict[str, int] | None = None) -> list[RankInfo]:
    """Global ranks of a plan, in order pipeline, stage, TP rank; TP groups packed onto nodes
    (`pack_replicas`: first-fit per (zone, GPU type) with `gpus_per_node[gpu]` GPUs each, catalog
    default, never splitting a TP group). Asserts that every rank appears once.
    """
    placed = pack_replicas([[(r.zone, r.gpu, r.tp) for r in p.replicas] for p in plan.pipelines], gpus_per_node)
    out: list[RankInfo] = []
    for j, p in enumerate(plan.pipelines):
        for i, r in enumerate(p.replicas):
            node, first_local = placed[j][i]
            for t in range(r.tp):
                out.append(RankInfo(rank=len(out), pipeline=j, stage=i, tp_rank=t, tp=r.tp, gpu=r.gpu,
                                    zone=r.zone, node=node, local_rank=first_local + t))
    assert [x.rank for x in out] == list(range(plan.world_size))
    return out
