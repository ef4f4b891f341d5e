"""Where a plan's ranks sit: global rank order (pipeline, stage, TP rank) and the block placement of
each pipeline's replicas onto nodes. The one placement the launcher uses and the simulator and planner
score.

The rule (`node_blocks`, `BlockFit`): a pipeline's consecutive stages in one (zone, GPU type) pool form
blocks, greedily from its first stage: a stage joins the block before it when it is in the same pool
and the block's GPUs with it still fit one node. Each block goes, whole, first-fit on the nodes of
its pool (the first node with that many free GPUs; a new node when none has). Inside a block the
stages sit on one node, in stage order; two consecutive blocks of one pool never share a node (the
second block's first stage did not fit next to the first block, so neither does the second block).
So whether stage i and stage i + 1 of a pipeline share a node depends on the pipeline's own (zone,
GPU type, TP) sequence alone, the same for every pipeline of that sequence (`same_node_boundaries`):
the planner times a pipeline kind's transfers once, as every one of its pipelines runs them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sailor import catalog
from sailor.plan.spec import Plan

Replica = tuple[str, str, int]  # (zone, GPU type, TP degree) of one stage of a pipeline


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


def catalog_sizes(gpus_per_node: dict[str, int] | None = None) -> Callable[[str], int]:
    """GPUs per node of a GPU type: `gpus_per_node[gpu]` where given, else the catalog's."""
    sizes = {} if gpus_per_node is None else gpus_per_node
    return lambda gpu: sizes.get(gpu) or catalog.gpu(gpu).gpus_per_node


def node_blocks(pipeline: Sequence[Replica], node_size: Callable[[str], int]) -> list[int]:
    """Block index of each stage of one pipeline (module docstring): stage i + 1 is in stage i's block
    when both are in one (zone, GPU type) pool and the block's TP groups with it take at most
    node_size(gpu) GPUs (a TP group wider than a node is a block of its own, on a node of its own
    width, as the launcher always placed it). Example, 8 GPUs per node, one pool: TP 2, 2, 2, 4 -> blocks
    0, 0, 0, 1 (2 + 2 + 2 + 4 = 10 > 8)."""
    out: list[int] = []
    used, block = 0, -1
    for j, (zone, gpu, tp) in enumerate(pipeline):
        same_pool = j > 0 and pipeline[j - 1][:2] == (zone, gpu)
        if same_pool and used + tp <= node_size(gpu):
            used += tp
        else:
            block, used = block + 1, tp
        out.append(block)
    return out


def same_node_boundaries(pipeline: Sequence[Replica], node_size: Callable[[str], int]) -> tuple[bool, ...]:
    """Per stage boundary i (stage i to i + 1): True when the block placement puts both stages on one
    node, for every pipeline with these (zone, GPU type, TP) stages wherever it is placed."""
    b = node_blocks(pipeline, node_size)
    return tuple(b[i] == b[i + 1] for i in range(len(b) - 1))


class BlockFit:
    """The launcher's placement, one pipeline at a time (module docstring): each block of
    `node_blocks` first-fit on the nodes of its (zone, GPU type), `node_size(gpu)` GPUs each (a block
    wider than that opens a node of its own width); a node is named "<zone>/<gpu>/<index>".

    Linear in the blocks placed: a node's free GPUs only shrink, so once a node has fewer than w free
    it never takes a block of w GPUs again, and the scan for w starts where the last one stopped."""

    def __init__(self, node_size: Callable[[str], int]) -> None:
        self._size = node_size
        self._pools: dict[tuple[str, str], tuple[list[int], list[str]]] = {}  # free GPUs, name per node
        self._state: dict[tuple[str, str, int], list] = {}  # (zone, gpu, width) -> [scan start, free, names, cap, prefix]

    def put_block(self, zone: str, gpu: str, width: int) -> tuple[str, int]:
        """(node name, first local GPU index) of the next block of `width` GPUs in (zone, gpu)."""
        st = self._state.get((zone, gpu, width))
        if st is None:
            free, names = self._pools.setdefault((zone, gpu), ([], []))
            st = self._state[(zone, gpu, width)] = [0, free, names, max(self._size(gpu), width), f"{zone}/{gpu}/"]
        idx, free, names, cap, prefix = st
        while idx < len(free) and free[idx] < width:
            idx += 1
        if idx == len(free):
            free.append(cap)
            names.append(prefix + str(idx))
        st[0] = idx
        first = cap - free[idx]
        free[idx] -= width
        return names[idx], first

    def put(self, pipeline: Sequence[Replica], blocks: Sequence[int] | None = None) -> list[tuple[str, int]]:
        """(node name, first local GPU index) of every stage of the next pipeline; `blocks` its
        `node_blocks` where the caller has them."""
        blocks = node_blocks(pipeline, self._size) if blocks is None else blocks
        out: list[tuple[str, int]] = []
        i = 0
        while i < len(pipeline):
            j = i
            while j + 1 < len(pipeline) and blocks[j + 1] == blocks[i]:
                j += 1
            zone, gpu, _ = pipeline[i]
            node, first = self.put_block(zone, gpu, sum(r[2] for r in pipeline[i:j + 1]))
            for r in pipeline[i:j + 1]:
                out.append((node, first))
                first += r[2]
            i = j + 1
        return out


def pack_replicas(pipelines: list[list[Replica]], gpus_per_node: dict[str, int] | None = None) -> list[list[tuple[str, int]]]:
    """Where the launcher puts every replica: [pipeline][stage] -> (node, first local GPU index).

    `pipelines[j][i]` is (zone, GPU type, TP) of stage i of pipeline j. Pipelines are placed in order,
    each by blocks of consecutive stages on one node (`node_blocks`, `BlockFit`), `gpus_per_node[gpu]`
    GPUs per node (catalog default), never splitting a TP group; a node is named "<zone>/<gpu>/<index>".
    The planner calls this on pipelines it has not built as a Plan yet.
    """
    fit = BlockFit(catalog_sizes(gpus_per_node))
    return [fit.put(pipe) for pipe in pipelines]


def rank_layout(plan: Plan, gpus_per_node: dict[str, int] | None = None) -> list[RankInfo]:
    """Global ranks of a plan, in order pipeline, stage, TP rank; TP groups placed on nodes
    (`pack_replicas`: blocks of consecutive stages first-fit per (zone, GPU type) with
    `gpus_per_node[gpu]` GPUs each, catalog default, never splitting a TP group). Asserts that every
    rank appears once.
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
