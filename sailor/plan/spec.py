"""The Plan: one layer partition shared by all pipelines, and D pipelines (data-parallel replicas).

```
stages:    [[0, 7], [7, 26]]             # half-open layer ranges over the model's layer list
pipelines: - microbatches: 20            # this pipeline's share of the global batch
             replicas: [{stage: 0, gpu: A100-40, zone: us-central1-a, tp: 4},
                        {stage: 1, gpu: V100-16, zone: us-central1-b, tp: 4}]
micro_batch_size: 4
```
Replica (i, j) is stage i of pipeline j: a TP group of `tp` GPUs of one type on one node. A plan file
may carry the `job` and `cluster` it was made for.

Optional `schedule` (`Schedule`): how every pipeline orders its passes. Absent, `{"kind": "1f1b"}`, so
plans written before schedules existed mean what they meant.
- `1f1b`: one forward and one backward per micro-batch and stage (PipeDream-Flush, Narayanan et al.
  SC'21 §2.2.1); `stages` has one layer range per pipeline stage.
- `interleaved-1f1b` with `virtual_stages` v >= 2 (Narayanan et al. SC'21 §2.2.2, Megatron-LM's
  virtual pipeline stages): `stages` is the model cut into p·v contiguous *chunks* (virtual stages),
  in layer order, each of any size (chunks may be uneven); chunk k runs on pipeline stage k mod p, so
  stage i holds the v non-contiguous chunks i, i + p, ..., i + (v-1)·p (`Plan.stage_chunks`). Each
  pipeline still has one replica per pipeline stage (p of them, `Replica.stage` in [0, p)): the
  chunks of a stage share its replica's GPUs, TP degree and zone, and a micro-batch goes around the
  pipeline v times (chunk p·v-1 ... reaches the head; chunk p-1 hands over to chunk p on stage 0).
  Example, 2 stages x 2 chunks of a 26-layer model:
  `"stages": [[0, 5], [5, 13], [13, 20], [20, 26]], "schedule": {"kind": "interleaved-1f1b",
  "virtual_stages": 2}`: stage 0 holds [0, 5) and [13, 20), stage 1 holds [5, 13) and [20, 26).
- `zb-h1`: each backward split into an input-gradient pass (B) and a weight-gradient pass (W), the
  W passes deferred to fill the bubble at 1F1B's activation memory (Qi et al., ICLR 2024, "Zero Bubble
  Pipeline Parallelism", ZB-H1); `stages` as for 1f1b.
`Plan.num_stages` is always p, the number of pipeline stages (replicas per pipeline).

Optional `memory`: one entry per pipeline stage with the stage's memory options (`StageMemory`:
activation recomputation, ZeRO sharding over the stage's data-parallel replicas, sequence
parallelism). Absent, every stage uses the defaults (no recomputation, no sharding, no sequence
parallelism), so plans written before these options existed mean what they meant. Under
interleaving an entry applies to every chunk of its stage (the chunks share the replica's memory
and optimizer); `recompute_blocks` counts the stage's blocks in layer order over its chunks.
`Plan.stage_memory(i)` is the one accessor; the simulator and the runtime each read it in one place.

Optional `experts`: one entry per pipeline stage with its expert parallelism (`plan.experts.StageExperts`:
the EP degree, EP groups carved out of the stage's data-parallel pipelines, and which EP rank holds
which experts). Absent, EP is 1 everywhere: every rank holds every expert. `Plan.stage_experts(i)`
is the accessor.
Validation refuses what cannot run, naming the field: an interleaved plan whose chunk count is not a
multiple of v or that has a single stage, and zb-h1 with full recomputation (the deferred W passes
need the activations full recomputation drops). `rank_layout` is the one place where ranks, nodes
and TP groups are derived from a plan (the runtime, launchers and simulator all use it); chunks do
not change it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from sailor import catalog
from sailor.core.errors import SailorInputError
from sailor.core.fileio import write_json
from sailor.core.limits import MAX_BLOCKS, MAX_GLOBAL_BATCH, MAX_GPUS_PER_NODE
from sailor.core.schema import SPEC_CONFIG, Whole
from sailor.model.spec import Recompute
from sailor.plan.experts import (
    DEFAULT_STAGE_EXPERTS,
    StageExperts,
    check_experts_for_job,
    check_plan_experts,
    experts_to_dict,
)
from sailor.plan.orders import Op, ScheduleKind, stage_order
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

Layer = Whole(0, MAX_BLOCKS + 2)  # a layer boundary: 0 .. embedding + blocks + head


class Replica(BaseModel):
    """Stage `stage` of one pipeline on a TP group of `tp` GPUs of type `gpu` in `zone`. `node_cut`:
    the pipeline is cut between nodes before this stage (never on stage 0): the launcher puts it on a
    node that holds none of the pipeline's earlier stages, even where it would fit next to the stage
    before (`plan.placement`); absent (false), the block placement decides."""

    model_config = SPEC_CONFIG
    stage: Layer
    gpu: str
    zone: str = Field(max_length=200)
    tp: Whole(1, MAX_GPUS_PER_NODE) = 1
    node_cut: bool = Field(default=False, strict=True)

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: str) -> str:
        return catalog.canonical_gpu(v)


class StageMemory(BaseModel):
    """Memory options of one stage, the same on all of its replicas.

    Attributes:
        recompute: activation recomputation mode (`Recompute`).
        recompute_blocks: with `full`, how many of the stage's transformer blocks are recomputed
            (the first ones); None = all of them. Only valid with `full`.
        zero: ZeRO stage over the stage's data-parallel replicas (Rajbhandari et al. 2020): 0 none,
            1 optimizer states (and fp32 master weights) sharded, 2 also gradients, 3 also
            parameters. Each block is sharded among the ranks that hold it (the gradient-sync
            groups of `runtime.topology`), so replicas of different TP degrees and GPU types shard
            correctly.
        sequence_parallel: Megatron sequence parallelism inside each TP group (Korthikanti et al.
            2022, §4.2.2): norms and dropouts work on 1/t of the sequence, all-reduces become
            reduce-scatter + all-gather. Needs TP > 1 on every replica of the stage.
        reshard_after_forward: ZeRO-3 only (FSDP's term, torch `fully_shard`): True frees each
            layer's gathered weights after every forward and backward pass (two all-gathers per
            layer per micro-batch); False keeps them from their first gather of the iteration until
            the layer's last backward (one all-gather per layer per iteration, and up to the stage's
            full weights held at once). `runtime.zero` does it; the simulator and planner model both.
    """

    model_config = SPEC_CONFIG
    recompute: Recompute = Recompute.NONE
    recompute_blocks: int | None = Field(default=None, ge=0, strict=True)
    zero: int = Field(default=0, ge=0, le=3, strict=True)
    sequence_parallel: bool = Field(default=False, strict=True)
    reshard_after_forward: bool = Field(default=True, strict=True)

    @model_validator(mode="after")
    def _check(self) -> "StageMemory":
        if not self.reshard_after_forward and self.zero != 3:
            raise SailorInputError(f"reshard_after_forward false needs zero 3 (only ZeRO-3 gathers weights), got"
                                   f" zero {self.zero}", field="reshard_after_forward")
        if self.recompute_blocks is not None and self.recompute is not Recompute.FULL:
            raise SailorInputError(f"recompute_blocks needs recompute 'full', got {self.recompute.value!r}",
                                   field="recompute_blocks")
        return self

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_STAGE_MEMORY


DEFAULT_STAGE_MEMORY = StageMemory()


class Schedule(BaseModel):
    """How every pipeline of a plan orders its forward and backward passes.

    Attributes:
        kind: the schedule (`ScheduleKind`).
        virtual_stages: v, layer chunks per pipeline stage: >= 2 for `interleaved-1f1b`, 1 otherwise.
    """

    model_config = SPEC_CONFIG
    kind: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    virtual_stages: Whole(1, MAX_BLOCKS + 2) = 1  # at most one chunk per layer

    @property
    def splits_backward(self) -> bool:
        """Backwards run as an input-gradient pass (B) and a later weight-gradient pass (W)."""
        return self.kind is ScheduleKind.ZB_H1

    def order(self, stage: int, num_stages: int, microbatches: int) -> list[Op]:
        """The ops of `stage` of a pipeline of `num_stages` stages running `microbatches`
        micro-batches (or rounds), in execution order (`orders.stage_order`)."""
        return stage_order(self.kind, self.virtual_stages, num_stages, stage, microbatches)

    @model_validator(mode="after")
    def _check(self) -> "Schedule":
        v = self.virtual_stages
        if self.kind is ScheduleKind.INTERLEAVED and v < 2:
            raise SailorInputError(f"interleaved-1f1b needs virtual_stages >= 2 (chunks per stage), got {v}",
                                   field="virtual_stages")
        if self.kind is not ScheduleKind.INTERLEAVED and v != 1:
            raise SailorInputError(f"{self.kind.value} runs one chunk per stage, got virtual_stages {v}",
                                   field="virtual_stages", fix="use kind interleaved-1f1b for virtual stages")
        return self


DEFAULT_SCHEDULE = Schedule()


class Pipeline(BaseModel):
    """One data-parallel replica of the model: `microbatches` micro-batches per iteration, one
    replica per stage in stage order."""

    model_config = SPEC_CONFIG
    microbatches: Whole(1, MAX_GLOBAL_BATCH)
    replicas: tuple[Replica, ...]

    @property
    def gpus(self) -> int:
        return sum(r.tp for r in self.replicas)


class Plan(BaseModel):
    """A full parallelization plan (validated on construction for internal consistency; use
    `check_against` for consistency with a job and a cluster)."""

    model_config = SPEC_CONFIG
    micro_batch_size: Whole(1, MAX_GLOBAL_BATCH)
    stages: tuple[tuple[Layer, Layer], ...] = Field(max_length=MAX_BLOCKS + 2)
    pipelines: tuple[Pipeline, ...] = Field(max_length=MAX_GLOBAL_BATCH)
    memory: tuple[StageMemory, ...] = ()
    """Per-stage memory options; empty = defaults everywhere (see the module docstring)."""
    schedule: Schedule = DEFAULT_SCHEDULE
    """Pipeline schedule; 1F1B by default (see the module docstring)."""
    experts: tuple[StageExperts, ...] = ()
    """Per-stage expert parallelism; empty = EP 1 everywhere (`sailor.plan.experts`)."""
    job: JobSpec | None = None
    cluster: ClusterSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> "Plan":
        if not self.stages:
            raise SailorInputError("a plan needs at least one stage", field="stages")
        v = self.schedule.virtual_stages
        what = "stage" if v == 1 else "chunk"
        start = 0
        for i, (a, b) in enumerate(self.stages):
            if a != start:
                how = f"overlaps the previous {what}" if a < start else f"leaves a gap after the previous {what}"
                raise SailorInputError(f"{what} {i} starts at layer {a} and {how} (expected {start})", field=f"stages.{i}")
            if b <= a:
                raise SailorInputError(f"{what} {i} [{a}, {b}) holds no layer", field=f"stages.{i}")
            start = b
        if len(self.stages) % v:
            raise SailorInputError(f"{len(self.stages)} layer chunks for {v} virtual stages per pipeline stage: need a"
                                   f" multiple of {v} (chunk k runs on stage k mod p)", field="stages")
        P = self.num_stages
        if self.schedule.kind is ScheduleKind.INTERLEAVED and P < 2:
            raise SailorInputError(f"interleaved-1f1b needs at least 2 pipeline stages, the plan has {P}"
                                   f" ({len(self.stages)} chunks / {v})", field="schedule.kind", fix="use 1f1b")
        if not self.pipelines:
            raise SailorInputError("a plan needs at least one pipeline", field="pipelines")
        if self.global_batch_size > MAX_GLOBAL_BATCH:
            raise SailorInputError(f"micro_batch_size {self.micro_batch_size} x {sum(p.microbatches for p in self.pipelines)}"
                                   f" micro-batches = {self.global_batch_size} samples, more than any job"
                                   f" ({MAX_GLOBAL_BATCH}, sailor.core.limits.MAX_GLOBAL_BATCH)", field="pipelines")
        for j, p in enumerate(self.pipelines):
            if len(p.replicas) != P:
                raise SailorInputError(f"pipeline {j} has {len(p.replicas)} replicas for {P} stages",
                                       field=f"pipelines.{j}.replicas")
            for i, r in enumerate(p.replicas):
                if r.stage != i:
                    raise SailorInputError(f"replica {i} of pipeline {j} names stage {r.stage}, expected {i}",
                                           field=f"pipelines.{j}.replicas.{i}.stage")
            if p.replicas[0].node_cut:
                raise SailorInputError(f"pipeline {j} is cut between nodes before stage 0; a cut goes before a later stage",
                                       field=f"pipelines.{j}.replicas.0.node_cut")
        if self.memory and len(self.memory) != P:
            raise SailorInputError(f"{len(self.memory)} entries for {P} stages (one per stage, or none)",
                                   field="memory")
        for i, mem in enumerate(self.memory):
            if mem.sequence_parallel:
                for j, p in enumerate(self.pipelines):
                    if p.replicas[i].tp < 2:
                        raise SailorInputError(f"sequence parallelism needs TP > 1, but replica {i} of pipeline {j}"
                                               f" has TP {p.replicas[i].tp}", field=f"memory.{i}.sequence_parallel")
            if self.schedule.kind is ScheduleKind.ZB_H1 and mem.recompute is Recompute.FULL:
                raise SailorInputError(f"zb-h1 defers weight-gradient passes, which need the activations full"
                                       f" recomputation drops (stage {i})", field=f"memory.{i}.recompute",
                                       fix="use recompute none or selective, or schedule 1f1b")
        check_plan_experts(self.experts, [[r.tp for r in p.replicas] for p in self.pipelines],
                           [p.microbatches for p in self.pipelines])
        return self

    # ---- derived ---------------------------------------------------------------------------
    def stage_memory(self, stage: int) -> StageMemory:
        """Memory options of stage `stage` (the defaults when the plan gives none)."""
        return self.memory[stage] if self.memory else DEFAULT_STAGE_MEMORY

    def stage_experts(self, stage: int) -> StageExperts:
        """Expert parallelism of stage `stage` (EP 1 when the plan gives none)."""
        return self.experts[stage] if self.experts else DEFAULT_STAGE_EXPERTS

    def chunk_memory(self, stage: int) -> tuple[StageMemory, ...]:
        """`stage_memory(stage)` for each of the stage's chunks (`stage_chunks`; one unless
        interleaved), with `recompute_blocks` counted over the chunks in layer order
        (`split_recompute_blocks`)."""
        return split_recompute_blocks(self.stage_memory(stage), self.stage_chunks(stage), self.num_layers)

    @property
    def num_stages(self) -> int:
        """p: pipeline stages, i.e. replicas per pipeline (under interleaving, chunks / v)."""
        return len(self.stages) // self.schedule.virtual_stages

    @property
    def virtual_stages(self) -> int:
        """v: layer chunks per pipeline stage (1 unless interleaved)."""
        return self.schedule.virtual_stages

    def stage_chunks(self, stage: int) -> tuple[tuple[int, int], ...]:
        """Half-open layer ranges pipeline stage `stage` holds, in layer order: chunks stage,
        stage + p, ..., stage + (v-1)·p of `stages` (one range unless interleaved)."""
        return tuple(self.stages[stage::self.num_stages])

    def stage_layers_text(self, stage: int) -> str:
        """The layers of stage `stage` for people, e.g. "[0, 5) + [13, 20)"."""
        return " + ".join(f"[{a}, {b})" for a, b in self.stage_chunks(stage))

    @property
    def num_layers(self) -> int:
        return self.stages[-1][1]

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * sum(p.microbatches for p in self.pipelines)

    @property
    def world_size(self) -> int:
        return sum(p.gpus for p in self.pipelines)

    def step_rounds(self, pipeline: int) -> int:
        """Micro-batch rounds pipeline `pipeline` runs per step: the largest pipeline's micro-batch
        count when some stage reduce-scatters its gradients per micro-batch (ZeRO-2/3: every member of
        a stage's group meets in a collective for every micro-batch, so the pipelines with fewer run
        the missing rounds' collectives alone, with zero gradients), else its own. The runtime's
        rounds (`runtime.schedule.step_rounds`) and the simulator's reduce-scatter count
        (`simulator.sync`) both read it here."""
        if any(self.stage_memory(i).zero >= 2 for i in range(self.num_stages)):
            return max(p.microbatches for p in self.pipelines)
        return self.pipelines[pipeline].microbatches

    def gpu_usage(self) -> Counter:
        """GPUs used per (zone, GPU type)."""
        use: Counter = Counter()
        for p in self.pipelines:
            for r in p.replicas:
                use[(r.zone, r.gpu)] += r.tp
        return use

    def check_against(self, job: JobSpec, cluster: ClusterSpec | None = None) -> None:
        """Raise SailorInputError unless this plan fits `job` (layers, batch, TP; memory options:
        recompute_blocks within the stage's blocks, sequence parallelism on a sequence every TP
        degree divides and on no stage holding a mixture-of-experts block, which the runtime does not
        run sequence-parallel; expert parallelism, `check_experts_for_job`) and `cluster` (zones, GPU
        counts, TP within a node). The one plan-against-job check of `sailor simulate`, `train`,
        `launch`, the workers and the planner."""
        model = job.model
        if self.num_layers != model.num_layers:
            raise SailorInputError(f"stages cover layers [0, {self.num_layers}) but {model.name} has"
                                   f" {model.num_layers} layers (embedding, {model.num_blocks} blocks, head)",
                                   field="stages")
        if self.global_batch_size != job.global_batch_size:
            mbs = summarize_counts([p.microbatches for p in self.pipelines])
            raise SailorInputError(f"micro_batch_size {self.micro_batch_size} x microbatches {mbs} ="
                                   f" {self.global_batch_size} samples, but the job's global batch is"
                                   f" {job.global_batch_size}", field="pipelines")
        for j, p in enumerate(self.pipelines):
            for i, r in enumerate(p.replicas):
                try:
                    model.check_tp(r.tp)
                except SailorInputError as e:
                    raise e.located(field_prefix=f"pipelines.{j}.replicas.{i}.tp") from None
        for i in range(self.num_stages):
            mem = self.stage_memory(i)
            blocks = sum(1 for a, b in self.stage_chunks(i) for layer in range(a, b)
                         if model.layer_kind(layer).value == "block")
            if mem.recompute_blocks is not None and mem.recompute_blocks > blocks:
                raise SailorInputError(f"recompute_blocks {mem.recompute_blocks} but stage {i} holds {blocks}"
                                       " transformer blocks", field=f"memory.{i}.recompute_blocks")
            if mem.sequence_parallel:
                if model.holds_moe_block(self.stage_chunks(i)):
                    raise SailorInputError(f"stage {i} {self.stage_layers_text(i)} holds mixture-of-experts blocks,"
                                           " which the runtime does not run sequence-parallel",
                                           field=f"memory.{i}.sequence_parallel", fix="set it to false")
                for j, p in enumerate(self.pipelines):
                    if job.seq % p.replicas[i].tp:
                        raise SailorInputError(f"sequence parallelism splits the sequence over TP, but {job.seq} tokens"
                                               f" do not divide by TP {p.replicas[i].tp} (replica {i} of pipeline {j})",
                                               field=f"memory.{i}.sequence_parallel")
        check_experts_for_job(self.experts, model, [(self.stage_layers_text(i), model.holds_moe_block(self.stage_chunks(i)))
                                                    for i in range(len(self.experts))])
        if cluster is None:
            return
        for j, p in enumerate(self.pipelines):
            for i, r in enumerate(p.replicas):
                where = f"pipelines.{j}.replicas.{i}"
                try:
                    cluster.prov.region(r.zone)
                except SailorInputError as e:
                    raise e.located(field_prefix=f"{where}.zone") from None
                if r.tp > cluster.node_size(r.gpu):
                    raise SailorInputError(f"TP {r.tp} is larger than one {r.gpu} node ({cluster.node_size(r.gpu)} GPUs);"
                                           " TP never crosses a node", field=f"{where}.tp")
        for (zone, gpu), n in sorted(self.gpu_usage().items()):
            have = cluster.available(zone, gpu)
            if n > have:
                raise SailorInputError(f"the plan uses {n} {gpu} in {zone} but the cluster has {have}", field="pipelines")

    def to_dict(self, *, with_specs: bool = True) -> dict[str, Any]:
        """JSON-ready form (the plan file format)."""
        d: dict[str, Any] = {
            "micro_batch_size": self.micro_batch_size,
            "stages": [list(s) for s in self.stages],
            "pipelines": [{"microbatches": p.microbatches,
                           "replicas": [r.model_dump(mode="json", exclude=None if r.node_cut else {"node_cut"})
                                        for r in p.replicas]} for p in self.pipelines],
        }
        if any(not m.is_default for m in self.memory):
            d["memory"] = [m.model_dump(mode="json", exclude_defaults=True) for m in self.memory]
        experts = experts_to_dict(self.experts)
        if experts:
            d["experts"] = experts
        if self.schedule != DEFAULT_SCHEDULE:
            d["schedule"] = self.schedule.model_dump(mode="json", exclude_defaults=True)
        if with_specs and self.job is not None:
            d["job"] = self.job.to_dict()
        if with_specs and self.cluster is not None:
            d["cluster"] = self.cluster.to_dict()
        return d

    def with_specs(self, job: JobSpec | None, cluster: ClusterSpec | None) -> "Plan":
        """A copy carrying `job` and `cluster` (validated again)."""
        d = self.to_dict(with_specs=False)
        d["job"] = job.to_dict() if job else None
        d["cluster"] = cluster.to_dict() if cluster else None
        return Plan.model_validate(d)

    def save(self, path: str | Path) -> None:
        """Write the plan file atomically."""
        write_json(path, self.to_dict())


# ---- rank layout: the one Plan -> ranks/nodes function ------------------------------------------
def chunk_blocks(chunk: tuple[int, int], num_layers: int) -> int:
    """Transformer blocks in the layer range `chunk` of a model of `num_layers` layers (layer 0 is
    the embedding, the last the head)."""
    a, b = chunk
    return max(min(b, num_layers - 1) - max(a, 1), 0)


def interleave_partition(stages: Sequence[tuple[int, int]], v: int) -> tuple[tuple[int, int], ...]:
    """The p·v chunks (in layer order, chunk k on stage k mod p) of an interleaved plan whose stage i
    holds as many layers as stage i of the p-stage partition `stages` does: its n_i layers in v
    chunks of n_i // v or n_i // v + 1 layers (the larger ones first). The embedding stays on stage 0
    and the head on stage p - 1. Needs n_i >= v on every stage (no empty chunk)."""
    sizes = [b - a for a, b in stages]
    assert all(n >= v for n in sizes), (sizes, v)
    parts = [[n // v + (1 if c < n % v else 0) for c in range(v)] for n in sizes]
    out, start = [], stages[0][0]
    for c in range(v):
        for part in parts:
            out.append((start, start + part[c]))
            start += part[c]
    return tuple(out)


def split_recompute_blocks(mem: StageMemory, chunks: Sequence[tuple[int, int]], num_layers: int) -> tuple[StageMemory, ...]:
    """One stage's memory options per chunk: the same options, except that full recomputation of
    the stage's first `recompute_blocks` blocks recomputes, in chunk c, the blocks of that count
    that fall in chunk c (the stage's blocks taken in layer order over its chunks)."""
    if mem.recompute_blocks is None or len(chunks) == 1:
        return (mem,) * len(chunks)
    out, left = [], mem.recompute_blocks
    for chunk in chunks:
        n = min(left, chunk_blocks(chunk, num_layers))
        out.append(mem.model_copy(update={"recompute_blocks": n}))
        left -= n
    return tuple(out)


def summarize_counts(values: list[int], limit: int = 6) -> str:
    """Per-pipeline counts for a one-line message: the list itself when short ("[4, 4, 5]"), else
    how many of each value ("[150 x 4, 50 x 5]", in file order of first use) or, with many distinct
    values, their count and range ("[200 values, 1..9, sum 1000]")."""
    if len(values) <= limit:
        return str(values)
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    if len(counts) <= 4:
        return "[" + ", ".join(f"{n} x {v}" for v, n in counts.items()) + "]"
    return f"[{len(values)} values, {min(values)}..{max(values)}, sum {sum(values)}]"
