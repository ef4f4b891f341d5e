"""Checkpoint format 2 without processes: entries sliced any way read back as any plan's TP shards,
the commit's coverage check, checksums per entry and per file, format 1 still read, and a one-rank
save -> resume through `ShardedAdamW.checkpoint_entries` and the layer-by-layer start-up."""

from __future__ import annotations

import json

import pytest
import torch

from sailor.plan.spec import Plan
from sailor.runtime import checkpoint as ckpt
from sailor.runtime.checkpoint_io import RankWriter, Reader, load_tensors
from sailor.runtime.topology import derive_topology
from sailor.runtime.worker import build_rank, model_layout
from sailor.specs.job import JobSpec

META = {"seed": 0, "model": {}, "global_batch_size": 8}
ROW = "layers.1.attn.o.weight"  # TP splits it along dim 1 (input features)
COL = "layers.1.attn.q.weight"  # along dim 0
BIAS = "layers.1.attn.q.bias"  # along dim 0 (1-D)
FULL = {ROW: torch.arange(24.0).view(4, 6), COL: 100 + torch.arange(24.0).view(6, 4), BIAS: -torch.arange(6.0)}
LAYOUT = {n: list(t.shape) for n, t in FULL.items()}


def _write_two_ranks(root, step: int = 1, *, skip: tuple[str, int] | None = None,
                     extra: bool = False) -> None:
    """FULL as two ranks would write it under a TP-2 plan with ZeRO shards cutting rows: ROW in two
    column blocks, each split at flat element 5 (mid-row); COL and BIAS whole, split by rank.
    `skip`: leave out that (name, rank) entry; `extra`: rank 1 writes ROW's first range again."""
    tmp = ckpt.prepare_tmp(root, step)
    writers = [RankWriter(tmp, r, {"stage": 0, "pipeline": r, "tp_rank": 0}) for r in range(2)]
    for block in range(2):
        piece = FULL[ROW][:, 3 * block:3 * block + 3].reshape(-1)  # 12 elements
        for r, (lo, hi) in enumerate(((0, 5), (5, 12))):
            if skip != (ROW, r):
                writers[r].add(ROW, "param", 1, 3 * block, 3, lo, piece[lo:hi])
    if extra:
        writers[1].add(ROW, "param", 1, 0, 3, 0, FULL[ROW][:, :3].reshape(-1)[:5])
    for name in (COL, BIAS):
        flat = FULL[name].reshape(-1)
        half = flat.numel() // 2 + 1
        writers[0].add(name, "param", None, 0, 0, 0, flat[:half])
        if skip != (name, 1):
            writers[1].add(name, "param", None, 0, 0, half, flat[half:])
    for w in writers:
        w.close()


def test_entries_sliced_one_way_read_back_as_any_tp_shard(tmp_path):
    _write_two_ranks(tmp_path)
    path = ckpt.commit(tmp_path, 1, META, layout=LAYOUT, keys=["param"], world_size=2)
    manifest = ckpt.read_manifest(path)
    assert set(manifest["files"]) == {"rank-00000.bin", "rank-00000.json", "rank-00001.bin", "rank-00001.json"}
    assert manifest["ranks"]["1"] == {"stage": 0, "pipeline": 1, "tp_rank": 0, "index": "rank-00001.json",
                                      "data": "rank-00001.bin"}
    got = load_tensors(path, manifest, list(FULL))
    for n, t in FULL.items():
        assert torch.equal(got[n]["param"], t), n
    reader = Reader(path, ckpt.read_manifest(path, verify=False))
    for tp in (2, 3):
        for t in range(tp):
            assert torch.equal(reader.shard(ROW, "param", t, tp), FULL[ROW].chunk(tp, dim=1)[t])
            assert torch.equal(reader.shard(COL, "param", t, tp), FULL[COL].chunk(tp, dim=0)[t])
            assert torch.equal(reader.shard(BIAS, "param", t, tp), FULL[BIAS].chunk(tp)[t])
    reader.close()


@pytest.mark.parametrize("how, match", [
    ({"skip": (ROW, 1)}, "do not cover it exactly once"),
    ({"skip": (BIAS, 1)}, "do not cover it exactly once"),
    ({"extra": True}, "do not cover it exactly once"),
])
def test_commit_refuses_entries_that_do_not_cover_every_element_once(tmp_path, how, match):
    _write_two_ranks(tmp_path, **how)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.commit(tmp_path, 1, META, layout=LAYOUT, keys=["param"], world_size=2)
    assert not ckpt.step_dir(tmp_path, 1).exists()  # nothing renamed into place


