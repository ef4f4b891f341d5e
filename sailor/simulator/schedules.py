"""Pipeline schedules as the simulator and the planner see them: the per-pass times of a pipeline,
its time under its schedule (event simulation or closed form), its timeline, and how many
micro-batches each stage holds at its memory peak.

`pipeline_schedule(plan)` is the one place the simulator reads `Plan.schedule`; everything else takes
the `PipelineSchedule` it returns, whose methods dispatch on the schedule in one table (`_MODELS`):
- `1f1b`: for jobs of Sailor's runtime (`Framework.SAILOR`, `pipeline_schedule(plan, framework)`),
  the runtime's order (`plan.orders.one_f_one_b_order`) simulated as the other orders are, with
  non-blocking sends, and DeepSpeed's closed form (`closed_form_1f1b`, the planner's fast path: it
  charges each transfer to both stages, so it is at least the event simulation's time on uniform
  stages, equal without transfers); for DeepSpeed and Megatron-LM jobs
  DeepSpeed's blocking transfers (`schedule.simulate_1f1b`, `closed_form_1f1b`), which the public
  Sailor runs used (`PipelineSchedule.blocking_1f1b`; `PipelineSchedule.runtime_difference` names
  it where a plan of the runtime is timed so);
- `interleaved-1f1b` and `zb-h1`: the orders of `plan.orders` (the ones the runtime executes),
  simulated with non-blocking sends
  (`schedule_orders.run_orders`), and the closed forms `closed_form_interleaved` / `closed_form_zb_h1`.

Planner hooks (no planner code reads a schedule yet): `PipelineSchedule.closed_form_s` (the fast
path), `PipelineSchedule.closed_form_affine` (its intercept and slope in m, valid from
`affine_from(p)`: m = 2 under 1F1B, what `planner.kinds.Curve` relies on, m = p under the
others), `PipelineSchedule.time_s` (the reference), `PipelineSchedule.in_flight` (memory; also
through `memory.replica_memory(..., schedule=...)`), `bubble_ratio`, `terms.pipeline_times` to build
a pipeline's pass times from a SimContext, and `plan.spec.interleave_partition` to turn a p-stage layer
partition into p·v chunks with the same layers per stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sailor.plan.orders import Op, ScheduleKind, stage_order
from sailor.model.spec import Framework
from sailor.plan.spec import Plan, Schedule
from sailor.simulator.schedule import check_pipeline_tasks, closed_form_1f1b, simulate_1f1b, timeline_1f1b
from sailor.simulator.schedule import in_flight as in_flight_1f1b
from sailor.simulator.schedule_orders import TimedOp, held_at_peak, run_orders
from sailor.simulator.traffic import Crossing, totals


@dataclass(frozen=True)
class PipelineTimes:
    """Seconds of one micro-batch's passes through one pipeline, per stage i and chunk c.

    Attributes:
        forward_s: array (p, v), forward of chunk c on stage i (the runtime's per-micro-batch
            overhead included once per chunk pass).
        backward_s: array (p, v), backward of chunk c on stage i; only its input-gradient part
            when the schedule splits the backward (zb-h1).
        weight_s: array (p, v), the weight-gradient part (zb-h1), else zeros.
        transfer_s: array (p·v - 1,), one message across virtual boundary u -> u + 1 (chunk u of the
            layer order to chunk u + 1: stage u mod p to stage (u + 1) mod p); the gradient comes
            back in the same time.
        crossings: the transfers of one micro-batch that cross zones (activation and gradient),
            in boundary order (`traffic.Crossing`).
    """

    forward_s: np.ndarray
    backward_s: np.ndarray
    weight_s: np.ndarray
    transfer_s: np.ndarray
    crossings: tuple[Crossing, ...] = ()

    @property
    def cross_zone_bytes(self) -> float:
        """Bytes crossing zones per micro-batch (activations and gradients)."""
        return totals(self.crossings)[0]

    @property
    def egress_usd(self) -> float:
        """Egress $ per micro-batch."""
        return totals(self.crossings)[1]

    @property
    def key(self) -> tuple:
        """Hashable summary of the times (for caching identical pipelines)."""
        return tuple(np.concatenate([self.forward_s.ravel(), self.backward_s.ravel(), self.weight_s.ravel(),
                                     self.transfer_s]).tolist())

    @property
    def busy_s(self) -> np.ndarray:
        """Array (p,): compute seconds of each stage per micro-batch, transfers excluded."""
        return (self.forward_s + self.backward_s + self.weight_s).sum(axis=1)

    @classmethod
    def uniform(cls, p: int, v: int, *, forward_s: float, backward_s: float, weight_s: float = 0.0,
                transfer_s: float = 0.0) -> "PipelineTimes":
        """Every stage and chunk alike: the case the closed forms are exact for (chunk passes of
        forward_s / v, ...; a stage's totals are forward_s, backward_s, weight_s)."""
        full = lambda x: np.full((p, v), x / v)  # noqa: E731
        return cls(full(forward_s), full(backward_s), full(weight_s), np.full(p * v - 1, float(transfer_s)))


@dataclass(frozen=True)
class InFlight:
    """Micro-batches one stage holds at its memory peak, per chunk (tuples of v counts).

    Attributes:
        held: forwarded, backward not yet run: activations and the received input are held.
        pending: input-gradient pass run, weight-gradient pass not yet (zb-h1): activations still
            held, plus the output gradients the W pass needs (`ModelSpec.weight_grad_pending_bytes`).
    """

    held: tuple[int, ...]
    pending: tuple[int, ...]

    @property
    def micro_batches(self) -> int:
        """Chunk activations held in all (held + pending), in chunk passes."""
        return sum(self.held) + sum(self.pending)


# ---- closed forms ---------------------------------------------------------------------------------
def closed_form_interleaved(t: PipelineTimes, m: int) -> float:
    """Closed-form time of interleaved 1F1B, with t_i the busy seconds of stage i per micro-batch
    (all its chunks, `busy_s`), s = argmax t_i, p stages, v chunks each:

        T = Σ_i t_i + (m - 1)·t_s - (1 - 1/v)·(min(m, p) - 1)·t_s + 2·Σ_u c_u

    On uniform pipelines without transfer time this is t·(m + (p - 1)/v) for m >= p: the bubble is
    (p - 1)/(v·m) of the ideal time m·t (Narayanan et al. SC'21 §2.2.2), and t·(p + (m - 1)/v) for
    m < p (one micro-batch's round trip, the others following a chunk apart). Equal to the event
    simulation (`run_orders` on `interleaved_order`) for every p, v, m and pass times on uniform
    stages with c = 0, and with transfers c <= the shortest chunk pass when m <= p or p divides m
    (the steady state hides them, the first micro-batch's round trip pays 2·(p·v - 1)·c); tested.
    Otherwise an estimate (the event simulation is the reference). v = 1 gives 1F1B without
    DeepSpeed's blocking transfers.
    """
    busy = t.busy_s
    p, v = t.forward_s.shape
    ts = float(busy.max())
    return float(busy.sum() + (m - 1) * ts - (1.0 - 1.0 / v) * (min(m, p) - 1) * ts + 2.0 * t.transfer_s.sum())


def closed_form_zb_h1(t: PipelineTimes, m: int) -> float:
    """Closed-form time of ZB-H1, with f_i, b_i, w_i the forward, input-gradient and weight-gradient
    seconds of stage i, s = argmax(f_i + b_i + w_i), F = Σ_{i≠s} f_i, B = Σ_{i≠s} b_i, C = Σ_i c_i
    and q = max(p - m, 0):

        T = m·(f_s + b_s + w_s) + max(B + q·f_s + 2C,  F + q·b_s + C,  F + B - (min(m, p) - 1)·w_s + 2C)

    On uniform pipelines with m >= p and no transfers the bubble is (p - 1)·max(b, f, f + b - w): the
    W passes fill the gaps of the backward chain, not those of the forward chain at the start, so it
    is Qi et al.'s (p - 1)(T_F + T_B - T_W) when T_W <= min(T_F, T_B) (a third of 1F1B's for equal
    passes). Equal to the event simulation (`run_orders` on `zb_h1_order`) for every p, m and pass
    times on uniform stages without transfer time; with transfers a lower bound on uniform stages (the
    terms are paths of the event simulation: the first micro-batch's trip down and back, 2C, behind the
    backward chain, one way behind the forward chain; 1F1B's warm-up leaves no slack to hide more of
    them in the steady state). Both tested.
    """
    f, b, w = (x[:, 0] for x in (t.forward_s, t.backward_s, t.weight_s))
    p = len(f)
    s = int(np.argmax(f + b + w))
    F, B, C = float(f.sum() - f[s]), float(b.sum() - b[s]), float(t.transfer_s.sum())
    q = max(p - m, 0)
    tail = max(B + q * f[s] + 2 * C, F + q * b[s] + C, F + B - (min(m, p) - 1) * w[s] + 2 * C)
    return float(m * (f[s] + b[s] + w[s]) + tail)


def _closed_1f1b(t: PipelineTimes, m: int) -> float:
    return closed_form_1f1b(t.forward_s[:, 0], t.backward_s[:, 0] + t.weight_s[:, 0], t.transfer_s, m)


def _event_1f1b(t: PipelineTimes, m: int) -> float:
    return simulate_1f1b(t.forward_s[:, 0], t.backward_s[:, 0] + t.weight_s[:, 0], t.transfer_s, m)[0]


def _timeline_1f1b(t: PipelineTimes, m: int) -> list[list[TimedOp]]:
    ops = timeline_1f1b(t.forward_s[:, 0], t.backward_s[:, 0] + t.weight_s[:, 0], t.transfer_s, m)
    return [[TimedOp(kind, 0, k, s, e) for kind, k, s, e in stage] for stage in ops]


@dataclass(frozen=True)
class _Model:
    """What the simulator needs of one schedule."""

    event: Callable[[PipelineTimes, int], float]
    closed: Callable[[PipelineTimes, int], float]
    timeline: Callable[[PipelineTimes, int], list[list[TimedOp]]]
    sends_block: bool  # DeepSpeed's 1F1B transfers: blocking send/receive pairs (`schedule`)


def _ordered_model(kind: ScheduleKind, closed: Callable[[PipelineTimes, int], float]) -> _Model:
    """A schedule given by its op orders (`plan.orders.stage_order`, timed by
    `schedule_orders.run_orders` with non-blocking sends) and its closed form."""
    def orders(t: PipelineTimes, m: int) -> list[list[Op]]:
        p, v = t.forward_s.shape
        check_pipeline_tasks(p, m, v)
        return [stage_order(kind, v, p, i, m) for i in range(p)]

    def event(t: PipelineTimes, m: int) -> float:
        return float(run_orders(orders(t, m), t.forward_s, t.backward_s, t.weight_s, t.transfer_s, m).max())

    def timeline(t: PipelineTimes, m: int) -> list[list[TimedOp]]:
        ops: list[list[TimedOp]] = [[] for _ in range(t.forward_s.shape[0])]
        run_orders(orders(t, m), t.forward_s, t.backward_s, t.weight_s, t.transfer_s, m, ops)
        return ops

    return _Model(event, closed, timeline, sends_block=False)


_BLOCKING_1F1B = _Model(_event_1f1b, _closed_1f1b, _timeline_1f1b, sends_block=True)
_MODELS: dict[ScheduleKind, _Model] = {
    # the runtime's 1F1B: its op order; the closed form stays DeepSpeed's (the planner's, `planner.kinds`)
    ScheduleKind.ONE_F_ONE_B: _ordered_model(ScheduleKind.ONE_F_ONE_B, _closed_1f1b),
    ScheduleKind.INTERLEAVED: _ordered_model(ScheduleKind.INTERLEAVED, closed_form_interleaved),
    ScheduleKind.ZB_H1: _ordered_model(ScheduleKind.ZB_H1, closed_form_zb_h1),
}


class PipelineSchedule(Schedule):
    """The plan's schedule (`plan.spec.Schedule`: kind, virtual stages, op orders) with what the
    simulator computes under it.

    Attributes:
        blocking_1f1b: 1F1B is timed with DeepSpeed's blocking send/receive pairs (True: DeepSpeed and
            Megatron-LM jobs, and the default) or as the runtime runs it (False: its op order with
            sends that never block, `Framework.SAILOR`); True on the other schedules, which it does
            not change.
    """

    blocking_1f1b: bool = True

    @property
    def _model(self) -> _Model:
        if self.kind is ScheduleKind.ONE_F_ONE_B and self.blocking_1f1b:
            return _BLOCKING_1F1B
        return _MODELS[self.kind]

    @property
    def sends_block(self) -> bool:
        """Whether the event simulation keeps a stage busy while it sends (`blocking_1f1b` 1F1B:
        DeepSpeed's blocking transfers); False for the op-order schedules, whose sends never block."""
        return self._model.sends_block

    @property
    def runtime_difference(self) -> str | None:
        """How the simulator's timing of this schedule differs from what the runtime runs, for the
        output; None where it times the runtime's own op order and transfer rule."""
        if not self.sends_block:
            return None
        return (f"{self.label} timed with DeepSpeed's blocking send/receive pairs (the job's framework); Sailor's runtime"
                " runs the same op order with non-blocking sends (sailor.plan.orders)")

    @property
    def label(self) -> str:
        """For people: "1F1B", "interleaved 1F1B (v = 2)", "ZB-H1"."""
        return {ScheduleKind.ONE_F_ONE_B: "1F1B", ScheduleKind.ZB_H1: "ZB-H1"}.get(
            self.kind, f"interleaved 1F1B (v = {self.virtual_stages})")

    def time_s(self, times: PipelineTimes, m: int, *, event: bool = True) -> float:
        """Seconds of one pipeline's m micro-batches (compute and p2p; no sync or optimizer): the
        event simulation, or the closed form (`closed_form_s`) when `event` is False."""
        model = self._model
        return model.event(times, m) if event else model.closed(times, m)

    def closed_form_s(self, times: PipelineTimes, m: int) -> float:
        """The closed form of this schedule (the planner's fast path; see each closed form for where
        it equals the event simulation)."""
        return self._model.closed(times, m)

    def affine_from(self, num_stages: int) -> int:
        """The smallest m from which `closed_form_s` is affine in m: 2 under 1F1B (one micro-batch
        pays the whole fill and drain), p otherwise (below p the warm-up is cut short: interleaving's
        min(m, p) and ZB-H1's max(p - m, 0) terms)."""
        return 2 if self.sends_block else max(num_stages, 1)

    def closed_form_affine(self, times: PipelineTimes) -> tuple[float, float, int]:
        """(intercept_s, slope_s, m0) with `closed_form_s(times, m)` = intercept_s + slope_s·m for
        every m >= m0 = `affine_from(p)`: what a planner needs to share a global batch out over
        pipelines of different speeds without evaluating the closed form per m (tested)."""
        m0 = self.affine_from(times.forward_s.shape[0])
        t0, t1 = self.closed_form_s(times, m0), self.closed_form_s(times, m0 + 1)
        return t0 - (t1 - t0) * m0, t1 - t0, m0

    def timeline(self, times: PipelineTimes, m: int) -> list[list[TimedOp]]:
        """Per-stage ops of the event simulation in execution order (same events and makespan as
        `time_s`); kinds F, B, W, and for 1F1B also the blocking transfers SA, RA, SG, RG."""
        return self._model.timeline(times, m)

    def in_flight(self, stage: int, num_stages: int, m: int, held_bytes: Sequence[float] | None = None,
                  pending_bytes: Sequence[float] | None = None) -> InFlight:
        """Micro-batches `stage` holds per chunk at its memory peak (`InFlight`).

        Args:
            held_bytes, pending_bytes: bytes per micro-batch of each chunk while held / the extra while
                pending (v values each; `schedule_orders.held_at_peak`); they decide which point of
                the order is the peak when chunks differ. Default: equal chunks, no pending bytes.
        1F1B: min(p - i, m) (DeepSpeed's warm-up). Interleaved: at most 2(p - i - 1) + (v - 1)·p + 1
        chunk passes, so stage 0 holds about (1 + 1/v)·p stage-activations, more than 1F1B's p
        (Narayanan et al. SC'21 §2.2.2). ZB-H1: min(p, m) on every stage (held + pending).
        """
        if self.sends_block:
            return InFlight((in_flight_1f1b(num_stages, stage, m),), (0,))
        v = self.virtual_stages
        held = np.ones(v) if held_bytes is None else np.asarray(held_bytes, dtype=float)
        pending = np.zeros(v) if pending_bytes is None else np.asarray(pending_bytes, dtype=float)
        return InFlight(*held_at_peak(self.order(stage, num_stages, m), held, pending))


ONE_F_ONE_B = PipelineSchedule()


def pipeline_schedule(plan: Plan, framework: Framework = Framework.SAILOR) -> PipelineSchedule:
    """The schedule of `plan` as a job of `framework` runs it (`PipelineSchedule.blocking_1f1b`):
    the one place the simulator reads `Plan.schedule`."""
    kind = plan.schedule.kind
    return PipelineSchedule(kind=kind, virtual_stages=plan.schedule.virtual_stages,
                            blocking_1f1b=kind is not ScheduleKind.ONE_F_ONE_B or framework is not Framework.SAILOR)


def bubble_ratio(schedule: PipelineSchedule, times: PipelineTimes, m: int, *, event: bool = True) -> float:
    """Idle time of the busiest stage over its ideal time: (T - m·max_i t_i) / (m·max_i t_i), with T
    the pipeline's time (`time_s`) and t_i the stage's busy seconds per micro-batch (`busy_s`).
    Uniform, no transfers: (p - 1)/m under 1F1B, (p - 1)/(v·m) interleaved (m >= p)."""
    ideal = m * float(times.busy_s.max())
    return (schedule.time_s(times, m, event=event) - ideal) / ideal
