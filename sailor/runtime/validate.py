"""Checks a plan must pass before the runtime starts any process (torch-free)."""

from __future__ import annotations

from sailor.core.errors import SailorInputError, counted
from sailor.plan.spec import Plan
from sailor.runtime.schedule import runtime_schedule
from sailor.runtime.topology import stage_memory
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec


def check_runtime_geometry(plan: Plan, job: JobSpec, *, source: str | None = None) -> None:
    """Raise SailorInputError unless every replica's TP degree splits the tensors the runtime shards:
    attention and KV heads (whole heads per rank), the MLP width and the padded vocabulary
    (`ModelSpec.padded_vocab(1)`, the runtime's one vocabulary). Layers, global batch and heads are
    checked by `Plan.check_against`; this adds what sharding needs beyond it."""
    model = job.model
    vocab = model.padded_vocab(1)
    for j, p in enumerate(plan.pipelines):
        for i, r in enumerate(p.replicas):
            for what, size in ((("attention heads", model.num_heads), ("KV heads", model.kv_heads),
                                ("MLP width", model.ffn), ("padded vocabulary", vocab)) + _expert_widths(model)):
                if size % r.tp:
                    raise SailorInputError(f"TP {r.tp} does not divide the {size} {what} of {model.name}",
                                           source=source, field=f"pipelines.{j}.replicas.{i}.tp",
                                           fix="use a TP degree that divides it")


def _expert_widths(model) -> tuple[tuple[str, int], ...]:
    """The widths TP splits in an MoE model's experts (`runtime.moe`): each expert's and the shared
    experts' SwiGLU."""
    if model.moe is None:
        return ()
    shared = ((("shared experts' width", model.moe.shared_width),) if model.moe.shared_experts else ())
    return (("expert width", model.moe.expert_ffn_size),) + shared


def check_moe(job: JobSpec, *, source: str | None = None, job_source: str | None = None) -> None:
    """Raise SailorInputError for a mixture-of-experts job the distributed runtime cannot train yet:
    a capacity factor (the runtime routes dropless, as transformers does). Sequence parallelism on a
    stage holding an MoE block is `Plan.check_against`'s refusal (the simulator's too). A
    load-balancing loss (`moe.aux_loss_coef` > 0) is applied under every plan, per micro-batch
    (`runtime.balance`)."""
    moe = job.model.moe
    if moe is None:
        return
    where = job_source or source
    if moe.capacity_factor is not None:
        raise SailorInputError(f"capacity factor {moe.capacity_factor}: the runtime routes every token to its top_k"
                               " experts (dropless)", source=where, field="model.moe.capacity_factor",
                               fix="remove it (null: dropless)")


def check_runtime_options(plan: Plan, job: JobSpec, *, source: str | None = None,
                          job_source: str | None = None) -> None:
    """Raise SailorInputError for a memory option (`plan.memory`) or precision the runtime cannot
    execute, naming the plan field:
    - sequence parallelism needs a transformer block in the stage (it is applied to blocks; the
      sequence length divisible by every replica's TP degree is `Plan.check_against`'s rule);
    - recomputation (selective or full) needs a transformer block in the stage (in any of its
      chunks under interleaving);
    - ZeRO-3 under a schedule that splits the backward (zb-h1): the deferred weight-gradient pass of
      a layer would run after later micro-batches' forwards freed the layer's gathered weights
      (full recomputation, which drops what that pass needs, is refused by the plan itself).
    Every precision is accepted here (fp16 trains with dynamic loss scaling, `runtime.scaler`); the
    device's support for it is checked where the worker picks its GPU (`check_device_precision`).
    `job_source` is the job file when the job is not the plan's own."""
    model = job.model
    schedule = runtime_schedule(plan)
    for i in range(plan.num_stages):
        mem = stage_memory(plan, i)
        has_block = any(model.layer_kind(layer).value == "block" for a, b in plan.stage_chunks(i) for layer in range(a, b))
        for option, used in (("sequence_parallel", mem.sequence_parallel),
                             ("recompute", mem.recompute.value != "none")):
            if used and not has_block:
                raise SailorInputError(f"stage {i} {plan.stage_layers_text(i)} holds no transformer block, so {option}"
                                       " has nothing to apply to", source=source, field=f"memory.{i}.{option}",
                                       fix="leave it at its default for this stage")
        if schedule.splits_backward and mem.zero >= 3:
            raise SailorInputError(f"{schedule.kind.value} defers weight-gradient passes, which the runtime cannot"
                                   f" run under ZeRO-3 (stage {i}: its layer weights are freed between the passes)",
                                   source=source, field=f"memory.{i}.zero", fix="use ZeRO-2 or less, or schedule 1f1b")


def check_plan_for_job(plan: Plan, job: JobSpec | None, cluster: ClusterSpec | None, *, source: str | None,
                       job_source: str | None = None, world_size: int | None = None) -> JobSpec:
    """The one check `sailor train`, `sailor launch` and every worker run before anything trains:
    a job is known, the plan fits it and its cluster (`Plan.check_against`: layers covered, batch
    arithmetic, TP dividing the heads and within a node, memory options and expert parallelism
    against the model, GPU counts), the runtime can shard it (`check_runtime_geometry`) and execute
    its memory options and precision (`check_runtime_options`; `job_source` is the job file when the
    job is not the plan's own) and its MoE routing (`check_moe`), and, for a worker, torchrun started
    as many ranks as the plan has.

    Returns:
        the job (for the caller's convenience).
    Raises:
        SailorInputError: naming `source` (the plan file) and the field.
    """
    if job is None:
        raise SailorInputError("the plan carries no job", source=source, fix="pass --job JOB, or write the plan with"
                               " `sailor plan --out`, which includes its job")
    try:
        plan.check_against(job, cluster)
    except SailorInputError as e:
        raise e.located(source=source) from None
    check_runtime_geometry(plan, job, source=source)
    check_runtime_options(plan, job, source=source, job_source=job_source)
    check_moe(job, source=source, job_source=job_source)
    if world_size is not None and world_size != plan.world_size:
        raise SailorInputError(f"torchrun started {counted(world_size, 'rank')} but the plan has {plan.world_size}",
                               source=source, fix="start one process per GPU of the plan (sailor launch does)")
    return job


AMPERE = (8, 0)  # first compute capability with bf16 tensor cores (NVIDIA A100 whitepaper, "BF16")


def check_device_precision(precision: str, capability: tuple[int, int], *, device_name: str = "the GPU") -> None:
    """Raise SailorInputError when the job's `precision` cannot train well on a CUDA device of compute
    `capability` (`torch.cuda.get_device_capability`): bf16 before Ampere (8.0: V100 7.0, T4 7.5)
    has no bf16 tensor cores, so its GEMMs are emulated and SDPA falls back to the math kernel
    (materialised T x T scores). fp16 (with loss scaling) and fp32 run everywhere."""
    if precision == "bf16" and tuple(capability) < AMPERE:
        raise SailorInputError(f"{device_name} (compute capability {capability[0]}.{capability[1]}) has no bf16"
                               " tensor cores (they start at 8.0, Ampere)", field="precision",
                               fix="use precision fp16 (trained with dynamic loss scaling) on this GPU")
