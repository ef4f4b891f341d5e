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
the planner times a pipeline kind's transfers once, as every one of its pipelines runs them.

A pipeline may also be *cut between nodes* before a stage (`Replica.node_cut` of the plan, `cuts`
here): that stage starts a new block even where it would fit next to the one before, and the block
goes first-fit on the nodes of its pool that hold none of its pipeline's earlier blocks. So a cut
boundary always crosses nodes, and the same stage of the next pipelines fills the same node: with
two stages of TP 1 cut on 8-GPU nodes, stage 0 of eight pipelines shares one node and stage 1 another
(their gradient all-reduce stays inside a node; the pipelines' activations cross between the two).
This is the pipeline cut a slow inter-node link calls for, where the uncut blocks would put whole
pipelines on each node and run the data-parallel all-reduce over that link."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
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


def node_blocks(pipeline: Sequence[Replica], node_size: Callable[[str], int],
                cuts: Sequence[bool] | None = None) -> list[int]:
    """Block index of each stage of one pipeline (module docstring): stage i + 1 is in stage i's block
    when both are in one (zone, GPU type) pool, the pipeline is not cut before it (`cuts[i + 1]`;
    None: no cuts) and the block's TP groups with it take at most node_size(gpu) GPUs (a TP group
    wider than a node is a block of its own, on a node of its own width, as the launcher always placed
    it). Example, 8 GPUs per node, one pool: TP 2, 2, 2, 4 -> blocks 0, 0, 0, 1 (2 + 2 + 2 + 4 = 10 >
    8); TP 1, 1 cut before stage 1 -> blocks 0, 1."""
    out: list[int] = []
    used, block = 0, -1
    for j, (zone, gpu, tp) in enumerate(pipeline):
        same_pool = j > 0 and pipeline[j - 1][:2] == (zone, gpu) and not (cuts and cuts[j])
        if same_pool and used + tp <= node_size(gpu):
            used += tp
        else:
            block, used = block + 1, tp
        out.append(block)
    return out


def same_node_boundaries(pipeline: Sequence[Replica], node_size: Callable[[str], int],
                         cuts: Sequence[bool] | None = None) -> tuple[bool, ...]:
    """Per stage boundary i (stage i to i + 1): True when the block placement puts both stages on one
    node, for every pipeline with these (zone, GPU type, TP) stages and cuts wherever it is placed (a
    cut block never shares a node with an earlier block of its pipeline, and an uncut new block did
    not fit next to the one before)."""
    b = node_blocks(pipeline, node_size, cuts)
    return tuple(b[i] == b[i + 1] for i in range(len(b) - 1))


class BlockFit:
    """The launcher's placement, one pipeline at a time (module docstring): each block of
    `node_blocks` first-fit on the nodes of its (zone, GPU type), `node_size(gpu)` GPUs each (a block
    wider than that opens a node of its own width), a block after a cut on the nodes that hold none of
    its pipeline's earlier blocks; a node is named "<zone>/<gpu>/<index>".

    Linear in the blocks placed: a node's free GPUs only shrink, so once a node has fewer than w free
    it never takes a block of w GPUs again, and the scan for w starts where the last one stopped (a
    cut block also steps over its pipeline's own nodes, at most one per earlier block)."""

    def __init__(self, node_size: Callable[[str], int]) -> None:
        self._size = node_size
        self._pools: dict[tuple[str, str], tuple[list[int], list[str]]] = {}  # free GPUs, name per node
        self._state: dict[tuple[str, str, int], list] = {}  # (zone, gpu, width) -> [scan start, free, names, cap, prefix]

    def put_block(self, zone: str, gpu: str, width: int, avoid: Collection[str] = ()) -> tuple[str, int]:
        """(node name, first local GPU index) of the next block of `width` GPUs in (zone, gpu), on
        none of the nodes named in `avoid`."""
        st = self._state.get((zone, gpu, width))
        if st is None:
            free, names = self._pools.setdefault((zone, gpu), ([], []))
            st = self._state[(zone, gpu, width)] = [0, free, names, max(self._size(gpu), width), f"{zone}/{gpu}/"]
        idx, free, names, cap, prefix = st
        while idx < len(free) and free[idx] < width:
            idx += 1
        st[0] = idx
        while idx < len(free) and (free[idx] < width or names[idx] in avoid):
            idx += 1
        if idx == len(free):
            free.append(cap)
            names.append(prefix + str(idx))
        first = cap - free[idx]
        free[idx] -= width
        return names[idx], first

    def put(self, pipeline: Sequence[Replica], blocks: Sequence[int] | None = None,
            cuts: Sequence[bool] | None = None) -> list[tuple[str, int]]:
        """(node name, first local GPU index) of every stage of the next pipeline, cut between nodes
        before stage i where `cuts[i]` (None: nowhere); `blocks` its `node_blocks` where the caller
        has them."""
        blocks = node_blocks(pipeline, self._size, cuts) if blocks is None else blocks
        out: list[tuple[str, int]] = []
        i = 0
        while i < len(pipeline):
            j = i
            while j + 1 < len(pipeline) and blocks[j + 1] == blocks[i]:
                j += 1
            zone, gpu, _ = pipeline[i]
            avoid = {node for node, _ in out} if cuts and cuts[i] else ()
            node, first = self.put_block(zone, gpu, sum(r[2] for r in pipeline[i:j + 1]), avoid)
            for r in pipeline[i:j + 1]:
                out.append((node, first))
                first += r[2]
            i = j + 1
        return out


def pack_replicas(pipelines: list[list[Replica]], gpus_per_node: dict[str, int] | None = None,
                  cuts: list[Sequence[bool]] | None = None) -> list[list[tuple[str, int]]]:
    """Where the launcher puts every replica: [pipeline][stage] -> (node, first local GPU index).

    `pipelines[j][i]` is (zone, GPU type, TP) of stage i of pipeline j, `cuts[j][i]` whether pipeline j
    is cut between nodes before stage i (None: no cuts). Pipelines are placed in order, each by blocks
    of consecutive stages on one node (`node_blocks`, `BlockFit`), `gpus_per_node[gpu]` GPUs per node
    (catalog default), never splitting a TP group; a node is named "<zone>/<gpu>/<index>". The planner
    calls this on pipelines it has not built as a Plan yet.
    """
    fit = BlockFit(catalog_sizes(gpus_per_node))
    return [fit.put(pipe, cuts=None if cuts is None else cuts[j]) for j, pipe in enumerate(pipelines)]


def rank_layout(plan: Plan, gpus_per_node: dict[str, int] | None = None) -> list[RankInfo]:
    """Global ranks of a plan, in order pipeline, stage, TP rank; TP groups placed on nodes
    (`pack_replicas`: blocks of consecutive stages, cut where the replicas say, first-fit per (zone, GPU type) with
    `gpus_per_node[gpu]` GPUs each, catalog default, never splitting a TP group). Asserts that every
    rank appears once.
    """
    placed = pack_replicas([[(r.zone, r.gpu, r.tp) for r in p.replicas] for p in plan.pipelines], gpus_per_node,
                           [[r.node_cut for r in p.replicas] for p in plan.pipelines])
    out: list[RankInfo] = []
    for j, p in enumerate(plan.pipelines):
        for i, r in enumerate(p.replicas):
            node, first_local = placed[j][i]
            for t in range(r.tp):
                out.append(RankInfo(rank=len(out), pipeline=j, stage=i, tp_rank=t, tp=r.tp, gpu=r.gpu,
                                    zone=r.zone, node=node, local_rank=first_local + t))
    assert [x.rank for x in out] == list(range(plan.world_size))
    return out
