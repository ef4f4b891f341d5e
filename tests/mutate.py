"""Mutated inputs for the bad-input tests: valid seed files for every reader, and mutations that make
them wrong in the ways a hostile user would (types, signs, NaN/inf, huge values, missing and extra
keys, nesting, odd keys, encodings, truncation).

Used by `tests/test_bad_input.py` (choices drawn by hypothesis) and `benchmarks/bad_input_counts.py`
(choices from a seeded `random.Random`): both go through a `Chooser`. `READERS` lists, per reader,
its seed documents, how a document becomes files, and how the reader is called; `check_reader`
asserts the rule every reader follows (a valid object, or a one-line SailorInputError naming the
file) and `TRIED` counts the inputs tried per reader.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from sailor.core.errors import SailorInputError
from sailor.core.limits import MAX_GLOBAL_BATCH

TRIED: Counter = Counter()  # reader -> mutated inputs tried in this process

# Values that are wrong almost anywhere (and a few that are right somewhere, so that accepting
# them is exercised too).
BAD_VALUES: list[Any] = [
    None, True, False, 0, -1, -7, 1, 2, 0.5, 4.7, -0.0, 1e308, -1e308, 10**30, 10**400, 2**63,
    float("nan"), float("inf"), float("-inf"), "", "x", "4", "1e400", "nan", "\u2028", "\x00", "é\u0301",
    "a" * 5000, [], {}, [1, 2], [[[]]], {"a": 1}, {"": None}, "us-central1-a", "A100-40", "cpu", "local",
]
TYPO_SUFFIX = ["x", "_", "s", "2"]


class Chooser:
    """Where mutations get their choices: `pick` one item of a non-empty list, `integer` in [lo, hi]."""

    def pick(self, items: list[Any]) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def integer(self, lo: int, hi: int) -> int:  # pragma: no cover - interface
        raise NotImplementedError


class RandomChooser(Chooser):
    def __init__(self, rng) -> None:
        self.rng = rng

    def pick(self, items):
        return items[self.rng.randrange(len(items))]

    def integer(self, lo, hi):
        return self.rng.randint(lo, hi)


class HypothesisChooser(Chooser):
    def __init__(self, data) -> None:
        from hypothesis import strategies as st
        self.data, self.st = data, st

    def pick(self, items):
        return items[self.data.draw(self.st.integers(0, len(items) - 1))]

    def integer(self, lo, hi):
        return self.data.draw(self.st.integers(lo, hi))


# ---- tree mutations ------------------------------------------------------------------------------
def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def _deep(value: Any, depth: int) -> Any:
    for _ in range(depth):
        value = [value]
    return value


def mutate_tree(doc: Any, c: Chooser) -> Any:
    """One structural mutation of a parsed document (a copy is returned)."""
    doc = copy.deepcopy(doc)
    path = c.pick(_paths(doc))
    here = _get(doc, path)
    kind = c.pick(["replace", "replace", "replace", "number", "delete", "extra", "rename", "wrap", "deep",
                   "empty", "duplicate_item"])
    if kind == "replace" or (kind in ("delete", "rename") and not path) or (kind == "number" and not _is_number(here)):
        return _set(doc, path, copy.deepcopy(c.pick(BAD_VALUES)))
    if kind == "number":
        factor = c.pick([-1, 0, 0.5, 1.5, 10**3, 10**12, 10**30, float("nan"), float("inf")])
        try:
            value = here * factor
        except OverflowError:  # an int beyond float range (an earlier mutation) times a float
            value = factor
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e300 and c.pick([0, 1]):
            value = int(value)  # 4.0 -> 4: the same value as an int, which a reader may accept
        return _set(doc, path, value)
    if kind == "delete":
        parent = _get(doc, path[:-1])
        del parent[path[-1]]
        return doc
    if kind == "extra":
        target = here if isinstance(here, (dict, list)) else _get(doc, path[:-1]) if path else doc
        if isinstance(target, dict):
            target[c.pick(["extra", "zone", "gpu", "tp", "", "Model", "1"])] = copy.deepcopy(c.pick(BAD_VALUES))
        elif isinstance(target, list):
            target.append(copy.deepcopy(c.pick(BAD_VALUES)))
        else:
            return copy.deepcopy(c.pick(BAD_VALUES))
        return doc
    if kind == "rename":
        parent = _get(doc, path[:-1])
        if isinstance(parent, dict):
            parent[str(path[-1]) + c.pick(TYPO_SUFFIX)] = parent.pop(path[-1])
        return doc
    if kind == "wrap":
        return _set(doc, path, [here] if c.pick([0, 1]) else {"value": here})
    if kind == "deep":
        return _set(doc, path, _deep(here, c.pick([10, 33, 120])))  # deeper: text mutation "deep"
    if kind == "empty":
        return _set(doc, path, type(here)() if isinstance(here, (dict, list, str)) else None)
    if isinstance(here, list) and here:  # duplicate_item
        here.append(copy.deepcopy(here[c.integer(0, len(here) - 1)]))
    return doc


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ---- serialisation and text mutations ------------------------------------------------------------
def dump(doc: Any, fmt: str) -> bytes:
    """A document as file bytes: "json" (NaN and Infinity written as Python does), "yaml", or "csv"
    (a list of rows)."""
    if fmt == "json":
        return json.dumps(doc, allow_nan=True, default=str).encode()
    if fmt == "csv":
        buf = io.StringIO()
        csv.writer(buf).writerows([[_cell(x) for x in (row if isinstance(row, list) else [row])]
                                   for row in (doc if isinstance(doc, list) else [doc])])
        return buf.getvalue().encode("utf-8", "surrogatepass")
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False).encode("utf-8", "surrogatepass")


def _cell(x: Any) -> str:
    return json.dumps(x) if isinstance(x, (dict, list)) else str(x)


def mutate_text(data: bytes, fmt: str, c: Chooser) -> bytes:
    """One byte-level mutation: truncation, invalid UTF-8, a BOM, NUL, a duplicated key, YAML's
    complex or non-string keys and aliases, deep nesting, an empty file."""
    kind = c.pick(["truncate", "truncate", "bytes", "bom", "nul", "dupkey", "complexkey", "intkey", "alias",
                   "deep", "empty", "crlf", "latin1"])
    n = len(data)
    if kind == "truncate":
        return data[: c.integer(0, max(n - 1, 0))]
    if kind == "bytes":
        at = c.integer(0, n)
        return data[:at] + c.pick([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"]) + data[at:]
    if kind == "bom":
        return b"\xef\xbb\xbf" + data
    if kind == "nul":
        at = c.integer(0, n)
        return data[:at] + b"\x00" + data[at:]
    if kind == "latin1":
        return data.decode("utf-8", "replace").replace("a", "\u00e4").encode("latin-1", "replace")
    if kind == "crlf":
        return data.replace(b"\n", b"\r\n")
    if kind == "empty":
        return c.pick([b"", b" \n", b"\n\n"])
    if kind == "deep":
        d = c.pick([100, 5000, 100000])
        return (b"[" * d + b"]" * d) if fmt == "json" else (b"a: " + b"[" * d + b"]" * d + b"\n")
    if fmt == "json":
        if kind == "dupkey" and data.startswith(b"{") and b'"' in data:
            key = data[1:].split(b":", 1)[0]
            return b"{" + key + b": 1, " + data[1:]
        return data
    if fmt == "yaml":
        if kind == "dupkey" and b":" in data:
            first = data.split(b"\n", 1)[0]
            return first + b"\n" + data
        if kind == "complexkey":
            return b"? [a, b]\n: 1\n" + data
        if kind == "intkey":
            return c.pick([b"1: 2\n", b"yes: 1\n", b"null: 1\n", b"2024-01-01: 1\n", b"1.5: x\n"]) + data
        if kind == "alias":
            bomb = b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
                b"%c: &%c [*%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c]\n" % ((98 + i,) * 2 + (97 + i,) * 9)
                for i in range(8))
            return c.pick([bomb, b"a: &a [*a]\n"]) + data
    return data


# ---- readers -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reader:
    """One reader under test.

    Attributes:
        name: how it is counted.
        seeds: valid documents (each a mapping of file name -> (document, format)).
        read: reads the files in a folder and returns the object (or raises).
        valid: asserts the invariants of an accepted object.
        own: a mutation only this format has (e.g. a dense config made mixture-of-experts), or None.
    """

    name: str
    seeds: list[dict[str, tuple[Any, str]]]
    read: Callable[[Path], Any]
    valid: Callable[[Any], None]
    own: Callable[[Any, Chooser], Any] | None = None  # a mutation of this format only (half the tree mutations)


def _finite_tree(values) -> bool:
    return all(math.isfinite(float(x)) for x in values)


TINY_JOB = {"model": "tiny", "global_batch_size": 8}
INLINE_JOB = {"model": {"name": "x", "num_blocks": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
                        "vocab_size": 256, "max_sequence_length": 64, "gated_mlp": True},
              "global_batch_size": 16, "sequence_length": 32, "precision": "bf16", "optimizer": "sgd"}
GCP = {"provider": "gcp", "zones": {"us-central1-a": {"A100-40": 16, "V100-16": 4}, "us-west1-b": {"A100-40": 4}},
       "gpus_per_node": {"A100-40": 4, "V100-16": 4},
       "prices": {"A100-40": 3.5, "us-west1-b": {"A100-40": 4.0}},
       "network": {"same_region": {"latency_s": 0.0005, "bandwidth_bytes_per_s": 1.5e9}}}
LOCAL = {"provider": "local", "zones": {"local": {"cpu": 4}},
         "network": {"same_node": {"latency_s": 5e-5, "bandwidth_bytes_per_s": 2e9}}}
_REP = {"stage": 0, "gpu": "A100-40", "zone": "us-central1-a", "tp": 2}
PLAN = {"micro_batch_size": 1, "stages": [[0, 3], [3, 6]],
        "pipelines": [{"microbatches": 4, "replicas": [_REP, _REP | {"stage": 1}]},
                      {"microbatches": 4, "replicas": [_REP | {"tp": 4}, _REP | {"stage": 1, "tp": 1}]}],
        "memory": [{"recompute": "full", "recompute_blocks": 1, "zero": 1}, {}],
        "job": TINY_JOB, "cluster": GCP}
_SREP = [[["A100-40", 4, "us-central1-a"]], 2]
SAILOR_PLAN = {"mbs": 1, "gbs": 8, "N": 2, "real": 1.25, "max_mem": 7.9e9,
               "pipeline_list": [{"num_stages": 2, "layers_per_stage": [[0, 1, 2], [3, 4, 5]], "dp": [2, 2],
                                  "tmp_per_stage": [[_SREP, _SREP], [_SREP, _SREP]]}]}
TRACE_CSV = [["", "Timestamp", "A100-40_us-central1-a", "V100-16_us-central1-a"],
             ["0", "1700000000", "4", "8"], ["1", "1700000060", "2", "8"], ["2", "1700000120", "8.0", "0"]]
TRACE_EVENTS = [{"time_s": 0, "zone": "us-central1-a", "gpu": "A100-40", "count": 4},
                {"time_s": 30.5, "zone": "us-central1-a", "gpu": "V100-16", "count": 2},
                {"time_s": 60, "zone": "us-central1-a", "gpu": "A100-40", "count": 0}]
TRACE_A100 = [{"Time": 0, "GPUs": 2}, {"Time": 63, "GPUs": 4}, {"Time": 126, "GPUs": 3}]
HOSTS = {"user": "ubuntu", "groups": [
    {"zone": "us-central1-a", "gpu": "A100-40", "gpus_per_node": 4, "hosts": ["10.0.0.1", "node-2"]},
    {"zone": "us-west1-b", "gpu": "V100-16", "user": "admin", "hosts": ["w0"]}]}
_ROW = {"gpu": "A100-40", "tp": 1, "mbs": 1, "forward_s": [1e-3] * 6, "backward_s": [2e-3] * 6}
PROFILE = {"schema": "sailor.profiles/1", "model": "tiny", "sequence_length": 64, "precision": "fp32",
           "source": "test", "layers": [_ROW, _ROW | {"mbs": 4, "tp": 2}],
           "optimizer": {"A100-40": {"seconds_per_param": 1e-9}},
           "memory": [{"tp": 1, "activation_bytes_per_sample": [1000.0] * 6}],
           "runtime": {"microbatch_overhead_s": [{"gpu": "A100-40", "tp": 1, "seconds": 1e-4}]}}
SAILOR_PROFILES = {"tiny": {"A100-40": {"1": {"1": {str(i): [1e-3, 2e-3, 1e-4] for i in range(6)},
                                               "2": {str(i): [6e-4, 1.2e-3, 1e-4] for i in range(6)}},
                                         "4": {"1": {str(i): [3e-3, 6e-3, 1e-4] for i in range(6)}}},
                            "K80": {"1": {"1": {"0": [1, 2, 3]}}}}}
LLM_INFO = {"tiny": {"1": {str(i): {"act_mem_floats": 2500.0, "params_floats": 10.0} for i in range(6)}}}
OUR_NETWORK = {"schema": "sailor.network/1",
               "classes": {"same_zone": {"latency_s": 3e-5, "bandwidth_bytes_per_s": 2e9}},
               "links": [{"src_zone": "us-central1-a", "src_gpu": "A100-40", "dst_zone": "us-central1-b",
                          "dst_gpu": "V100-16", "flows": 2, "latency_s": 5e-4, "bandwidth_bytes_per_s": 1e9}]}
_LEAF = [[0.8, 16.4, 33.0], 2.5e11]
SAILOR_NETWORK = {"us-central1-a": {"A100-40": {"2": {"us-central1-b": {"A100-40": {"2": _LEAF, "4": _LEAF}}},
                                                "4": {"us-central1-a": {"V100-16": {"4": [[-0.1, 1.0, 2.0], 1e10]}}}}}}
INTRA = {"A100-40": {"2": _LEAF, "4": _LEAF}, "RTX-9999": {"2": _LEAF}}


def _load_job(d: Path):
    from sailor.specs import load_job
    return load_job(next(d.glob("job.*")))


def _valid_job(job) -> None:
    assert 1 <= job.global_batch_size <= MAX_GLOBAL_BATCH and job.seq >= 1 and job.model.num_layers >= 3


RECIPE_JOB = TINY_JOB | {"sequence_length": 64, "recipe": {
    "optimizer": {"name": "adamw", "lr": 3.0e-4, "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.1,
                  "grad_clip": 1.0},
    "schedule": {"warmup_steps": 10, "decay": "cosine", "min_lr": 3.0e-5, "total_steps": 100},
    "eval": {"data": "held_out.npy", "every": 20, "batches": 2}, "checkpoint": {"every": 50, "keep": 3}}}


def _valid_recipe(job) -> None:
    """A recipe that is taken gives a finite rate in [0, lr] (min_lr <= it after warmup) at every step."""
    from sailor.specs.recipe import learning_rate
    _valid_job(job)
    r = job.recipe
    total, warm = r.schedule.total_steps or 1000, r.schedule.warmup_steps
    steps = {1, warm, warm + 1, total // 2, total, total + 1} | {1 + total * k // 50 for k in range(51)}
    rates = [learning_rate(r.schedule, r.optimizer.lr, n) for n in sorted(steps) if n >= 1]
    assert all(math.isfinite(x) and 0.0 <= x <= r.optimizer.lr * (1 + 1e-12) for x in rates)
    assert r.checkpoint.every >= 0 and r.checkpoint.keep >= 1  # every 0: only at the end and on stop


def _load_cluster(d: Path):
    from sailor.specs import load_cluster
    return load_cluster(next(d.glob("cluster.*")))


def _valid_cluster(c) -> None:
    for zone, gpus in c.zones.items():
        for g, n in gpus.items():
            assert isinstance(n, int) and n >= 0 and (n == 0 or math.isfinite(c.price(zone, g)))
    assert all(isinstance(v, int) and v >= 1 for v in c.gpus_per_node.values())


def _load_plan(d: Path):
    from sailor.plan import load_plan
    from sailor.runtime.validate import check_plan_for_job
    plan = load_plan(d / "plan.json")
    if plan.job is not None:  # what train, launch and every worker check next
        check_plan_for_job(plan, plan.job, plan.cluster, source=str(d / "plan.json"))
    return plan


def _valid_plan(plan) -> None:
    assert 1 <= plan.global_batch_size <= MAX_GLOBAL_BATCH and plan.stages[0][0] == 0
    assert all(p.microbatches >= 1 and len(p.replicas) == plan.num_stages for p in plan.pipelines)


def _trace_cluster(single: bool):
    from sailor.specs.cluster import ClusterSpec
    zones = {"us-central1-a": {"A100-40": 8}} if single else {"us-central1-a": {"A100-40": 8, "V100-16": 8}}
    return ClusterSpec(zones=zones)


def _load_trace(d: Path):
    from sailor.elastic.availability import load_trace
    path = next(d.glob("trace*"))
    return load_trace(path, _trace_cluster(single="a100" in path.stem))


def _valid_trace(t) -> None:
    times = [s.time_s for s in t.snapshots]
    assert times == sorted(times) and _finite_tree(times) and all(x >= 0 for x in times)
    assert all(isinstance(n, int) and n >= 0 for s in t.snapshots for g in s.zones.values() for n in g.values())


def _load_hosts(d: Path):
    from sailor.launch.hosts import load_hosts
    return load_hosts(d / "hosts.yaml")


def _valid_hosts(h) -> None:
    assert h.groups and all(g.hosts and (g.gpus_per_node is None or g.gpus_per_node >= 1) for g in h.groups)


def _load_profiles(d: Path):
    from sailor.perf.profiles import load_profiles
    from sailor.specs.job import JobSpec
    path = d / "profile.json" if (d / "profile.json").exists() else d
    return load_profiles(path, JobSpec(model="tiny", global_batch_size=8))


def _valid_profiles(p) -> None:
    for by_mbs in p.times.values():
        for arr in by_mbs.values():
            assert arr.shape == (6, 2) and np.isfinite(arr).all() and (arr >= 0).all()
    assert all(math.isfinite(v) and v >= 0 for v in p.optimizer_s_per_param.values())
    assert all(np.isfinite(a).all() and (a >= 0).all() for a in p.activation_bytes.values())


def _load_network(d: Path):
    from sailor.perf.network_files import network_for
    from sailor.specs.cluster import ClusterSpec
    path = d / "network.json" if (d / "network.json").exists() else d
    return network_for(ClusterSpec(zones={"us-central1-a": {"A100-40": 8}, "us-central1-b": {"V100-16": 8}}), path)


def _valid_network(net) -> None:
    for link in [*net.links.values(), *net.class_links.values()]:
        assert math.isfinite(link.latency_s) and link.latency_s >= 0 and link.bandwidth_bytes_per_s > 0
    for fit in [*net.fits.values(), *net.intra_fits.values()]:
        assert _finite_tree([fit.c0, fit.c1, fit.c2, fit.max_bytes_per_s])
    # every lookup gives a finite, positive time
    t = net.transfer_time_s("us-central1-a", "A100-40", "us-central1-b", "V100-16", 1e6, flows=2)
    assert math.isfinite(t) and t > 0


def _load_runs(d: Path):
    from sailor.simulator.fidelity import load_runs
    return load_runs(d / "runs-tiny")


def _valid_runs(runs) -> None:
    assert runs and all(r.measured_time_s > 0 and r.measured_memory_bytes > 0 for r in runs)


TESTBED = {"name": "box", "cfs_period_us": 10000,
           "devices": {"fast": {"gpu": "A100-40", "cpu_quota": 0.45}, "slow": {"gpu": "V100-16", "cpu_quota": 0.15}},
           "links": {"same_zone_mbit_per_s": 400, "cross_zone_mbit_per_s": 200, "cross_region_mbit_per_s": 50,
                     "same_node_mbit_per_s": 1000},
           "nodes": [{"name": "a0", "zone": "us-central1-a", "region": "us-central1", "device": "fast", "ranks": 1,
                      "nic_mbit_per_s": 300},
                     {"name": "b0", "zone": "us-west1-b", "region": "us-west1", "device": "slow", "ranks": 2,
                      "nic_mbit_per_s": 300}]}
HF_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2}
HF_GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
           "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.0, "layer_norm_epsilon": 1e-5}
# what the mixture-of-experts configs (Mixtral, Qwen-MoE) add to a dense one: each seed is the dense
# config, and a mutation may add these keys or model types (`mutate_tree`'s "extra" and "replace")
MOE_EXTRA = {"num_local_experts": 8, "num_experts_per_tok": 2, "num_experts": 60, "moe_intermediate_size": 32}


def moe_mutation(doc: Any, c: Chooser) -> Any:
    """A dense config turned (partly) into a mixture-of-experts one, or into a near-miss model type."""
    doc = copy.deepcopy(doc)
    if not isinstance(doc, dict):
        return doc
    if c.pick([0, 1]):
        doc["model_type"] = c.pick(["mixtral", "qwen2_moe", "qwen3_moe", "mistral", "qwen2", "gpt_neox", "Llama"])
    else:
        key = c.pick(sorted(MOE_EXTRA))
        doc[key] = MOE_EXTRA[key]
    return doc


def _load_testbed(d: Path):
    from sailor.specs import load_cluster
    from sailor.testbed.spec import cluster_spec, load_testbed
    spec = load_testbed(d / "testbed.yaml")
    return spec, load_cluster(cluster_spec(spec))  # what `sailor testbed up` plans with


def _valid_testbed(pair) -> None:
    spec, cluster = pair
    assert 0 < spec.total_cpu_cores() < math.inf and len({n.name for n in spec.nodes}) == len(spec.nodes)
    assert sum(n for gpus in cluster.zones.values() for n in gpus.values()) == sum(n.ranks for n in spec.nodes)


def _load_hosts_for_plan(d: Path):
    from sailor.launch import layout_for
    from sailor.launch.hosts import assign_hosts, load_hosts
    from sailor.plan import plan_from_dict
    src = str(d / "hosts.yaml")
    hosts = load_hosts(src)
    layout = layout_for(plan_from_dict(copy.deepcopy(PLAN_FOR_HOSTS)), hosts, src)
    return layout, assign_hosts(layout, hosts, src)  # what `sailor launch --backend torchrun --hosts` does


def _valid_hosts_for_plan(pair) -> None:
    layout, dest = pair
    assert set(dest) == {n.name for n in layout.nodes} and len(set(dest.values())) == len(dest)


def _load_hf_config(d: Path):
    from sailor.model.hf_config import load_hf_config
    return load_hf_config(d / "hf" / "config.json")


def _valid_hf_config(spec) -> None:
    assert spec.num_blocks >= 1 and spec.hidden_size % spec.num_heads == 0 and spec.num_heads % spec.kv_heads == 0


_A = {"stage": 0, "gpu": "A100-40", "zone": "us-central1-a", "tp": 2}
_V = _A | {"gpu": "V100-16", "zone": "us-west1-b"}
PLAN_FOR_HOSTS = PLAN | {"pipelines": [{"microbatches": 4, "replicas": [_A, _A | {"stage": 1}]},
                                       {"microbatches": 4, "replicas": [_V, _A | {"stage": 1}]}],
                         "cluster": GCP | {"zones": {"us-central1-a": {"A100-40": 16}, "us-west1-b": {"V100-16": 4}}}}
HOSTS_FOR_PLAN = {"user": "ubuntu", "groups": [
    {"zone": "us-central1-a", "gpu": "A100-40", "gpus_per_node": 4, "hosts": ["10.0.0.1", "node-2", "node-3"]},
    {"zone": "us-west1-b", "gpu": "V100-16", "user": "admin", "hosts": ["w0", "w1"]},
    {"zone": "europe-west4-a", "gpu": "A100-40", "hosts": ["spare"]}]}

READERS: list[Reader] = [
    Reader("job", [{"job.yaml": (TINY_JOB, "yaml")}, {"job.json": (INLINE_JOB, "json")}], _load_job, _valid_job),
    Reader("cluster", [{"cluster.yaml": (GCP, "yaml")}, {"cluster.json": (LOCAL, "json")}], _load_cluster,
           _valid_cluster),
    Reader("plan", [{"plan.json": (PLAN, "json")}], _load_plan, _valid_plan),
    Reader("sailor_plan_config", [{"plan.json": (SAILOR_PLAN, "json")},
                                  {"plan.json": (SAILOR_PLAN | {"gbs": 9}, "json")}], _load_plan, _valid_plan),
    Reader("trace", [{"trace.csv": (TRACE_CSV, "csv")}, {"trace.json": (TRACE_EVENTS, "json")},
                     {"trace_a100.json": (TRACE_A100, "json")}], _load_trace, _valid_trace),
    Reader("hosts", [{"hosts.yaml": (HOSTS, "yaml")}], _load_hosts, _valid_hosts),
    # readers added since round 2 (issue 31): a testbed file and the cluster it plans with, a job's
    # training recipe, a hosts file matched against a plan (zones, node sizes, host counts), Hugging
    # Face configs (mixture-of-experts ones among the mutations)
    Reader("testbed", [{"testbed.yaml": (TESTBED, "yaml")}], _load_testbed, _valid_testbed),
    Reader("recipe", [{"job.yaml": (RECIPE_JOB, "yaml")}], _load_job, _valid_recipe),
    Reader("hosts_for_plan", [{"hosts.yaml": (HOSTS_FOR_PLAN, "yaml")}], _load_hosts_for_plan, _valid_hosts_for_plan),
    Reader("hf_config", [{"hf/config.json": (HF_LLAMA, "json")}, {"hf/config.json": (HF_GPT2, "json")}],
           _load_hf_config, _valid_hf_config, moe_mutation),
    Reader("profiles", [{"profile.json": (PROFILE, "json")}], _load_profiles, _valid_profiles),
    Reader("sailor_profiles", [{"profiles_tmp.json": (SAILOR_PROFILES, "json"), "llm_info.json": (LLM_INFO, "json")}],
           _load_profiles, _valid_profiles),
    Reader("network", [{"network.json": (OUR_NETWORK, "json")}], _load_network, _valid_network),
    Reader("sailor_network", [{"multizone_bandwidths_het.json": (SAILOR_NETWORK, "json"),
                               "intra_node_bandwidths.json": (INTRA, "json")}], _load_network, _valid_network),
    # one run alone too: beside a valid run a bad one is skipped with a warning (validate's rule), alone
    # it is refused
    Reader("validation_folder", [{"runs-tiny/plan_config_a.json": (SAILOR_PLAN, "json"),
                                  "runs-tiny/plan_config_b.json": (SAILOR_PLAN | {"gbs": 16, "mbs": 2}, "json")},
                                 {"runs-tiny/plan_config_a.json": (SAILOR_PLAN, "json")}],
           _load_runs, _valid_runs),
]
BY_NAME = {r.name: r for r in READERS}


def mutant(reader: Reader, c: Chooser) -> dict[str, bytes]:
    """A mutated input for `reader`: file name -> bytes (one file of the seed mutated 1-3 times)."""
    seed = c.pick(reader.seeds)
    files = {name: dump(doc, fmt) for name, (doc, fmt) in seed.items()}
    name = c.pick(sorted(seed))
    doc, fmt = seed[name]
    for _ in range(c.integer(1, 3)):
        if c.pick(["tree", "tree", "tree", "text"]) == "tree" or fmt == "csv" and c.pick([0, 1]):
            doc = reader.own(doc, c) if reader.own is not None and c.pick([0, 1]) else mutate_tree(doc, c)
            files[name] = dump(doc, fmt)
        else:
            files[name] = mutate_text(files[name], fmt, c)
    return files


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        p = folder / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def check_reader(reader: Reader, folder: Path) -> str:
    """Call `reader` on the files in `folder` and assert the rule: it returns a valid object
    ("accepted") or raises a SailorInputError that is one printable line naming a file or folder of
    the input ("refused"). Any other exception propagates (the test fails on it)."""
    TRIED[reader.name] += 1
    try:
        obj = reader.read(folder)
    except SailorInputError as e:
        line = e.one_line()
        assert line.isprintable() and line.strip() == line and line, repr(line)
        assert str(folder) in line or any(p.name in line for p in folder.rglob("*")), line
        return "refused"
    reader.valid(obj)
    return "accepted"
