"""The simulation context: job, cluster, profiles, network and calibration, with per-call caches.

`SimContext` holds everything a simulation or planning call needs besides the plan, and caches
per-(GPU, TP, micro-batch, option) layer tables; its caches are keyed on every input and die with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from sailor import catalog
from sailor.model import activations
from sailor.model.spec import Framework, ModelSpec, Recompute
from sailor.perf.calibration import gpu_constant
from sailor.perf.network import NetworkModel
from sailor.perf.network_files import network_for
from sailor.perf.profile_lookup import Profiles, roofline_profiles
from sailor.simulator.collectives import Member
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec


def tied_embeddings(model: ModelSpec) -> bool:
    """True when the model's LM head reuses the input embedding's weights (`ModelSpec.tied_embeddings`;
    also Megatron-DeepSpeed's default, GPTModelPipe's TiedLayerSpec)."""
    return model.tied_embeddings


def embedding_params(model: ModelSpec, tp: int) -> int:
    """Parameters per GPU of the embedding module (word shard + position table), layer 0."""
    return model.params(0, tp)


def head_vocab_params(model: ModelSpec, tp: int) -> int:
    """Parameters per GPU of the LM-head matrix alone (the part a tied model shares), vocab / tp x h."""
    return model.padded_vocab(tp) * model.hidden_size // tp


class TiedCopies(str, Enum):
    """How the runs being modelled hold a tied embedding (`SimContext.tied`, from the job's framework).

    - `runtime`: Sailor's runtime (`sailor.runtime.tied`): the LM head keeps its own copy of the token
      embedding on every plan, a one-stage plan included, and each step the two copies' gradients
      are summed (`runtime.tied.twin_transfers`): only the token matrix crosses between stages.
    - `module`: DeepSpeed's pipeline engine (`TiedLayerSpec`, as Megatron-DeepSpeed's GPTModelPipe
      ties the embedding module; the public Sailor measurements ran it): a stage holding both ends
      keeps one copy; the last stage of a longer pipeline holds the whole embedding module (word and
      position tables), and `ReduceTiedGrads` all-reduces every parameter of it."""

    RUNTIME = "runtime"
    MODULE = "module"


@dataclass(frozen=True)
class ParamShare:
    """Which of a stage's parameters one GPU holds, as expert parallelism splits them: `dense`, the
    parameters every replica of the stage holds (all but the routed experts), and `experts`, the
    fraction of every MoE block's routed experts it holds (EP rank q: its experts / E)."""

    dense: bool = True
    experts: float = 1.0


ALL_PARAMS = ParamShare()
"""Every parameter of the stage (expert parallelism 1)."""


def held_layer_params(model: ModelSpec, layer: int, tp: int, share: ParamShare = ALL_PARAMS) -> float:
    """Parameters one GPU holds of layer `layer` at TP `tp` (`ModelSpec.params`), of its routed
    experts only the fraction `share.experts` (the dense ones always: what a replica holds)."""
    n = model.params(layer, tp)
    return n if share == ALL_PARAMS else n - (1.0 - share.experts) * model.routed_expert_params(layer, tp)


def stage_blocks(model: ModelSpec, a: int, e: int) -> tuple[int, int]:
    """(first block's layer index, number of blocks) of the stage holding layers [a, e)."""
    first, end = max(a, 1), min(e, model.num_blocks + 1)
    return first, max(end - first, 0)


