"""Profiles: how long each layer takes on each GPU type, per TP degree and micro-batch size, and
the lookups the simulator asks for.

Sources, in order of preference for a (GPU type, TP degree):
1. measured: read from a file by `sailor.perf.profiles` (our format, written by `sailor profile`
   and by `Profiles.save`, or the public Sailor files);
2. scaled: a TP degree that was not measured on a GPU that was, estimated as the roofline at that TP
   times the measured/roofline ratio at the nearest measured TP (labelled estimated);
3. roofline: an analytic estimate from the catalog (labelled estimated).
Every estimate is recorded in `Profiles.estimates_used`, and every simulator output lists them.
Lookups interpolate linearly in micro-batch size between measured sizes and scale proportionally
outside them. A profile whose model, sequence length or precision differs from the job's is an error
(`Profiles.check_job`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sailor import catalog
from sailor.core.errors import SailorInputError
from sailor.core.fileio import write_json
from sailor.model.activations import layer_bytes
from sailor.model.spec import Recompute
from sailor.perf import roofline
from sailor.specs.job import JobSpec

SCHEMA = "sailor.profiles/1"  # of our format (`sailor.perf.profiles`), written by `Profiles.to_dict`

# Optimizer step traffic per parameter (bytes); memory-bound, so time = params x bytes / (HBM
# bandwidth x its memory efficiency). AdamW in fp32: read param, grad, m, v (16 B), write param, m,
# v (12 B) = 28 B. Mixed precision (Megatron-LM's optimizer on fp32 master weights): the same on the
# fp32 master weights and main gradients, plus writing the half-precision weights (2 B) = 30 B.
# SGD: read param and grad, write param (12 B; mixed: + 2 B for the half-precision copy).
OPTIMIZER_BYTES_PER_PARAM = {("adam", False): 28, ("adam", True): 30, ("sgd", False): 12, ("sgd", True): 14}


SPLIT_FROM_FLOPS = "backward split from FLOPs"  # the estimate `Profiles.backward_split` records


@dataclass
class Profiles:
    """Per-layer timings for one model at one sequence length and precision. "The file format" below
    is ours, read by `sailor.perf.profiles` (its module docstring) and written by `to_dict`.

    Attributes:
        model: canonical model name.
        sequence_length: tokens per sample the timings were taken at.
        precision: "fp32" | "bf16" | "fp16".
        times: (gpu, tp) -> {mbs: array (num_layers, 2)} of forward and backward seconds.
        optimizer_s_per_param: gpu -> measured optimizer-step seconds per parameter.
        activation_bytes: tp -> array (num_layers,) of measured activation bytes kept per sample.
        microbatch_overhead_s: (gpu, tp) -> measured runtime seconds per stage and micro-batch
            beyond the layers' passes (`runtime.microbatch_overhead_s` of the file format).
        pass_overhead_s: (gpu, tp) -> measured (forward, backward) seconds of the runtime's fixed
            cost of one stage pass (`runtime.pass_overhead_s` of the file format).
        p2p_overhead_s: (gpu, tp) -> measured seconds a run adds to each pipeline transfer
            (`runtime.p2p_overhead_s` of the file format).
        backward_split_s: (gpu, tp) -> {mbs: array (num_layers, 2)} of measured input-gradient and
            weight-gradient seconds (`backward_input_s`, `backward_weight_s` of the file format).
        source: where the data came from (for outputs).
        estimates_used: (gpu, tp, how) recorded each time an estimate stands in for a measurement.
    """

    model: str
    sequence_length: int
    precision: str
    times: dict[tuple[str, int], dict[int, np.ndarray]] = field(default_factory=dict)
    optimizer_s_per_param: dict[str, float] = field(default_factory=dict)
    activation_bytes: dict[int, np.ndarray] = field(default_factory=dict)
    microbatch_overhead_s: dict[tuple[str, int], float] = field(default_factory=dict)
    pass_overhead_s: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    p2p_overhead_s: dict[tuple[str, int], float] = field(default_factory=dict)
    backward_split_s: dict[tuple[str, int], dict[int, np.ndarray]] = field(default_factory=dict)
    source: str = "roofline"
    meta: dict[str, Any] = field(default_factory=dict)
    estimates_used: set[tuple[str, int, str]] = field(default_factory=set)

    # ---- checks ----------------------------------------------------------------------------
    def check_job(self, job: JobSpec, source: str | None = None) -> None:
        """Raise SailorInputError if these profiles were not taken for `job`'s model, sequence length
        and precision (a roofline-only Profiles fits any job)."""
        if not self.times:
            return
        if self.model != job.model.name:
            raise SailorInputError(f"profiles are for model {self.model!r}, the job trains {job.model.name!r}",
                                   source=source, field="model")
        if self.sequence_length != job.seq:
            raise SailorInputError(f"profiles were taken at sequence length {self.sequence_length}, the job uses {job.seq}",
                                   source=source, field="sequence_length")
        if self.precision != job.precision:
            raise SailorInputError(f"profiles were taken in {self.precision}, the job trains in {job.precision}",
                                   source=source, field="precision")
        for (gpu, _tp), by_mbs in self.times.items():
            for arr in by_mbs.values():
                if arr.shape[0] != job.model.num_layers:
                    raise SailorInputError(f"{gpu} profile has {arr.shape[0]} layers, {job.model.name} has"
                                           f" {job.model.num_layers}", source=source, field="layers")

    def measured(self, gpu: str, tp: int) -> bool:
        return (gpu, tp) in self.times

    # ---- lookups ---------------------------------------------------------------------------
    def layer_times(self, job: JobSpec, gpu: str, tp: int, mbs: int) -> np.ndarray:
        """Forward and backward seconds of every layer for one micro-batch of `mbs` samples on one
        replica of `tp` GPUs of type `gpu`: array (num_layers, 2). Estimates are recorded."""
        if (gpu, tp) in self.times:
            return _interpolate(self.times[(gpu, tp)], mbs)
        measured_tps = sorted(t for g, t in self.times if g == gpu)
        roof = roofline_times(job, gpu, tp, mbs)
        if not measured_tps:
            self.estimates_used.add((gpu, tp, "roofline"))
            return roof
        near = self.tp_source(gpu, tp)
        meas = _interpolate(self.times[(gpu, near)], mbs)
        roof_near = roofline_times(job, gpu, near, mbs)
        ratio = np.divide(meas, roof_near, out=np.ones_like(meas), where=roof_near > 0)
        self.estimates_used.add((gpu, tp, f"scaled from TP {near}"))
        return roof * ratio

    def split_measured(self, gpu: str, tp: int) -> bool:
        """Whether the backward's input/weight-gradient split was measured at (gpu, tp)."""
        return (gpu, tp) in self.backward_split_s

    def backward_split(self, job: JobSpec, gpu: str, tp: int, mbs: int, backward_s: np.ndarray) -> np.ndarray:
        """Input-gradient and weight-gradient seconds of every layer for one micro-batch: array
        (num_layers, 2). Measured at (gpu, tp) (interpolated in mbs like layer times; `backward_s` is
        not used), else `backward_s` (array (num_layers,), the backward seconds to split) cut by the
        FLOP fraction `ModelSpec.weight_grad_flop / backward_flop` per layer, recorded as an
        estimate; the embedding's backward is all weight gradient (its input is token ids)."""
        if self.split_measured(gpu, tp):
            return _interpolate(self.backward_split_s[(gpu, tp)], mbs)
        m = job.model
        frac = np.ones(m.num_layers)
        for i in range(1, m.num_layers):
            frac[i] = m.weight_grad_flop(i, tp=tp, mbs=mbs, seq=job.seq) / m.backward_flop(i, tp=tp, mbs=mbs, seq=job.seq)
        self.estimates_used.add((gpu, tp, SPLIT_FROM_FLOPS))
        weight = backward_s * frac
        return np.stack([backward_s - weight, weight], axis=1)

    def microbatch_overhead(self, gpu: str, tp: int) -> float:
        """Seconds per micro-batch a stage on a replica of `tp` GPUs of type `gpu` spends outside its
        layers' passes: measured at this TP, else at the nearest measured TP of the GPU type, else 0."""
        return _nearest_tp(self.microbatch_overhead_s, gpu, tp, 0.0)

    def pass_overhead(self, gpu: str, tp: int) -> tuple[float, float]:
        """(forward, backward) seconds the runtime spends per stage pass beyond the pass's layers, on a
        replica of `tp` GPUs of type `gpu` (`runtime.pass_overhead_s` of the file format): measured
        at this TP, else at the nearest measured TP of the GPU type, else (0, 0)."""
        return _nearest_tp(self.pass_overhead_s, gpu, tp, (0.0, 0.0))

    def p2p_overhead(self, gpu: str, tp: int) -> float:
        """Seconds a run adds to each pipeline transfer at a replica of `tp` GPUs of type `gpu`
        (`runtime.p2p_overhead_s` of the file format): measured at this TP, else at the nearest
        measured TP of the GPU type, else 0."""
        return _nearest_tp(self.p2p_overhead_s, gpu, tp, 0.0)

    def optimizer_time_s(self, job: JobSpec, gpu: str, params: float) -> float:
        """Seconds of one optimizer step over `params` parameters held by one GPU of type `gpu`:
        measured seconds/param if profiled, else memory-bound roofline over the achievable HBM
        bandwidth (`OPTIMIZER_BYTES_PER_PARAM`)."""
        if gpu in self.optimizer_s_per_param:
            return params * self.optimizer_s_per_param[gpu]
        spec = catalog.gpu(gpu)
        per = OPTIMIZER_BYTES_PER_PARAM[(job.optimizer.value, job.precision != "fp32")]
        return params * per / (spec.hbm_bytes_per_s * spec.efficiency.memory)

    def tp_source(self, gpu: str, tp: int) -> int | None:
        """The TP degree whose measurement gives the layer times of (`gpu`, `tp`): `tp` itself when
        measured, else the nearest measured TP degree of `gpu` (the one `layer_times` scales from);
        None when `gpu` was never measured (roofline)."""
        if (gpu, tp) in self.times:
            return tp
        tps = [t for g, t in self.times if g == gpu]
        return _nearest(tps, tp) if tps else None

    def includes_tp_comm(self, gpu: str, tp: int) -> bool:
        """True when the layer times of (`gpu`, `tp`) hold TP collectives: measured with `tp` real TP
        processes, or scaled from a measurement at another TP degree > 1 (whose all-reduces scale
        along). False for roofline estimates and for times scaled from TP 1, which ran no collective:
        the simulator charges those on the intra-node link (`simulator.terms.tp_comm_s`)."""
        src = self.tp_source(gpu, tp)
        return src is not None and src > 1

    def attention_core_share(self, job: JobSpec, gpu: str, tp: int, mbs: int) -> float:
        """Fraction of a block's forward time spent in the attention core (what selective
        recomputation re-runs), from the analytic model (`roofline.attention_core_share`); applied
        to measured times too, which do not split a block into its kernels."""
        return roofline.attention_core_share(job, gpu, tp, mbs)

    def activation_bytes_per_layer(self, job: JobSpec, tp: int, mbs: int, *, recompute: Recompute = Recompute.NONE,
                                   sequence_parallel: bool = False) -> np.ndarray:
        """Activation bytes kept for backward per layer for one micro-batch under a recompute mode
        and SP: measured (scaled linearly in mbs, and to the options by the model's ratio of their
        bytes to the plain layer's) when profiled at this TP, else the model's formula for the job's
        framework. Array (num_layers,)."""
        if tp in self.activation_bytes and recompute is Recompute.NONE and not sequence_parallel:
            return self.activation_bytes[tp] * mbs
        formula = self._formula(job, tp, mbs, recompute, sequence_parallel)
        if tp not in self.activation_bytes:
            return formula
        plain = self._formula(job, tp, mbs, Recompute.NONE, False)
        return self.activation_bytes[tp] * mbs * formula / plain


    @staticmethod
    def _formula(job: JobSpec, tp: int, mbs: int, recompute: Recompute, sp: bool) -> np.ndarray:
        m = job.model
        return np.array([layer_bytes(m, i, tp=tp, mbs=mbs, seq=job.seq, elem_bytes=job.elem_bytes,
                                     framework=job.framework, recompute=recompute, sequence_parallel=sp)
                         for i in range(m.num_layers)])

    # ---- save ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """These profiles in our file format (schema `SCHEMA`)."""
        layers = []
        for (gpu, tp), by_mbs in sorted(self.times.items()):
            for mbs, arr in sorted(by_mbs.items()):
                row = {"gpu": gpu, "tp": tp, "mbs": mbs, "forward_s": arr[:, 0].tolist(), "backward_s": arr[:, 1].tolist()}
                split = self.backward_split_s.get((gpu, tp), {}).get(mbs)
                if split is not None:
                    row |= {"backward_input_s": split[:, 0].tolist(), "backward_weight_s": split[:, 1].tolist()}
                layers.append(row)
        return {"schema": SCHEMA, "model": self.model, "sequence_length": self.sequence_length,
                "precision": self.precision, "source": self.source, **self.meta, "layers": layers,
                "optimizer": {g: {"seconds_per_param": v} for g, v in self.optimizer_s_per_param.items()},
                "memory": [{"tp": tp, "activation_bytes_per_sample": arr.tolist()}
                           for tp, arr in sorted(self.activation_bytes.items())],
                **({"runtime": self._runtime_dict()} if self.microbatch_overhead_s or self.pass_overhead_s
                   or self.p2p_overhead_s else {})}

    def _runtime_dict(self) -> dict[str, Any]:
        """The `runtime` section of our file format."""
        out: dict[str, Any] = {"microbatch_overhead_s": [{"gpu": g, "tp": t, "seconds": v}
                                                         for (g, t), v in sorted(self.microbatch_overhead_s.items())]}
        if self.pass_overhead_s:
            out["pass_overhead_s"] = [{"gpu": g, "tp": t, "forward_s": f, "backward_s": b}
                                      for (g, t), (f, b) in sorted(self.pass_overhead_s.items())]
        if self.p2p_overhead_s:
            out["p2p_overhead_s"] = [{"gpu": g, "tp": t, "seconds": v} for (g, t), v in sorted(self.p2p_overhead_s.items())]
        return out

    def save(self, path: str | Path) -> None:
        """Write our JSON format atomically."""
        write_json(path, self.to_dict())


