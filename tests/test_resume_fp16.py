"""Resuming an fp16 run whose loss scaler skipped steps (issue #32 fp16): the optimizer goes on from
the optimizer steps taken (the checkpoint's step less the skipped ones), so the resumed run equals the
uninterrupted one; a checkpoint taken while every step so far was skipped (no Adam moments yet)
resumes too. One process, a 1-rank gloo group (the checkpoint writer's barriers need one)."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from sailor.core.errors import SailorInputError
from sailor.plan.spec import Plan
from sailor.runtime import checkpoint as ckpt
from sailor.runtime.checkpoint_io import Reader
from sailor.runtime.data import batch_tokens, load_corpus
from sailor.runtime.pipeline import P2P
from sailor.runtime.prepare import check_resumable
from sailor.runtime.scaler import LossScaler
from sailor.runtime.topology import derive_topology
from sailor.runtime.worker import build_rank, model_layout, save_checkpoint, train_step
from sailor.specs.job import JobSpec

TINY = JobSpec(model="tiny", global_batch_size=8)
PLAN = Plan.model_validate({"micro_batch_size": 2, "stages": [[0, TINY.model.num_layers]],
                            "pipelines": [{"microbatches": 4,
                                           "replicas": [{"stage": 0, "gpu": "cpu", "zone": "local", "tp": 1}]}]})
CPU = torch.device("cpu")
FP16 = torch.float16


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _step(rk, role, step: int, scaler: LossScaler) -> bool:
    tok = torch.from_numpy(batch_tokens(load_corpus(), seed=0, step=step, first=0, count=8, seq=TINY.seq))
    p2p = P2P(role, shape=(2, TINY.seq, TINY.model.hidden_size), device=CPU, timeout=timedelta(seconds=10), dtype=FP16)
    return train_step(rk, role, p2p, tok, mbs=2, loss_scale=1.0 / (8 * TINY.seq), scaler=scaler).skipped


def _resume(path, role, *, step: int):
    manifest = ckpt.read_manifest(path)
    reader = Reader(path, manifest)
    rk = build_rank(PLAN, TINY, role, {}, device=CPU, seed=0, reader=reader, step=step, dtype=FP16)
    reader.close()
    return rk, LossScaler(**manifest["loss_scaler"])


def test_resume_after_skipped_steps_equals_the_uninterrupted_run(world, tmp_path):
    role = derive_topology(PLAN).roles[0]
    rk = build_rank(PLAN, TINY, role, {}, device=CPU, seed=0, dtype=FP16)
    scaler = LossScaler(scale=2.0 ** 40)  # step 0 overflows and is skipped
    skipped = [_step(rk, role, 0, scaler)]
    scaler.scale = 2.0 ** 12  # the clean scale from here on
    skipped += [_step(rk, role, s, scaler) for s in (1, 2)]
    assert skipped == [True, False, False] and rk.optimizer.steps == 2
    meta = ckpt.run_meta(TINY, 0) | {"loss_scaler": scaler.state_dict()}
    path = save_checkpoint(tmp_path / "ck", 3, meta, rk.optimizer, role, CPU, model_layout(TINY.model))
    manifest = ckpt.read_manifest(path)
    assert ckpt.optimizer_steps(manifest) == 2 and manifest["keys"] == ["param", *ckpt.OPTIMIZER_KEYS]
    _step(rk, role, 3, scaler)  # the uninterrupted run's step 3
    want = torch.cat([m.clone() for m in rk.optimizer.master])

    rk2, scaler2 = _resume(path, role, step=ckpt.optimizer_steps(manifest))
    assert rk2.optimizer.steps == 2 and scaler2.skipped == 1
    _step(rk2, role, 3, scaler2)
    assert torch.equal(torch.cat(list(rk2.optimizer.master)), want)
    # what the worker did before: Adam went on from step 3, a bias correction the run never had
    rk3, scaler3 = _resume(path, role, step=manifest["step"])
    _step(rk3, role, 3, scaler3)
    assert not torch.equal(torch.cat(list(rk3.optimizer.master)), want)


def test_a_checkpoint_of_skipped_steps_only_resumes(world, tmp_path):
    """Every step so far overflowed: no optimizer step, no moments (keys ["param"]) at step 2. The
    launcher accepts it and the rank builds (it used to stop on `assert moments or step == 0`)."""
    role = derive_topology(PLAN).roles[0]
    rk = build_rank(PLAN, TINY, role, {}, device=CPU, seed=0, dtype=FP16)
    scaler = LossScaler(scale=2.0 ** 60)
    assert [_step(rk, role, s, scaler) for s in (0, 1)] == [True, True] and rk.optimizer.steps == 0
    meta = ckpt.run_meta(TINY, 0) | {"loss_scaler": scaler.state_dict()}
    path = save_checkpoint(tmp_path / "ck", 2, meta, rk.optimizer, role, CPU, model_layout(TINY.model))
    manifest = ckpt.read_manifest(path)
    assert manifest["keys"] == ["param"] and ckpt.optimizer_steps(manifest) == 0
    check_resumable(path, manifest)  # not "the weights alone": no optimizer step was taken
    rk2, _ = _resume(path, role, step=ckpt.optimizer_steps(manifest))
    assert rk2.optimizer.steps == 0
    with pytest.raises(SailorInputError, match="holds the weights alone"):
        check_resumable(path, manifest | {"loss_scaler": {"scale": 2.0 ** 58, "clean_steps": 0, "skipped": 1}})