@dataclass
class SimContext:
    """Everything a simulation needs besides the plan; caches live and die with this object.

    Attributes:
        job, cluster: the specs.
        profiles: layer timings (roofline estimates when None is given to `make_context`).
        network: links of the cluster.
        calibration: per-GPU-type constants fitted on measured runs (see simulator.calibration).
    """

    job: JobSpec
    cluster: ClusterSpec
    profiles: Profiles
    network: NetworkModel
    calibration: dict[str, dict[str, float]] = field(default_factory=dict)
    memory_margin: float = 0.0
    """Fraction of each GPU's memory kept free by `memory_limit` (the planner sets it from
    `PlanOptions.memory_margin`); simulating a plan reports out-of-memory at the full capacity."""
    _cum: dict[tuple[str, int, int], np.ndarray] = field(default_factory=dict, repr=False)
    _split: dict[tuple[str, int, int], np.ndarray] = field(default_factory=dict, repr=False)
    _act: dict[tuple, np.ndarray] = field(default_factory=dict, repr=False)
    _params: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _routed: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    memo: dict[tuple, Any] = field(default_factory=dict, repr=False)
    """Results of pure functions of this context (all-reduce times, pipeline constants), keyed on
    every argument: the planner asks for the same ones many times within one call."""

    def layer_cumsum(self, gpu: str, tp: int, mbs: int) -> np.ndarray:
        """Cumulative forward/backward seconds over layers: array (num_layers + 1, 2), row 0 = 0."""
        key = (gpu, tp, mbs)
        if key not in self._cum:
            t = self.profiles.layer_times(self.job, gpu, tp, mbs)
            if self.profiles.measured(gpu, tp):
                # A profiler times each layer alone between two device synchronisations, so every
                # timing carries a launch-and-sync gap that a real, asynchronous run hides.
                gap = gpu_constant(self.calibration, gpu, "profile_overhead_s", 0.0)
                t = np.maximum(t - gap, 0.0)
            self._cum[key] = np.vstack([np.zeros((1, 2)), np.cumsum(t, axis=0)])
        return self._cum[key]

    def layer_s(self, gpu: str, tp: int, mbs: int, a: int = 0, b: int | None = None) -> np.ndarray:
        """Per-layer (forward, backward) seconds of one micro-batch on layers [a, b) (default: all),
        as `layer_cumsum` counts them: array (b - a, 2)."""
        c = self.layer_cumsum(gpu, tp, mbs)
        return np.diff(c[a:(len(c) - 1 if b is None else b) + 1], axis=0)

    def stage_compute_s(self, gpu: str, tp: int, mbs: int, a: int, b: int) -> tuple[float, float]:
        """(forward_s, backward_s) of one micro-batch's pass over the chunk of layers [a, b) of one
        replica, without memory options: the layers' times, plus the runtime's measured fixed cost of
        a stage pass in each direction (`Profiles.pass_overhead`: the executor, the send and the
        transfers' threads beyond the layers, measured by `sailor profile` as an interleaved
        pipeline against a 1F1B one, `runtime.profile_passes`; 0 when not profiled), plus, on the
        forward, its per-micro-batch overhead (`Profiles.microbatch_overhead`: 1F1B bookkeeping
        outside the passes; 0 when not profiled). Each chunk pass pays both whatever its layers, so
        an interleaved stage of v chunks pays them v times per micro-batch."""
        c = self.layer_cumsum(gpu, tp, mbs)
        f, bw = c[b] - c[a]
        pf, pb = self.profiles.pass_overhead(gpu, tp)
        return float(f) + pf + self.profiles.microbatch_overhead(gpu, tp), float(bw) + pb

    def stage_backward_split_s(self, gpu: str, tp: int, mbs: int, a: int, b: int) -> tuple[float, float]:
        """(input_gradient_s, weight_gradient_s) of the layers' backward of one micro-batch on layers
        [a, b), the two passes a zero-bubble schedule runs apart: the profile's measured split less
        the profiler's per-pass gap (as `layer_cumsum`), else the layers' backward
        (`stage_compute_s`) split by the FLOP fraction (`Profiles.backward_split`, labelled
        estimated). The input-gradient pass, which sends the gradient as the whole backward does,
        also pays the fixed cost of a backward stage pass (`Profiles.pass_overhead`); the weight
        pass none (the profile takes the cost out of the input-gradient pass alone,
        `runtime.profiler.layer_row`)."""
        key = (gpu, tp, mbs)
        if key not in self._split:
            backward = self.layer_s(gpu, tp, mbs)[:, 1]
            split = self.profiles.backward_split(self.job, gpu, tp, mbs, backward)
            if self.profiles.split_measured(gpu, tp):
                split = np.maximum(split - gpu_constant(self.calibration, gpu, "profile_overhead_s", 0.0), 0.0)
            self._split[key] = np.vstack([np.zeros((1, 2)), np.cumsum(split, axis=0)])
        c = self._split[key]
        bi, bw = c[b] - c[a]
        return float(bi) + self.profiles.pass_overhead(gpu, tp)[1], float(bw)

    def tp_comm_included(self, gpu: str, tp: int) -> bool:
        """True when the layer times of (gpu, tp) already hold the TP collectives (measured with real
        TP processes, or scaled from such a measurement at TP > 1: `Profiles.includes_tp_comm`);
        False for roofline estimates and times scaled from TP 1, to which the simulator adds them
        (`terms.tp_comm_s`)."""
        return tp == 1 or self.profiles.includes_tp_comm(gpu, tp)

    def params_cumsum(self, tp: int) -> np.ndarray:
        """Cumulative parameters per GPU over layers at TP `tp`: array (num_layers + 1,)."""
        if tp not in self._params:
            m = self.job.model
            self._params[tp] = np.concatenate([[0], np.cumsum([m.params(i, tp) for i in range(m.num_layers)])])
        return self._params[tp]

    @property
    def tied(self) -> TiedCopies:
        """How the job's framework holds a tied embedding: `sailor` -> `runtime`; `megatron-lm` and
        `deepspeed` (the public Sailor runs, `simulator.fidelity`) -> `module`."""
        return TiedCopies.RUNTIME if self.job.framework is Framework.SAILOR else TiedCopies.MODULE

    def routed_cumsum(self, tp: int) -> np.ndarray:
        """Cumulative routed-expert parameters per GPU over layers at TP `tp`
        (`ModelSpec.routed_expert_params`): array (num_layers + 1,)."""
        if tp not in self._routed:
            m = self.job.model
            self._routed[tp] = np.concatenate([[0], np.cumsum([m.routed_expert_params(i, tp)
                                                               for i in range(m.num_layers)])])
        return self._routed[tp]

    def stage_params(self, tp: int, a: int, b: int, share: ParamShare = ALL_PARAMS) -> float:
        """Parameters per GPU of a replica holding layers [a, b) at TP `tp`: `ModelSpec.params` of
        each layer (the head with its LM-head matrix), with a tied embedding held as `tied` says
        (`TiedCopies`): `runtime` holds exactly the layers' parameters (the head's copy even on a
        stage that also holds the embedding: that stage's gradient buckets hold both,
        `runtime.buckets.build_buckets`); `module` counts the head's vocab matrix once on a stage
        holding both ends, and on a last stage without the embedding the whole embedding module
        (word and position tables) in place of the head's matrix. `share`: only the part of them
        one GPU holds under expert parallelism (`ParamShare`; default all)."""
        c = self.params_cumsum(tp)
        n = float(c[b] - c[a])
        m = self.job.model
        if tied_embeddings(m) and b == m.num_layers and self.tied is TiedCopies.MODULE:
            n -= head_vocab_params(m, tp)
            if a > 0:
                n += embedding_params(m, tp)
        if share == ALL_PARAMS:
            return n
        r = self.routed_cumsum(tp)
        routed = float(r[b] - r[a])
        return (n - routed) * share.dense + routed * share.experts

    def tied_copy_params(self, tp: int) -> int:
        """Parameters per GPU at TP `tp` of the tied copy whose gradient a pipeline's first and last
        stage exchange (`sync.tied_sync`), as `stage_params` holds it: the token embedding alone
        under `runtime` (`head_vocab_params`), the whole embedding module under `module`
        (`embedding_params`, the position table included)."""
        m = self.job.model
        return embedding_params(m, tp) if self.tied is TiedCopies.MODULE else head_vocab_params(m, tp)

    def act_cumsum(self, tp: int, mbs: int, recompute: Recompute = Recompute.NONE,
                   sequence_parallel: bool = False) -> np.ndarray:
        """Cumulative activation bytes kept per layer for one micro-batch under a recompute mode and
        SP (`Profiles.activation_bytes_per_layer`): array (num_layers + 1,), row 0 = 0."""
        key = (tp, mbs, recompute, sequence_parallel)
        if key not in self._act:
            a = self.profiles.activation_bytes_per_layer(self.job, tp, mbs, recompute=recompute,
                                                         sequence_parallel=sequence_parallel)
            self._act[key] = np.concatenate([[0.0], np.cumsum(a)])
        return self._act[key]

    def recompute_transient_bytes(self, layer: int, tp: int, mbs: int, recompute: Recompute,
                                  sequence_parallel: bool) -> float:
        """Bytes one recomputed block `layer` rebuilds during its backward, for one micro-batch at TP
        `tp` (`model.activations.recompute_transient_bytes`), scaled like the kept activations
        (`Profiles.activation_bytes_per_layer`) when they were measured at this TP; cached."""
        key = ("transient", layer, tp, mbs, recompute, sequence_parallel)
        if key not in self.memo:
            job = self.job
            kw = dict(tp=tp, mbs=mbs, seq=job.seq, elem_bytes=job.elem_bytes, framework=job.framework)
            transient = activations.recompute_transient_bytes(job.model, layer, **kw, recompute=recompute,
                                                              sequence_parallel=sequence_parallel)
            measured = self.profiles.activation_bytes.get(tp)
            if measured is not None:
                transient = float(measured[layer] * mbs * transient / activations.layer_bytes(job.model, layer, **kw))
            self.memo[key] = transient
        return self.memo[key]

    def boundary_bytes(self, layer_end: int, mbs: int) -> float:
        """Bytes of the activation leaving layer `layer_end - 1` (one micro-batch, full tensor)."""
        return self.job.model.output_bytes(layer_end - 1, mbs=mbs, seq=self.job.seq, elem_bytes=self.job.elem_bytes)

    def framework_bytes(self, gpu: str) -> float:
        """Memory per GPU beyond tensors (bytes): calibrated, else the catalog default."""
        return gpu_constant(self.calibration, gpu, "framework_bytes", catalog.gpu(gpu).framework_bytes)

    def framework_calibrated(self, gpu: str) -> bool:
        """Whether `framework_bytes(gpu)` was measured (it then holds the NCCL buffers too)."""
        return "framework_bytes" in self.calibration.get(gpu, {})

    def allreduce_efficiency(self, members: list[Member]) -> float:
        """Fraction of the p2p link bandwidth a gradient all-reduce reaches among `members`
        (calibrated per GPU type, 1 by default; the lowest member's value; see calibration.py)."""
        return min(gpu_constant(self.calibration, g, "allreduce_efficiency", 1.0) for g in {mb.gpu for mb in members})

    def p2p_overhead_s(self, a: tuple[str, int], b: tuple[str, int]) -> float:
        """Fixed seconds a pipeline transfer between replicas a and b ((GPU type, TP) each) pays on top
        of its bytes: per end, the calibrated constant (`perf.calibration`, fitted to the public
        DeepSpeed runs; 0 by default) plus what a run of the runtime adds to a transfer, as
        `sailor profile` measured it (`Profiles.p2p_overhead`; 0 when not profiled); the larger of
        the two ends."""
        return max(gpu_constant(self.calibration, g, "p2p_overhead_s", 0.0) + self.profiles.p2p_overhead(g, tp)
                   for g, tp in (a, b))

    def memory_capacity(self, gpu: str) -> int:
        return catalog.gpu(gpu).memory_bytes

    def memory_limit(self, gpu: str) -> float:
        """Bytes a plan may fill on one GPU of type `gpu`: capacity x (1 - memory_margin)."""
        return self.memory_capacity(gpu) * (1.0 - self.memory_margin)


def make_context(job: JobSpec, cluster: ClusterSpec, profiles: Profiles | None = None,
                 network: NetworkModel | None = None,
                 calibration: dict[str, dict[str, float]] | None = None) -> SimContext:
    """A SimContext with roofline profiles and default links where none are given."""
    from sailor.perf.calibration import default_calibration
    return SimContext(job=job, cluster=cluster, profiles=profiles or roofline_profiles(job),
                      network=network or network_for(cluster),
                      calibration=default_calibration() if calibration is None else calibration)
