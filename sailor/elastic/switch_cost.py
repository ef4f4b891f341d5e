"""The cost of a live switch (`sailor run`'s default, `--in-place`) from the
bytes it moves and the links they cross, for the switch rule before a switch was measured
(`controller`) and for `sailor replay`.

A live switch (`runtime.inplace`) stops at a step boundary, writes a checkpoint there (every rank
its owned state, in parallel) when periodic checkpoints are off or some piece has no living holder
(the W term below, left out with `writes_checkpoint` False), forms the move group, sends every new
rank the pieces of fp32 weights and Adam moments it needs from the ranks that hold them
(`runtime.reshard`, point to point, all pairs at once), and builds the stages. Its seconds, planning
excluded:

    C_live = fixed_s + [writes_checkpoint] max_r W_r / storage_bytes_per_s + max_q T(link_q, R_q)

- W_r: state bytes old rank r writes: 12 bytes per parameter of its stage at its TP degree (fp32
  weights and two Adam moments, `STATE_BYTES_PER_PARAM`) that it owns: all of them under ZeRO-0
  (written by the replica of pipeline 0 alone), 1/D of them under ZeRO-1/2/3 (D pipelines).
- R_q: state bytes new rank q holds under the new plan (the fp32 weights of its stage's TP shard
  whole under ZeRO-0/1/2, 1/D of them under ZeRO-3; the moments whole under ZeRO-0, 1/D under
  ZeRO-1/2/3), taken as all received, from a rank of the old plan in q's zone when the old plan has
  one there, else from the old plan's first replica: an upper bound (a surviving rank keeps what it
  already holds, and receivers share no sender link in this model).
- T(link, n): `perf.network.NetworkModel.transfer_time_s` of n bytes between the two GPUs' nodes.
- fixed_s: forming the move group, building the stages and the new plan's process groups. The
  default, 1 s, is what `benchmarks/reconfigure.py` measured for the rendezvous and move phases
  together on this machine with the tiny model, whose few MB of state make them fixed cost (0.81 s
  for the shrink and 1.05 s for the grow at a load of 6 on 2 cores, 1.22 and 1.40 s at 15.8; README,
  "Elastic"). storage_bytes_per_s: one rank's checkpoint
  write; the default, 1 GB/s, is an assumption (a local NVMe disk writes about 2 GB/s, shared storage
  less), not a measurement.

`LiveSwitchModel.for_run` sets `writes_checkpoint` as `sailor run` does (True only with
--checkpoint-every 0: every old rank is alive at a switch, so the living ranks hold every piece); the
controller and `sailor replay --switch live` (which takes the same --checkpoint-every, with the same
default) both build the model with it.

The restart path's cost model is `replay.RestartModel` (published breakdown, plan-independent).
"""

from __future__ import annotations

from dataclasses import dataclass

from sailor.plan.spec import Plan
from sailor.simulator.context import SimContext

STATE_BYTES_PER_PARAM = 12  # fp32 weights + Adam's two moments: what the move and the checkpoint carry


@dataclass(frozen=True)
class LiveSwitchModel:
    """The constants of C_live (module docstring). Seconds, bytes per second."""

    fixed_s: float = 1.0
    storage_bytes_per_s: float = 1e9
    writes_checkpoint: bool = True

    @classmethod
    def for_run(cls, checkpoint_every: int) -> "LiveSwitchModel":
        """The model of a `sailor run` checkpointing every `checkpoint_every` steps: a live switch
        writes a checkpoint only when periodic ones are off (0), as `runtime.inplace` decides."""
        return cls(writes_checkpoint=checkpoint_every == 0)

    def seconds(self, ctx: SimContext, old: Plan, new: Plan) -> float:
        """C_live of switching from `old` to `new` on the cluster and network of `ctx`."""
        write = max(_owned_bytes(ctx, old, i, r.tp) for p in old.pipelines for r in p.replicas for i in (r.stage,))
        src = {r.zone: r for p in old.pipelines for r in p.replicas}
        first = old.pipelines[0].replicas[0]
        move = max(ctx.network.transfer_time_s((s := src.get(r.zone, first)).zone, s.gpu, r.zone, r.gpu,
                                               _held_bytes(ctx, new, i, r.tp))
                   for p in new.pipelines for r in p.replicas for i in (r.stage,))
        return self.fixed_s + (write / self.storage_bytes_per_s if self.writes_checkpoint else 0.0) + move


def _params(ctx: SimContext, plan: Plan, stage: int, tp: int) -> float:
    """Parameters one rank of pipeline stage `stage` at TP `tp` holds: all of its chunks' layers
    (`Plan.stage_chunks`; several under interleaving)."""
    return sum(ctx.stage_params(tp, a, b) for a, b in plan.stage_chunks(stage))


def _owned_bytes(ctx: SimContext, plan: Plan, stage: int, tp: int) -> float:
    """Checkpoint bytes one rank of `stage` at TP `tp` writes (W_r)."""
    zero, d = plan.stage_memory(stage).zero, len(plan.pipelines)
    return STATE_BYTES_PER_PARAM * _params(ctx, plan, stage, tp) / (d if zero else 1)


def _held_bytes(ctx: SimContext, plan: Plan, stage: int, tp: int) -> float:
    """State bytes one rank of `stage` at TP `tp` holds (R_q)."""
    zero, d = plan.stage_memory(stage).zero, len(plan.pipelines)
    n = _params(ctx, plan, stage, tp)
    return 4 * n / (d if zero >= 3 else 1) + 8 * n / (d if zero else 1)
