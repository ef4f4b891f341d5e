"""runtime.device (identity, arch check at start-up) and runtime.timing on this CPU machine; the CUDA
queries are stood in for with the strings a real driver reports."""

import time
from types import SimpleNamespace

import pytest
import torch

from sailor.core.errors import SailorInputError
from sailor.runtime import device as dev
from sailor.runtime.timing import PhaseClock, Stopwatch

CUDA13_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


def _fake_cuda(monkeypatch, name: str, mib: int, cc: tuple[int, int], archs: list[str], count: int = 1):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(total_memory=mib * 2**20))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: cc)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: archs)
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    return made_current


def test_v100_under_the_cuda13_wheel_is_refused_in_one_line(monkeypatch):
    _fake_cuda(monkeypatch, "Tesla V100-SXM2-16GB", 16160, (7, 0), CUDA13_ARCHS)
    with pytest.raises(SailorInputError) as e:
        dev.rank_device("cuda", 0)
    line = str(e.value)
    assert "sm_70" in line and "download.pytorch.org/whl/cu126" in line and "\n" not in line


def test_h100_under_the_cuda13_wheel_starts_on_its_local_rank(monkeypatch, tmp_path):
    made_current = _fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3", 81559, (9, 0), CUDA13_ARCHS, count=8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dev.rank_device("cuda") == torch.device("cuda", 3) and made_current == [torch.device("cuda", 3)]
    assert dev.device_gpu_type("cuda") == "H100-80"
    with pytest.raises(SailorInputError, match="local rank 8 needs CUDA device 8"):
        dev.rank_device("cuda", 8)


def test_unknown_and_look_alike_devices_are_named(monkeypatch):
    _fake_cuda(monkeypatch, "NVIDIA GH200 480GB", 97871, (9, 0), CUDA13_ARCHS)
    assert dev.device_gpu_type("cuda") == "GH200-96"  # not H200-141
    _fake_cuda(monkeypatch, "NVIDIA L40S", 46068, (8, 9), CUDA13_ARCHS)
    with pytest.raises(SailorInputError, match="'NVIDIA L40S'.*not a catalog GPU type"):
        dev.device_gpu_type("cuda")


def test_no_cuda_is_an_input_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SailorInputError, match="no CUDA device"):
        dev.rank_device("cuda")
    assert dev.rank_device("cpu") == torch.device("cpu") and dev.device_gpu_type("cpu") == "cpu"


def test_phase_clock_sums_host_spans_on_cpu():
    clock = PhaseClock(torch.device("cpu"))
    a = clock.mark()
    time.sleep(0.02)
    b = clock.mark()
    time.sleep(0.01)
    c = clock.mark()
    clock.add("wait_s", a, b)
    clock.add("forward_s", b, c)
    clock.add("wait_s", c, c)
    got = clock.totals()
    assert set(got) == {"wait_s", "forward_s"}
    assert got["wait_s"] == pytest.approx(b - a) and got["forward_s"] == pytest.approx(c - b)
    assert got["wait_s"] >= 0.02 and got["forward_s"] >= 0.01
    watch = Stopwatch(torch.device("cpu"))
    watch.start()
    time.sleep(0.01)
    assert 0.01 <= watch.stop() < 1.0
