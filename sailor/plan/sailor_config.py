"""Import of the public Sailor `plan_config` format (see shared/reference/sailor/README.md).

```
{"mbs": 1, "gbs": 64, "pipeline_list": [
   {"num_stages": 2, "layers_per_stage": [[0, ..., 11], [12, ..., 25]], "dp": [2, 2],
    "tmp_per_stage": [[ [[["GH-96", 4, "us-central1-a"]], 4], ... one per replica ], ... one per stage]}],
 "real": ..., "max_mem": ..., ...}
```
Each `pipeline_list` entry with `dp` = D replicas per stage becomes D of our pipelines; every entry
must use the same layer partition. `tmp_per_stage[stage][replica] = [[[gpu, gpus_per_node, zone]], tp]`.
Other keys (measurements, `N`, `zone`) are not part of the plan and are left to their readers.

The batch: `gbs / mbs` micro-batches are spread over all pipelines as evenly as possible. The
published planner often picks a data-parallel degree that does not divide them (48 of its 85 top
plans on the paper's scenarios); the first pipelines then take one micro-batch more, and the import
says so with `sailor.core.errors.note` (one `warning:` line from the CLI).

Every value is checked: whole numbers are ints (`4.7` is not truncated, `true` is not 1), the layer
lists are contiguous, `num_stages` and `dp` agree with the lists, a replica's TP fits its node, and
one GPU type has one node size. Problems raise `SailorInputError` naming the file and field.
"""

from __future__ import annotations

from typing import Any

from sailor import catalog
from sailor.core.errors import SailorInputError, note
from sailor.core.limits import MAX_BLOCKS, MAX_GLOBAL_BATCH, MAX_GPUS_PER_NODE
from sailor.core.schema import Checks

MAX_LAYER = MAX_BLOCKS + 1  # the largest layer index (embedding 0, blocks, head)
REPLICA_FORM = "[[[gpu, gpus_per_node, zone]], tp]"


def is_sailor_plan(data: Any) -> bool:
    """Whether `data` (a parsed file) is in the Sailor plan_config format."""
    return isinstance(data, dict) and "pipeline_list" in data


def sailor_plan_to_dict(d: dict[str, Any], source: str | None = None) -> dict[str, Any]:
    """Our plan dict (`sailor.plan.Plan` fields) for a Sailor plan_config (module docstring).

    Raises:
        SailorInputError: a missing or malformed field, a batch that does not make whole
            micro-batches, fewer micro-batches than pipelines, different partitions or per-stage
            data-parallel degrees, a TP larger than its node, two node sizes for one GPU type.
    """
    plan, _, uneven = _parse(d, Checks(source))
    if uneven:
        note(uneven, source=source, field="gbs")
    return plan


def sailor_gpus_per_node(d: dict[str, Any], source: str | None = None) -> dict[str, int]:
    """GPUs per node per (canonical) GPU type as the plan_config gives them in `tmp_per_stage`.
    Raises SailorInputError as `sailor_plan_to_dict`."""
    _, sizes, _ = _parse(d, Checks(source))
    return sizes


def _parse(d: dict[str, Any], c: Checks) -> tuple[dict[str, Any], dict[str, int], str | None]:
    """(our plan dict, GPUs per node per GPU type, what to say about an uneven batch or None)."""
    c.mapping(d, "")
    for key in ("mbs", "gbs", "pipeline_list"):
        if key not in d:
            raise c.error("missing field", key, fix="a Sailor plan_config has mbs, gbs and pipeline_list")
    mbs = c.whole(d["mbs"], "mbs", lo=1, hi=MAX_GLOBAL_BATCH)
    gbs = c.whole(d["gbs"], "gbs", lo=1, hi=MAX_GLOBAL_BATCH)
    entries = c.sequence(d["pipeline_list"], "pipeline_list", "pipeline entries", min_len=1)
    stages: list[list[int]] | None = None
    pipelines: list[dict[str, Any]] = []
    sizes: dict[str, int] = {}
    for k, entry in enumerate(entries):
        ranges = _entry(entry, f"pipeline_list.{k}", c, pipelines, sizes)
        if stages is not None and ranges != stages:
            raise c.error("pipelines with different layer partitions are not supported", f"pipeline_list.{k}")
        stages = ranges
    if gbs % mbs:
        raise c.error(f"gbs {gbs} is not a multiple of mbs {mbs} (no whole number of micro-batches)", "gbs")
    total, n = gbs // mbs, len(pipelines)
    if total < n:
        raise c.error(f"gbs {gbs} / mbs {mbs} = {total} micro-batches cannot feed {n} pipelines", "gbs")
    per, extra = divmod(total, n)
    for j, p in enumerate(pipelines):
        p["microbatches"] = per + (1 if j < extra else 0)
    uneven = (f"gbs {gbs} / mbs {mbs} = {total} micro-batches do not split evenly over {n} pipelines: spread as"
              f" evenly as possible, {extra} x {per + 1} and {n - extra} x {per}") if extra else None
    return {"micro_batch_size": mbs, "stages": stages, "pipelines": pipelines}, sizes, uneven


