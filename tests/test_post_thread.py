"""The post thread (`runtime.post_thread`): calls run in submission order on one thread with its OS
name; `pipeline.P2P` on CPU posts every isend/irecv through it in the rank's program order, and what
posting raises, or a post that does not come, is raised in the rank (no process group: the torch
calls are replaced by recorders)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from sailor.plan.orders import BWD, FWD, Op
from sailor.plan.spec import Plan
from sailor.runtime import pipeline
from sailor.runtime.messages import op_receives, op_sends, plan_channels
from sailor.runtime.pipeline import P2P
from sailor.runtime.post_thread import (
    THREAD_NAME,
    PostThread,
    name_os_thread,
    shared_post_thread,
)
from sailor.runtime.topology import derive_topology
from sailor.testbed.cgroups import COMM_THREADS


def os_thread_name() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


def test_calls_run_in_submission_order_on_one_named_thread():
    thread = PostThread("sailor_test_post")
    try:
        seen = []
        futures = [thread.submit(lambda i: seen.append((i, threading.get_native_id(), os_thread_name())) or i * i, i)
                   for i in range(300)]
        assert [f.result(10) for f in futures] == [i * i for i in range(300)]
        assert [i for i, _, _ in seen] == list(range(300))
        assert {(tid, name) for _, tid, name in seen} == {(seen[0][1], "sailor_test_pos")}  # the kernel keeps 15 bytes
        assert seen[0][1] != threading.get_native_id()
        failed = thread.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failed.result(10)
        assert thread.submit(lambda: "still running").result(10) == "still running"
    finally:
        thread.close()
    with pytest.raises(RuntimeError, match="has ended"):
        thread.submit(print)


def test_the_shared_thread_is_one_per_process_and_a_testbed_communication_thread():
    assert shared_post_thread() is shared_post_thread()
    assert THREAD_NAME.startswith(COMM_THREADS) and len(THREAD_NAME.encode()) <= 15
    assert shared_post_thread().submit(os_thread_name).result(10) == THREAD_NAME

    def rename() -> tuple[bool, str]:
        return name_os_thread("renamed_thread_xyz"), os_thread_name()
    t = PostThread("x")
    assert t.submit(rename).result(10) == (True, "renamed_thread_")
    t.close()


class _Done:
    """The Work of a transfer that completed."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


def _two_stage_role():
    """Rank 0 of a 2-stage pipeline, stage 0 at TP 1 feeding stage 1 at TP 2 (ranks 1, 2): it sends
    each half of an activation to one rank and receives each half of the gradient from one."""
    rep = {"gpu": "cpu", "zone": "local"}
    plan = Plan.model_validate({"micro_batch_size": 1, "stages": [[0, 1], [1, 2]], "pipelines": [
        {"microbatches": 2, "replicas": [{"stage": 0, "tp": 1, **rep}, {"stage": 1, "tp": 2, **rep}]}]})
    topo = derive_topology(plan)
    return topo.roles[0], {ch: f"group {ch.src}->{ch.dst} {ch.kind}" for ch in plan_channels(topo)}


def test_p2p_on_cpu_posts_every_transfer_from_the_post_thread_in_program_order(monkeypatch):
    role, channels = _two_stage_role()
    calls = []

    def recorder(kind):
        def post(tensor, peer, group=None):
            calls.append((kind, peer, group, tensor.clone(), os_thread_name()))
            return _Done()
        return post
    monkeypatch.setattr(pipeline.dist, "isend", recorder("isend"))
    monkeypatch.setattr(pipeline.dist, "irecv", recorder("irecv"))
    B, T, h = 1, 2, 4
    p2p = P2P(role, shape=(B, T, h), device=torch.device("cpu"), timeout=timedelta(seconds=10), channels=channels)
    xs = [torch.arange(8.0).view(B, T, h) + 100 * k for k in range(2)]
    for k in range(2):  # forwards F0, F1 send; backwards B0, B1 receive
        p2p.send(xs[k], op_sends(role, Op(FWD, 0, k)))
    for k in range(2):
        for t in op_receives(role, Op(BWD, 0, k)):
            p2p.post(t)
    for k in range(2):
        p2p.receive(op_receives(role, Op(BWD, 0, k)))
    p2p.finish()
    assert {name for *_, name in calls} == {THREAD_NAME}
    assert [(kind, peer, group) for kind, peer, group, _, _ in calls] == [
        ("isend", 1, "group 0->1 activation"), ("isend", 2, "group 0->2 activation")] * 2 + [
        ("irecv", 1, "group 1->0 gradient"), ("irecv", 2, "group 2->0 gradient")] * 2
    for k in range(2):  # the sequence-major (T, B, h) activation, cut in halves by TP rank
        flat = xs[k].transpose(0, 1).reshape(-1)
        assert torch.equal(calls[2 * k][3], flat[:4]) and torch.equal(calls[2 * k + 1][3], flat[4:])
    assert p2p.sent == {"activation": 2 * 8 * 4} and not p2p.pending


def test_p2p_raises_what_posting_raised_and_a_post_that_never_comes(monkeypatch):
    role, channels = _two_stage_role()
    sends = op_sends(role, Op(FWD, 0, 0))
    x = torch.zeros(1, 2, 4)

    def broken(tensor, peer, group=None):
        raise RuntimeError(f"connection to rank {peer} reset")
    monkeypatch.setattr(pipeline.dist, "isend", broken)
    p2p = P2P(role, shape=(1, 2, 4), device=torch.device("cpu"), timeout=timedelta(seconds=10), channels=channels)
    p2p.send(x, sends)
    with pytest.raises(RuntimeError, match="connection to rank 1 reset"):
        p2p.finish()

    release = threading.Event()

    def stuck(tensor, peer, group=None):
        release.wait(30)
        return _Done()
    monkeypatch.setattr(pipeline.dist, "isend", stuck)
    p2p = P2P(role, shape=(1, 2, 4), device=torch.device("cpu"), timeout=timedelta(seconds=0.2), channels=channels)
    try:
        p2p.send(x, sends)
        with pytest.raises(TimeoutError, match="rank 0: the post thread posted no transfer within"):
            p2p.finish()
    finally:
        release.set()  # frees the process's post thread for the tests after this one
    assert shared_post_thread().submit(lambda: "free").result(10) == "free"
