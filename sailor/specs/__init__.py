"""Job and cluster specs: what to train (`job`), and which GPUs can be had where (`cluster`).
`load_job` / `load_cluster` here are the one loader of each, used by the CLI and the API alike."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sailor.core.errors import SailorInputError
from sailor.core.fileio import mapping_from
from sailor.core.schema import parse_model
from sailor.model.registry import is_builtin_model, is_config_path
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec, Optimizer


def load_job(source: str | Path | dict[str, Any] | JobSpec) -> JobSpec:
    """A validated job from a YAML/JSON path, a dict of the job file's fields, or a JobSpec (returned
    as is): the one job loader, used by the CLI, the API and the runtime.

    A `model:` naming a Hugging Face config (`model.registry.is_config_path`) is read relative to the
    job file's folder (a dict's relative path, relative to the current folder); so is a bare name
    (`model: tiny-hf`) that is no built-in model when a file or folder of that name is beside the job
    (a built-in name with a config of that name beside the job is refused as ambiguous).

    Raises:
        SailorInputError: unreadable file, unknown model, a misspelt or bad field (named with the file).
    """
    if isinstance(source, JobSpec):
        return source
    data, name = mapping_from(source, "JobSpec")
    return parse_model(JobSpec, model_relative_to(data, name), name)


def model_relative_to(job: Any, file: str | None) -> Any:
    """`job` (a job file's mapping) with a `model:` that names a Hugging Face config by a relative
    path read relative to the folder of `file`, the file the job was written in (a job file, or a
    plan file carrying its job); unchanged when `file` is None or the model is no such path."""
    model = job.get("model") if isinstance(job, dict) else None
    if file is None or not isinstance(model, str):
        return job
    # os.path.join keeps the "./" a Path would drop for a file in the current folder ("hf", a name)
    beside = os.path.join(str(Path(file).parent), str(Path(model).expanduser()))
    if is_config_path(model):
        return {**job, "model": beside}
    if model and os.path.lexists(beside):  # `model: tiny-hf` with a folder tiny-hf beside the job: a path
        holds_config = os.path.isfile(beside) or os.path.isfile(os.path.join(beside, "config.json"))
        if is_builtin_model(model) and not holds_config:
            return job  # `model: tiny` beside a checkpoint folder named tiny: the built-in
        if is_builtin_model(model):
            raise SailorInputError(f"{model!r} is both a built-in model and {beside} beside the job file",
                                   source=file, field="model",
                                   fix=f"write model: ./{model} for the folder, or rename it to use the built-in")
        return {**job, "model": beside}
    return job


def load_cluster(source: str | Path | dict[str, Any] | ClusterSpec, *, zones_from_trace: bool = False) -> ClusterSpec:
    """A validated cluster from a YAML/JSON path, a dict of the cluster file's fields, or a
    ClusterSpec (returned as is): the one cluster loader, used by the CLI and the API.

    A file's or dict's `zones` must offer only GPU types the catalog does not know to be missing
    there, or that `prices` prices there (`ClusterSpec.check_catalog_offers`), and its
    `zone_network` and per-zone prices must name what its `zones` offer
    (`ClusterSpec.check_offered`), unless `zones_from_trace`: `sailor run` and `replay` replace
    `zones` by an availability trace's and check them against the trace instead.

    Raises:
        SailorInputError: unreadable file, unknown GPU type or zone, a bad field, a GPU type a zone
            does not offer, a setting for a zone or GPU type the cluster does not offer (named
            with the file).
    """
    if isinstance(source, ClusterSpec):
        return source
    data, name = mapping_from(source, "ClusterSpec")
    spec = parse_model(ClusterSpec, data, name)
    if not zones_from_trace:
        for zone, g in ((z, g) for z, gpus in spec.zones.items() for g, n in gpus.items() if n > 0):
            try:
                spec.check_catalog_offers(zone, g)
            except SailorInputError as e:
                raise e.located(source=name, field_prefix=f"zones.{zone}.{g}") from None
        try:
            spec.check_offered()
        except SailorInputError as e:
            raise e.located(source=name) from None
    return spec


# Built-in example for `sailor plan` without --job/--cluster: OPT-350M with the paper's global batch
# on a realistic mix of what GCP us-central1 and us-west1 zones had free (A100-40 nodes of 8 and
# V100-16 nodes of 8, as on a2-highgpu-8g and n1 8-GPU machines), at the paper's prices.
EXAMPLE_JOB = JobSpec(model="opt-350m", global_batch_size=1024, precision="fp32", optimizer=Optimizer.ADAM)
EXAMPLE_CLUSTER = ClusterSpec(
    provider="gcp",
    zones={
        "us-central1-a": {"A100-40": 16, "V100-16": 32},
        "us-central1-b": {"A100-40": 8, "V100-16": 16},
        "us-central1-c": {"V100-16": 24},
        "us-central1-f": {"A100-40": 8},
        "us-west1-b": {"A100-40": 16, "V100-16": 16},
    },
)