def test_commit_refuses_a_missing_rank_a_missing_tensor_and_a_missing_key(tmp_path):
    _write_two_ranks(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="rank 2 wrote no complete shard"):
        ckpt.commit(tmp_path, 1, META, layout=LAYOUT, keys=["param"], world_size=3)
    with pytest.raises(ckpt.CheckpointError, match="no rank wrote param of layers.1.attn.k.weight"):
        ckpt.commit(tmp_path, 1, META, layout={**LAYOUT, "layers.1.attn.k.weight": [6, 4]}, keys=["param"],
                    world_size=2)
    with pytest.raises(ckpt.CheckpointError, match="no rank wrote exp_avg of"):
        ckpt.commit(tmp_path, 1, META, layout=LAYOUT, keys=["param", "exp_avg"], world_size=2)
    with pytest.raises(ckpt.CheckpointError, match="which the layout does not have"):
        ckpt.commit(tmp_path, 1, META, layout={ROW: LAYOUT[ROW]}, keys=["param"], world_size=2)
    # a data file cut short after its index was written
    data = tmp_path / ".tmp-step-00000001" / "rank-00001.bin"
    data.write_bytes(data.read_bytes()[:-4])
    with pytest.raises(ckpt.CheckpointError, match="does not describe rank-00001.bin"):
        ckpt.commit(tmp_path, 1, META, layout=LAYOUT, keys=["param"], world_size=2)


def test_a_corrupted_shard_is_named_by_the_rank_reading_it_and_skipped_by_find_latest(tmp_path):
    _write_two_ranks(tmp_path, step=1)
    ckpt.commit(tmp_path, 1, META, layout=LAYOUT, keys=["param"], world_size=2)
    _write_two_ranks(tmp_path, step=2)
    path = ckpt.commit(tmp_path, 2, META, layout=LAYOUT, keys=["param"], world_size=2)
    f = path / "rank-00001.bin"
    index = json.loads((path / "rank-00001.json").read_text())
    (entry,) = [e for e in index["entries"] if e["name"] == COL]
    data = bytearray(f.read_bytes())
    data[entry["offset"] + 1] ^= 0xFF  # a byte of COL's second half
    f.write_bytes(bytes(data))
    reader = Reader(path, ckpt.read_manifest(path, verify=False))  # sizes match: only the data is wrong
    assert torch.equal(reader.shard(ROW, "param", 0, 2), FULL[ROW][:, :3])  # entries not read are not needed
    with pytest.raises(ckpt.CheckpointError, match=f"rank-00001.bin: checksum mismatch in param of {COL}"):
        reader.shard(COL, "param", 1, 2)
    reader.close()
    found = ckpt.find_latest(tmp_path)
    assert found.path == ckpt.step_dir(tmp_path, 1)
    assert len(found.skipped) == 1 and "rank-00001.bin: checksum mismatch" in found.skipped[0]


def test_format_1_is_still_read(tmp_path):
    import hashlib
    import io

    d = ckpt.step_dir(tmp_path, 4)
    d.mkdir()
    buf = io.BytesIO()
    torch.save({n: {"param": t, "exp_avg": t + 1, "exp_avg_sq": t + 2} for n, t in FULL.items()}, buf)
    (d / "stage-0.pt").write_bytes(buf.getvalue())
    manifest = {"format": ckpt.FORMAT_1, "step": 4, **META,
                "files": {"stage-0.pt": {"sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
                                         "bytes": len(buf.getvalue())}},
                "tensors": {n: "stage-0.pt" for n in FULL}}
    (d / "manifest.json").write_text(json.dumps(manifest))
    found = ckpt.find_latest(tmp_path)
    assert found.path == d
    reader = Reader(d, found.manifest)
    assert reader.held_keys() == ["param", "exp_avg", "exp_avg_sq"]
    assert torch.equal(reader.shard(ROW, "exp_avg", 1, 2), FULL[ROW][:, 3:] + 1)


def test_one_rank_save_and_layer_by_layer_resume_give_back_every_tensor(tmp_path):
    """ZeRO-0 and ZeRO-3 on one rank: the weights and Adam moments written by `checkpoint_entries`
    come back through `build_rank(reader=...)` bit for bit, and cover the model's layout."""
    job = JobSpec(model="tiny", global_batch_size=8)
    for zero in (0, 3):
        plan = Plan.model_validate({"micro_batch_size": 2, "stages": [[0, 6]], "memory": [{"zero": zero}],
                                    "pipelines": [{"microbatches": 4, "replicas": [
                                        {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}]}]})
        role = derive_topology(plan).roles[0]
        rk = build_rank(plan, job, role, {}, device=torch.device("cpu"), seed=3)
        opt = rk.optimizer
        for i in range(len(opt.buckets)):  # moments as a step would leave them
            opt.exp_avg[i].uniform_()
            opt.exp_avg_sq[i].uniform_()
        opt.steps = 2
        want = opt.full_state()
        root = tmp_path / f"z{zero}"
        tmp = ckpt.prepare_tmp(root, 2)
        writer = RankWriter(tmp, 0, {"stage": 0, "pipeline": 0, "tp_rank": 0})
        for entry in opt.checkpoint_entries():
            writer.add(*entry)
        writer.close()
        path = ckpt.commit(root, 2, META, layout=model_layout(job.model),
                           keys=["param", *ckpt.OPTIMIZER_KEYS], world_size=1)
        reader = Reader(path, ckpt.read_manifest(path))
        back = build_rank(plan, job, role, {}, device=torch.device("cpu"), seed=99, reader=reader, step=2)
        reader.close()
        assert back.optimizer.steps == 2
        got = back.optimizer.full_state()
        assert got.keys() == want.keys()
        for n, entry in want.items():
            for k, t in entry.items():
                assert torch.equal(got[n][k], t), (zero, n, k)