def _interpolate(by_mbs: dict[int, np.ndarray], mbs: int) -> np.ndarray:
    """Linear interpolation in micro-batch size; proportional scaling outside the measured range."""
    if mbs in by_mbs:
        return by_mbs[mbs]
    sizes = sorted(by_mbs)
    if mbs < sizes[0]:
        return by_mbs[sizes[0]] * (mbs / sizes[0])
    if mbs > sizes[-1]:
        return by_mbs[sizes[-1]] * (mbs / sizes[-1])
    hi = next(s for s in sizes if s > mbs)
    lo = max(s for s in sizes if s < mbs)
    w = (mbs - lo) / (hi - lo)
    return by_mbs[lo] * (1 - w) + by_mbs[hi] * w


def roofline_times(job: JobSpec, gpu: str, tp: int, mbs: int) -> np.ndarray:
    """Analytic forward/backward seconds per layer (`sailor.perf.roofline.layer_times`: a roofline per
    operation with the catalog's efficiencies): array (num_layers, 2). An estimate, never a
    measurement; TP collectives are not in it (the simulator adds them)."""
    return roofline.layer_times(job, gpu, tp, mbs)


def roofline_profiles(job: JobSpec) -> Profiles:
    """Profiles with no measurements: every lookup is a (labelled) roofline estimate."""
    return Profiles(model=job.model.name, sequence_length=job.seq, precision=job.precision, source="roofline")


def _nearest_tp(table: dict[tuple[str, int], Any], gpu: str, tp: int, default: Any) -> Any:
    """`table[(gpu, tp)]`, else the entry of `gpu` at the nearest TP degree (`_nearest`), else
    `default`."""
    if (gpu, tp) in table:
        return table[(gpu, tp)]
    tps = [t for g, t in table if g == gpu]
    if not tps:
        return default
    return table[(gpu, _nearest(tps, tp))]


def _nearest(tps: list[int], tp: int) -> int:
    """The TP degree of `tps` nearest `tp` in log2, the lower on a tie."""
    return min(tps, key=lambda t: (abs(np.log2(t / tp)), t))