def _entry(entry: Any, at: str, c: Checks, pipelines: list[dict[str, Any]], sizes: dict[str, int]) -> list[list[int]]:
    """Append the pipelines of one `pipeline_list` entry; returns its layer partition as ranges."""
    c.mapping(entry, at, "layers_per_stage, dp and tmp_per_stage")
    for key in ("layers_per_stage", "dp", "tmp_per_stage"):
        if key not in entry:
            raise c.error(f"missing field (an entry has layers_per_stage, dp and tmp_per_stage = {REPLICA_FORM}"
                          " per stage and replica)", f"{at}.{key}")
    layers = c.sequence(entry["layers_per_stage"], f"{at}.layers_per_stage", "layer lists", min_len=1,
                        max_len=MAX_LAYER + 1)
    ranges = []
    for s, ls in enumerate(layers):
        where = f"{at}.layers_per_stage.{s}"
        idx = [c.whole(x, f"{where}.{i}", hi=MAX_LAYER) for i, x in enumerate(c.sequence(ls, where, "layer indices",
                                                                                          min_len=1))]
        if sorted(idx) != list(range(min(idx), max(idx) + 1)):
            raise c.error("stage layers are not contiguous (each layer once, no gap)", where)
        ranges.append([min(idx), max(idx) + 1])
    P = len(layers)
    if "num_stages" in entry and c.whole(entry["num_stages"], f"{at}.num_stages", lo=1) != P:
        raise c.error(f"num_stages {entry['num_stages']} but layers_per_stage lists {P} stages", f"{at}.num_stages")
    dps = [c.whole(x, f"{at}.dp.{i}", lo=1, hi=MAX_GLOBAL_BATCH)
           for i, x in enumerate(c.sequence(entry["dp"], f"{at}.dp", "one degree per stage", min_len=P, max_len=P))]
    if len(set(dps)) != 1:
        raise c.error(f"stages with different data-parallel degrees {dps} are not supported", f"{at}.dp")
    per_stage = c.sequence(entry["tmp_per_stage"], f"{at}.tmp_per_stage", "one list of replicas per stage",
                           min_len=P, max_len=P)
    replicas = [c.sequence(reps, f"{at}.tmp_per_stage.{s}", f"{dps[0]} replicas ({REPLICA_FORM} each)",
                           min_len=dps[0], max_len=dps[0]) for s, reps in enumerate(per_stage)]
    for rep in range(dps[0]):
        pipelines.append({"replicas": [_replica(replicas[s][rep], s, f"{at}.tmp_per_stage.{s}.{rep}", c, sizes)
                                       for s in range(P)]})
    return ranges


def _replica(value: Any, stage: int, at: str, c: Checks, sizes: dict[str, int]) -> dict[str, Any]:
    """One `[[[gpu, gpus_per_node, zone]], tp]` as our replica dict; records the node size."""
    nodes, tp = c.sequence(value, at, REPLICA_FORM, min_len=2, max_len=2)
    (node,) = c.sequence(nodes, f"{at}.0", "one [gpu, gpus_per_node, zone]", min_len=1, max_len=1)
    gpu, per_node, zone = c.sequence(node, f"{at}.0.0", "[gpu, gpus_per_node, zone]", min_len=3, max_len=3)
    gpu = c.name(gpu, f"{at}.0.0.0", "a GPU type")
    per_node = c.whole(per_node, f"{at}.0.0.1", lo=1, hi=MAX_GPUS_PER_NODE)
    zone = c.name(zone, f"{at}.0.0.2", "a zone")
    tp = c.whole(tp, f"{at}.1", lo=1, hi=MAX_GPUS_PER_NODE)
    if tp > per_node:
        raise c.error(f"TP {tp} is larger than the replica's node of {per_node} GPUs; TP never crosses a node", f"{at}.1")
    if sizes.setdefault(_canonical(gpu), per_node) != per_node:
        raise c.error(f"{gpu} nodes of {per_node} GPUs here but of {sizes[_canonical(gpu)]} elsewhere in the plan",
                      f"{at}.0.0.1")
    return {"stage": stage, "gpu": gpu, "zone": zone, "tp": tp}


def _canonical(gpu: str) -> str:
    """The catalog name of `gpu`, or `gpu` itself when unknown (the plan's validation names it)."""
    try:
        return catalog.canonical_gpu(gpu)
    except SailorInputError:
        return gpu
