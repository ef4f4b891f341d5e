"""Profile files: our format read into `Profiles` (`sailor.perf.profile_lookup`, which holds the
lookups and writes our format), and the public Sailor files imported into it.

`load_profiles` detects the format: our JSON file (parsed by `profiles_from_dict`) or the public
Sailor files (`profiles_tmp.json` + `llm_info.json`, imported by `load_sailor_profiles`).

Our file format (JSON, schema "sailor.profiles/1"):
  {"schema", "model", "sequence_length", "precision", "source", "device", "versions", "date",
   "layers": [{"gpu", "tp", "mbs", "forward_s": [per layer], "backward_s": [per layer],
               "forward_spread_s"?: [...], "backward_spread_s"?: [...],
               "backward_input_s"?: [per layer], "backward_weight_s"?: [per layer]}],
   "optimizer": {gpu: {"seconds_per_param": float}},
   "memory": [{"gpu"?, "tp", "activation_bytes_per_sample": [per layer], "peak_bytes"?: ...}],
   "runtime"?: {"microbatch_overhead_s": [{"gpu", "tp", "seconds"}],
                "pass_overhead_s"?: [{"gpu", "tp", "forward_s", "backward_s"}],
                "p2p_overhead_s"?: [{"gpu", "tp", "seconds"}]}}
`runtime.microbatch_overhead_s` (optional): seconds a training stage spends per micro-batch outside
its layers' forward and backward passes (the runtime's 1F1B bookkeeping, input slicing, saving
micro-batch state), measured by `sailor profile` on the runtime's own `run_pipeline`; the simulator
adds it to every stage's micro-batch. Absent: 0. A TP degree without a row uses the nearest
measured TP degree of its GPU type (the same rule as layer times).
`runtime.pass_overhead_s` (optional): the runtime's fixed seconds per stage pass beyond its layers,
forward and backward (`sailor.runtime.profile_passes`: an interleaved 2-stage pipeline against a
1F1B one over the same layers); the simulator charges them once per chunk pass and direction, and
the layer times hold none of them. Absent (files written before it was measured): 0 s, the layer
times then holding their share of the whole pass's fixed cost as before. Nearest TP as above.
`runtime.p2p_overhead_s` (optional): seconds a run adds to every pipeline transfer sent or received by
a replica of the class beyond the same transfer between idle ranks (`sailor.runtime.profile_passes`:
the mean latency of a message to a waiting receiver in a 2-stage run less that of one between idle
ranks); the simulator adds it to each pipeline transfer, the larger of its two ends'. Absent: 0.
Nearest TP as above.
`backward_input_s` / `backward_weight_s` (optional, both or neither): the backward split into the
input-gradient pass and the weight-gradient pass that zero-bubble schedules run apart, measured by
`sailor profile` (each pass timed on its own). Absent (older files, the Sailor importer, the
roofline), `Profiles.backward_split` estimates the split from the FLOPs
(`ModelSpec.weight_grad_flop`) and labels it estimated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sailor import catalog
from sailor.core.errors import SailorInputError, show
from sailor.core.fileio import load_json
from sailor.core.limits import (
    MAX_BYTES,
    MAX_GLOBAL_BATCH,
    MAX_GPUS_PER_NODE,
    MAX_SECONDS,
    MAX_SEQUENCE_LENGTH,
)
from sailor.core.schema import Checks
from sailor.model.registry import canonical_model_name, get_model
from sailor.perf.profile_lookup import SCHEMA, Profiles
from sailor.specs.job import JobSpec

PRECISIONS = ("fp32", "bf16", "fp16")
# The keys of our format (module docstring); any other is refused rather than ignored.
TOP_KEYS = ("schema", "model", "sequence_length", "precision", "source", "device", "versions", "date", "settings",
            "layers", "optimizer", "memory", "runtime")
LAYER_KEYS = ("gpu", "tp", "mbs", "forward_s", "backward_s", "forward_spread_s", "backward_spread_s", "backward_input_s",
              "backward_weight_s")
MEMORY_KEYS = ("gpu", "tp", "activation_bytes_per_sample", "peak_bytes")


# ---- loading -------------------------------------------------------------------------------------
def load_profiles(path: str | Path, job: JobSpec) -> Profiles:
    """Load profiles for `job` from our JSON file, or from a folder holding the Sailor files
    `profiles_tmp.json` and `llm_info.json` (format detected). Raises SailorInputError naming the file
    and what is missing or malformed."""
    p = Path(path)
    if p.is_dir():
        if not (p / "profiles_tmp.json").exists():
            raise SailorInputError("folder holds no profiles_tmp.json (Sailor format)", source=str(p))
        prof = load_sailor_profiles(p / "profiles_tmp.json", p / "llm_info.json", job)
        src = str(p / "profiles_tmp.json")
    else:
        data = load_json(p)
        if isinstance(data, dict) and data.get("schema") == SCHEMA:
            prof = profiles_from_dict(data, str(p))
        elif isinstance(data, dict) and "schema" in data:  # our format, a version this Sailor does not read
            raise SailorInputError(f"unknown schema {show(data['schema'])} (this Sailor reads {SCHEMA!r})",
                                   source=str(p), field="schema",
                                   fix="measure again with `sailor profile`, or set the schema this file follows")
        elif isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()) and "layers" not in data:
            prof = load_sailor_profiles(p, p.parent / "llm_info.json", job)
        else:
            raise SailorInputError(f"not a profile file (expected schema {SCHEMA!r} or the Sailor profiles_tmp.json form)",
                                   source=str(p), field="schema")
        src = str(p)
    prof.check_job(job, src)
    return prof




def profiles_from_dict(d: dict[str, Any], source: str = "<profiles>") -> Profiles:
    """Parse our profile format (module docstring); raises SailorInputError naming the field.
    A built-in model's name (or alias) is made canonical; any other name is an inline architecture's,
    kept as written (`check_job` compares it with the job's model).

    Times are finite seconds in [0, limits.MAX_SECONDS], sizes finite bytes in [0, limits.MAX_BYTES],
    TP degrees and micro-batch sizes whole numbers; a (GPU type, TP, micro-batch size) row or a TP
    degree's memory row given twice is an error (one would silently replace the other).
    """
    c = Checks(source)
    c.known_keys(c.mapping(d, ""), "", TOP_KEYS)
    for key in ("model", "sequence_length", "precision", "layers"):
        if key not in d:
            raise c.error("missing field", key)
    name = c.name(d["model"], "model", "a model name")
    model = canonical_model_name(name) if _known_model(name) else name
    seq = c.whole(d["sequence_length"], "sequence_length", lo=1, hi=MAX_SEQUENCE_LENGTH)
    precision = d["precision"]
    if precision not in PRECISIONS:
        raise c.error(f"expected one of {', '.join(PRECISIONS)}, got {show(precision)}", "precision")
    prof = Profiles(model=model, sequence_length=seq, precision=precision, source=str(d.get("source", "measured")),
                    meta={k: d[k] for k in ("device", "versions", "date") if k in d})
    n_layers = None  # rows must agree with each other (`check_job` compares them with the job's model)
    for k, row in enumerate(c.sequence(d["layers"], "layers", "rows {gpu, tp, mbs, forward_s, backward_s}")):
        where = f"layers.{k}"
        c.known_keys(c.mapping(row, where, "gpu, tp, mbs, forward_s, backward_s"), where, LAYER_KEYS)
        for key in ("gpu", "tp", "mbs", "forward_s", "backward_s"):
            if key not in row:
                raise c.error("missing field", f"{where}.{key}")
        gpu = _located(lambda: catalog.canonical_gpu(row["gpu"]), c, f"{where}.gpu")
        tp, mbs = _tp(row["tp"], c, f"{where}.tp"), c.whole(row["mbs"], f"{where}.mbs", lo=1, hi=MAX_GLOBAL_BATCH)
        fwd = _values(row["forward_s"], n_layers, f"{where}.forward_s", c, MAX_SECONDS)
        bwd = _values(row["backward_s"], n_layers, f"{where}.backward_s", c, MAX_SECONDS)
        if len(fwd) != len(bwd):  # the first row: a built-in model tells which list is wrong, else name both
            _blame_count(fwd, bwd, get_model(model).num_layers if _known_model(name) else None, where, c)
        n_layers = len(fwd)
        _check_timed(fwd, bwd, where, c)
        for key in ("forward_spread_s", "backward_spread_s"):
            if key in row:
                _values(row[key], n_layers, f"{where}.{key}", c, MAX_SECONDS)
        if mbs in prof.times.get((gpu, tp), {}):
            raise c.error(f"a second row for {gpu} TP {tp} micro-batch {mbs}", where)
        prof.times.setdefault((gpu, tp), {})[mbs] = np.array([fwd, bwd]).T
        if ("backward_input_s" in row) != ("backward_weight_s" in row):
            raise c.error("give both backward_input_s and backward_weight_s, or neither", f"{where}.backward_input_s")
        if "backward_input_s" in row:
            split = [_values(row[k], n_layers, f"{where}.{k}", c, MAX_SECONDS) for k in ("backward_input_s", "backward_weight_s")]
            prof.backward_split_s.setdefault((gpu, tp), {})[mbs] = np.array(split).T
    for gpu, v in c.mapping(d.get("optimizer", {}), "optimizer", "GPU type -> {seconds_per_param}").items():
        where = f"optimizer.{gpu}"
        name = _located(lambda: catalog.canonical_gpu(gpu), c, where)
        if not isinstance(v, dict) or "seconds_per_param" not in v:
            raise c.error(f"expected a number under seconds_per_param, got {show(v)}", f"{where}.seconds_per_param")
        c.known_keys(v, where, ("seconds_per_param",))
        prof.optimizer_s_per_param[name] = c.number(v["seconds_per_param"], f"{where}.seconds_per_param", lo=0,
                                                    hi=MAX_SECONDS, unit="seconds")
    for k, row in enumerate(c.sequence(d.get("memory", []), "memory", "rows {tp, activation_bytes_per_sample}")):
        where = f"memory.{k}"
        if not isinstance(row, dict) or "tp" not in row or "activation_bytes_per_sample" not in row:
            raise c.error("expected a mapping with tp and activation_bytes_per_sample", where)
        c.known_keys(row, where, MEMORY_KEYS)
        if "gpu" in row:
            _located(lambda: catalog.canonical_gpu(row["gpu"]), c, f"{where}.gpu")
        if "peak_bytes" in row:
            c.number(row["peak_bytes"], f"{where}.peak_bytes", lo=0, hi=MAX_BYTES, unit="bytes")
        tp = _tp(row["tp"], c, f"{where}.tp")
        act = np.array(_values(row["activation_bytes_per_sample"], n_layers, f"{where}.activation_bytes_per_sample",
                               c, MAX_BYTES))
        if tp in prof.activation_bytes and not np.array_equal(prof.activation_bytes[tp], act):
            raise c.error(f"a second memory row for TP {tp} with other activation sizes (one per TP degree is used)",
                          where)
        prof.activation_bytes[tp] = act
    _parse_runtime(d.get("runtime"), prof, c)
    return prof


def _values(v: Any, n: int | None, where: str, c: Checks, hi: float) -> list[float]:
    """A list of `n` (any number when None) finite values in [0, hi], one per layer."""
    items = c.sequence(v, where, "numbers, one per layer")
    if n is not None and len(items) != n:
        raise c.error(f"expected {n} values (one per layer), got {len(items)}", where)
    return [c.number(x, f"{where}.{i}", lo=0, hi=hi) for i, x in enumerate(items)]


def _blame_count(forward_s: list[float], backward_s: list[float], n: int | None, where: str, c: Checks) -> None:
    """Raise for a row whose forward_s and backward_s differ in length: the list that is not the
    model's `n` layers long (None: an inline model, whose count the profile alone does not give)."""
    for key, values, other in (("forward_s", forward_s, backward_s), ("backward_s", backward_s, forward_s)):
        if n is not None and len(values) != n and len(other) == n:
            raise c.error(f"expected {n} values (one per layer), got {len(values)}", f"{where}.{key}")
    of = f" (the model has {n})" if n is not None else ""
    raise c.error(f"forward_s has {len(forward_s)} values and backward_s {len(backward_s)}; both give one per"
                  f" layer{of}", where)


def _check_timed(forward_s: Any, backward_s: Any, where: str, c: Checks, *,
                 columns: tuple[str, str] | None = ("forward_s", "backward_s")) -> None:
    """Refuse a row of layer times (seconds, one per layer) whose forward times are all 0, or whose
    backward times are: no pass over a model takes no time, and a plan timed from it would run
    infinitely many iterations per second. Single zeros stay allowed (a layer can be below the
    clock's resolution). `columns`: the fields the two lists are under (named in the error), or
    None where they have no name of their own (Sailor's [forward, backward, update] per layer).

    Raises:
        SailorInputError: at `where` when both lists are all 0, else at the all-0 column.
    """
    fwd_zero, bwd_zero = not np.any(np.asarray(forward_s) > 0), not np.any(np.asarray(backward_s) > 0)
    if fwd_zero and bwd_zero:
        raise c.error("every forward and backward time is 0 s; a measured pass takes time (measure again)", where)
    for zero, name, column in ((fwd_zero, "forward", 0), (bwd_zero, "backward", 1)):
        if zero:
            field = f"{where}.{columns[column]}" if columns else where
            raise c.error(f"every {name} time is 0 s; a measured pass takes time (measure again)", field)


def _tp(v: Any, c: Checks, where: str) -> int:
    return c.whole(v, where, lo=1, hi=MAX_GPUS_PER_NODE)


def _located(fn, c: Checks, field: str):
    """fn(), with a SailorInputError it raises (an unknown GPU type or model) placed at `field`."""
    try:
        return fn()
    except SailorInputError as e:
        raise e.located(source=c.source, field_prefix=field) from None



RUNTIME_ROWS = {"microbatch_overhead_s": ("seconds",), "pass_overhead_s": ("forward_s", "backward_s"),
                "p2p_overhead_s": ("seconds",)}
"""The lists of the `runtime` section of our format and the seconds each row holds besides gpu and tp."""


def _parse_runtime(runtime: Any, prof: Profiles, c: Checks) -> None:
    """Fill `prof.microbatch_overhead_s`, `prof.pass_overhead_s` and `prof.p2p_overhead_s` from the
    optional `runtime` section of our format (each list optional: absent, nothing is measured)."""
    if runtime is None:
        return
    if not isinstance(runtime, dict) or not all(isinstance(runtime.get(k, []), list) for k in RUNTIME_ROWS):
        raise c.error("expected a mapping with microbatch_overhead_s: [{gpu, tp, seconds}] and optionally"
                      " pass_overhead_s: [{gpu, tp, forward_s, backward_s}], p2p_overhead_s: [{gpu, tp, seconds}]",
                      "runtime")
    c.known_keys(runtime, "runtime", tuple(RUNTIME_ROWS))
    for key, names in RUNTIME_ROWS.items():
        for k, row in enumerate(runtime.get(key, [])):
            where = f"runtime.{key}.{k}"
            if not isinstance(row, dict) or not {"gpu", "tp", *names} <= row.keys():
                raise c.error(f"expected a mapping with gpu, tp and {' and '.join(names)}", where)
            c.known_keys(row, where, ("gpu", "tp", *names))
            gpu = _located(lambda: catalog.canonical_gpu(row["gpu"]), c, f"{where}.gpu")
            values = tuple(c.number(row[n], f"{where}.{n}", lo=0, hi=MAX_SECONDS, unit="seconds") for n in names)
            getattr(prof, key)[(gpu, _tp(row["tp"], c, f"{where}.tp"))] = values[0] if len(values) == 1 else values


def load_sailor_profiles(profiles_path: Path, llm_info_path: Path, job: JobSpec) -> Profiles:
    """Import the public Sailor `profiles_tmp.json` ([model][gpu][mbs][tp][layer] = [fwd_s, bwd_s,
    update_s]) for `job`'s model, and `llm_info.json` ([model][tp][layer] -> act_mem_floats, measured at
    micro-batch 1) for activation memory when present. The Sailor data is fp32 at the model's full
    context (sequence 2048; Llama 8192). `update_s` is ignored: it times a small profiling model, not
    the layer (see shared/reference/sailor/README.md). The files hold no input/weight-gradient split:
    `Profiles.backward_split` estimates it from the FLOPs, labelled. GPU types we do not catalogue are
    skipped (no plan can use them); everything else is checked: layer keys "0".."N-1" for the model's
    N layers, times finite and >= 0, keys whole numbers, one model or GPU type under one name only.

    Raises:
        SailorInputError: naming the file and the dotted field of the first problem.
    """
    src = str(profiles_path)
    c = Checks(src)
    data = c.mapping(load_json(profiles_path), "", "model -> GPU type -> micro-batch size -> TP -> layer")
    key = _model_key(data, job, c)
    if key is None:
        raise c.error(f"holds no profiles for {job.model.name} (it has {', '.join(sorted(data))[:200]})", None)
    n = job.model.num_layers
    prof = Profiles(model=job.model.name, sequence_length=job.model.max_sequence_length, precision="fp32",
                    source=f"sailor:{profiles_path}")
    seen: dict[str, str] = {}
    for gpu_name, by_mbs in c.mapping(data[key], key, "GPU type -> micro-batch size -> TP -> layer").items():
        gpu = catalog.known_gpu(gpu_name)
        if gpu is None:
            continue  # a GPU type we do not catalogue cannot be planned for anyway
        if gpu in seen:
            raise c.error(f"{gpu} is given twice (as {seen[gpu]!r} and {gpu_name!r})", f"{key}.{gpu_name}")
        seen[gpu] = gpu_name
        for mbs_key, by_tp in c.mapping(by_mbs, f"{key}.{gpu_name}", "micro-batch size -> TP -> layer").items():
            mbs = c.whole_key(mbs_key, f"{key}.{gpu_name}.{mbs_key}", lo=1, hi=MAX_GLOBAL_BATCH)
            for tp_key, layers in c.mapping(by_tp, f"{key}.{gpu_name}.{mbs_key}", "TP -> layer").items():
                where = f"{key}.{gpu_name}.{mbs_key}.{tp_key}"
                tp = c.whole_key(tp_key, where, lo=1, hi=MAX_GPUS_PER_NODE)
                rows = _layer_entries(layers, n, where, c, job)
                arr = np.array([_sailor_times(v, f"{where}.{i}", c) for i, v in enumerate(rows)])
                _check_timed(arr[:, 0], arr[:, 1], where, c, columns=None)
                prof.times.setdefault((gpu, tp), {})[mbs] = arr
    if llm_info_path.exists():
        _load_sailor_llm_info(llm_info_path, job, prof)
    return prof


def _sailor_times(v: Any, where: str, c: Checks) -> list[float]:
    """[forward_s, backward_s] of one `[forward_s, backward_s, update_s]` entry (all checked)."""
    values = c.sequence(v, where, "[forward_s, backward_s, update_s]", min_len=2, max_len=3)
    return [c.number(x, f"{where}.{k}", lo=0, hi=MAX_SECONDS, unit="seconds") for k, x in enumerate(values)][:2]


def _model_key(data: dict[str, Any], job: JobSpec, c: Checks) -> str | None:
    """The key of `job`'s model in a Sailor file keyed by model name (None when absent); a model
    under two names is an error."""
    keys = [k for k in data if _known_model(k) and canonical_model_name(k) == job.model.name]
    if not keys:
        return None
    if len(keys) > 1:
        raise c.error(f"{job.model.name} is given twice (as {' and '.join(map(repr, keys))})", keys[1])
    return keys[0]


def _layer_entries(layers: Any, n: int, where: str, c: Checks, job: JobSpec) -> list[Any]:
    """The values of a layer mapping {"0": .., .., str(n - 1): ..}, in layer order."""
    c.mapping(layers, where, f"layer '0'..'{n - 1}' -> values")
    want = {str(i) for i in range(n)}
    if set(layers) != want:
        odd = sorted(set(layers) ^ want, key=lambda k: (len(k), k))[:3]
        raise c.error(f"expected the {n} layers of {job.model.name} as keys '0'..'{n - 1}', got {len(layers)} keys"
                      f" (differing: {', '.join(map(repr, odd))})", where)
    return [layers[str(i)] for i in range(n)]


def _load_sailor_llm_info(path: Path, job: JobSpec, prof: Profiles) -> None:
    """Activation bytes per layer and TP degree from Sailor's `llm_info.json` (act_mem_floats x 4)."""
    c = Checks(str(path))
    info = c.mapping(load_json(path), "", "model -> TP -> layer -> sizes")
    key = _model_key(info, job, c)
    if key is None:
        return  # no activation data for this model: the formula stands in (as without the file)
    n = job.model.num_layers
    for tp_key, layers in c.mapping(info[key], key, "TP -> layer -> sizes").items():
        tp = c.whole_key(tp_key, f"{key}.{tp_key}", lo=1, hi=MAX_GPUS_PER_NODE)
        rows = _layer_entries(layers, n, f"{key}.{tp_key}", c, job)
        prof.activation_bytes[tp] = np.array([
            4 * c.number(c.mapping(r, f"{key}.{tp_key}.{i}", "sizes with act_mem_floats").get("act_mem_floats"),
                         f"{key}.{tp_key}.{i}.act_mem_floats", lo=0, hi=MAX_BYTES / 4) for i, r in enumerate(rows)])


def _known_model(name: str) -> bool:
    try:
        canonical_model_name(name)
        return True
    except SailorInputError:
        return False