TWO_STAGES = {"micro_batch_size": 2, "stages": [[0, 3], [3, 6]],
              "pipelines": [{"microbatches": 4, "replicas": [{"stage": s, "gpu": "cpu", "zone": "local", "tp": 1}
                                                             for s in range(2)]}]}


def _save_rank(rank: int, store: str, root: str, out: str) -> None:
    """One of two gloo ranks (one stage each): build the stage, save checkpoint 0, record how long
    `save_checkpoint` took."""
    import datetime
    import time
    from pathlib import Path

    import torch.distributed as dist

    from sailor.runtime.groups import create_groups
    from sailor.runtime.worker import save_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    plan, job, cpu = Plan.model_validate(TWO_STAGES), JobSpec(model="tiny", global_batch_size=8), torch.device("cpu")
    topo = derive_topology(plan)
    rk = build_rank(plan, job, topo.roles[rank], create_groups(topo, datetime.timedelta(seconds=60)), device=cpu,
                    seed=0)
    t0 = time.monotonic()
    save_checkpoint(Path(root), 0, META, rk.optimizer, topo.roles[rank], cpu, model_layout(job.model))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"save_s": time.monotonic() - t0}))
    dist.destroy_process_group()


@pytest.mark.integration
def test_the_commit_waits_for_a_slow_stage_writer(tmp_path, monkeypatch):
    """Stage 1's writer starts 2 s late: rank 0 (stage 0, which commits) must wait for it, and the
    manifest lists both stages' files, whose tensors are the seeded initial weights."""
    from spawn import spawn

    from sailor.runtime.model import initial_value

    monkeypatch.setenv("SAILOR_SLOW_WRITER", "1:2")
    spawn(_save_rank, 2, str(tmp_path / "store"), str(tmp_path / "ck"), str(tmp_path), timeout_s=120)
    assert json.loads((tmp_path / "rank0.json").read_text())["save_s"] >= 2.0
    path = ckpt.step_dir(tmp_path / "ck", 0)
    assert (path / "manifest.json").stat().st_mtime_ns >= (path / "rank-00001.json").stat().st_mtime_ns
    found = ckpt.find_latest(tmp_path / "ck")
    assert found.path == path
    assert {r: (v["stage"], v["data"]) for r, v in found.manifest["ranks"].items()} == {
        "0": (0, "rank-00000.bin"), "1": (1, "rank-00001.bin")}
    assert set(found.manifest["files"]) == {f"rank-0000{r}.{ext}" for r in range(2) for ext in ("bin", "json")}
    spec = JobSpec(model="tiny", global_batch_size=8).model
    layout = model_layout(spec)
    assert found.manifest["tensors"] == layout
    got = load_tensors(path, found.manifest, list(layout))
    for n, shape in layout.items():
        assert torch.equal(got[n]["param"], initial_value(spec, n, tuple(shape), seed=0)), n


def test_start_up_materialises_one_layer_at_a_time(monkeypatch):
    """ZeRO-3 on one rank: whenever the optimizer takes a layer over, the only weights allocated are
    that layer's (the layers before it were freed, the ones after it are still on the meta device)."""
    from sailor.runtime.zero import ShardedAdamW

    job = JobSpec(model="tiny", global_batch_size=8)
    plan = Plan.model_validate({"micro_batch_size": 2, "stages": [[0, 6]], "memory": [{"zero": 3}],
                                "pipelines": [{"microbatches": 4, "replicas": [
                                    {"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}]}]})
    seen = []
    adopt = ShardedAdamW.adopt

    def spy(self, layer, params=None, moments=None):
        allocated = {n for n, p in {**self.params, **(params or {})}.items()
                     if not p.is_meta and p.untyped_storage().nbytes() > 0}
        seen.append((layer, allocated == set(params or {}), len(allocated)))
        adopt(self, layer, params, moments)

    monkeypatch.setattr(ShardedAdamW, "adopt", spy)
    build_rank(plan, job, derive_topology(plan).roles[0], {}, device=torch.device("cpu"), seed=0)
    assert [layer for layer, _, _ in seen] == list(range(job.model.num_layers))
    assert all(only and n > 0 for _, only, n in seen), seen
