"""Node keys computed on a second core (`planner.aside`): the same keys, plans and search as serial.

The integration tests lower ASIDE_MIN_POOLS so that a small cluster (40 GPUs, heuristic mode)
forks the child; the unit test checks that below it no process is started (tests/conftest.py
refuses a fork in the unit tier)."""

from __future__ import annotations

import os
import time

import pytest

from sailor.planner import PlanOptions, aside, plan_job
from sailor.planner.finalists import plan_signature
from sailor.planner.prune import node_keys
from sailor.simulator import make_context
from sailor.specs.cluster import ClusterSpec
from sailor.specs.job import JobSpec

ZONES = ["us-central1-a", "us-central1-b", "us-west1-a", "europe-west4-a"]
JOB = JobSpec(model="opt-350m", global_batch_size=64)
# 4 zones x 2 GPU types: 8 pools, 80 GPUs (beyond exact mode), one zone with a slower link of its own
CLUSTER = ClusterSpec(zones={z: {"A100-40": 12, "V100-16": 8} for z in ZONES},
                      gpus_per_node={"A100-40": 4, "V100-16": 4},
                      zone_network={ZONES[1]: {"same_zone": {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9}}})
OPTS = PlanOptions(max_stages=6, max_mbs=4)


def _children() -> list[int]:
    """Process ids whose parent is this process (from /proc)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    out.append(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _result() -> tuple:
    r = plan_job(make_context(JOB, CLUSTER, calibration={}), OPTS)
    return (plan_signature(r.plan), r.estimate.iteration_time_s, r.estimate.cost_per_iteration_usd,
            [plan_signature(c.plan) for c in r.alternatives], r.candidates, r.points, r.pareto, r.exact)


def test_below_the_threshold_the_keys_are_the_serial_ones_and_no_process_starts():
    ctx = make_context(JOB, CLUSTER, calibration={})
    nodes = node_keys(ctx, OPTS, exact_mode=False)
    with aside.keys_aside(nodes, pools=aside.ASIDE_MIN_POOLS - 1) as got:
        assert got is nodes
    exact = node_keys(ctx, OPTS, exact_mode=True)
    with aside.keys_aside(exact, pools=aside.ASIDE_MIN_POOLS) as got:
        assert got is exact


@pytest.mark.integration
def test_every_key_the_child_sends_is_the_serial_key():
    ctx = make_context(JOB, CLUSTER, calibration={})
    nodes = node_keys(ctx, OPTS, exact_mode=False)
    with aside.keys_aside(nodes, pools=aside.ASIDE_MIN_POOLS) as got:
        assert isinstance(got, aside.AsideKeys)
        end = time.monotonic() + 120
        while got._read_fd >= 0 and time.monotonic() < end:  # until the child has sent them all
            got._drain()
            time.sleep(0.01)
        assert got._read_fd < 0
        sent = dict(got._keys)
    assert not _children()
    assert len(sent) == len(nodes.bounds) > 10
    serial = node_keys(make_context(JOB, CLUSTER, calibration={}), OPTS, exact_mode=False)
    assert sent == {(P, mbs): serial.key(bound, P, mbs) for bound, P, mbs in serial.bounds}
    assert any(k[0] > b[0] for (b, P, mbs), k in zip(serial.bounds, (sent[(P, mbs)] for _, P, mbs in serial.bounds)))


@pytest.mark.integration
def test_the_search_with_keys_aside_is_the_serial_search(monkeypatch):
    serial = _result()
    assert not serial[-1]  # heuristic mode: node estimates in the keys
    monkeypatch.setattr(aside, "ASIDE_MIN_POOLS", 1)
    forks = []
    fork = os.fork

    def counted():
        forks.append(1)
        return fork()
    monkeypatch.setattr(os, "fork", counted)
    assert _result() == serial
    assert forks == [1]
    assert not _children()  # the child was waited for
