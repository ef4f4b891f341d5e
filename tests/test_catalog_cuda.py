"""CUDA device names -> catalog types, and the torch-build architecture check (torch-free)."""

import pytest

from sailor.catalog import gpu_names
from sailor.catalog.cuda import (
    BUILD_FOR_VOLTA,
    CAPABILITY,
    CUDA_NAMES,
    arch_supported,
    check_arch,
    gpu_type,
    unknown_message,
)

GIB = 2**30
MIB = 2**20

# (name the driver reports, total memory as nvidia-smi reports it in MiB, catalog type or None)
REAL = [
    ("Tesla V100-SXM2-16GB", 16160, "V100-16"),
    ("Tesla V100-SXM2-32GB", 32510, "V100-32"),
    ("Tesla V100-PCIE-32GB", 32510, "V100-32"),
    ("NVIDIA A100-SXM4-40GB", 40960, "A100-40"),
    ("NVIDIA A100-SXM4-80GB", 81920, "A100-80"),
    ("NVIDIA A100 80GB PCIe", 81920, "A100-80-PCIe"),
    ("NVIDIA H100 80GB HBM3", 81559, "H100-80"),
    ("NVIDIA H100 PCIe", 81559, "H100-PCIe"),
    ("NVIDIA H100 NVL", 95830, "H100-NVL"),
    ("NVIDIA H200", 143771, "H200-141"),
    ("NVIDIA GH200 480GB", 97871, "GH200-96"),
    ("NVIDIA GB200", 186e9 / MIB, "GB200-186"),  # 186 GB, the MLCommons system description's figure
    ("NVIDIA GB300", 256703, "GB300-279"),  # as nvidia-smi reports a DGX Station GB300
    ("NVIDIA L4", 23034, "L4"),
    ("Tesla T4", 15360, "T4"),
    ("NVIDIA GeForce RTX 3090", 24268, "RTX-3090"),
    ("NVIDIA GeForce RTX 2080 Ti", 11264, "RTX-2080"),
    ("NVIDIA TITAN RTX", 24220, "Titan-RTX"),
    # look-alikes that must not be taken for a catalog type
    ("NVIDIA L40S", 46068, None),
    ("NVIDIA L40", 46068, None),
    ("NVIDIA GH200 144G HBM3e", 145000, None),
    ("NVIDIA H200 NVL", 143771, None),
    ("NVIDIA A100-PCIE-40GB", 40960, None),
    ("NVIDIA GeForce RTX 2080", 8192, None),
    ("NVIDIA B200", 183359, None),
]


@pytest.mark.parametrize("name,mib,want", REAL)
def test_real_device_names_map_exactly(name, mib, want):
    assert gpu_type(name, mib * MIB) == want


def test_memory_separates_the_v100s_and_guards_a_mislabelled_card():
    assert gpu_type("Tesla V100-SXM2-16GB", 32 * GIB) is None
    assert "outside" in unknown_message("Tesla V100-SXM2-16GB", 32 * GIB)
    assert "not a catalog GPU type" in unknown_message("NVIDIA L40S", 45 * GIB)


def test_every_row_and_capability_names_a_catalog_type_and_every_gpu_type_is_covered():
    names = set(gpu_names())
    assert {r.gpu for r in CUDA_NAMES} <= names
    assert set(CAPABILITY) == {r.gpu for r in CUDA_NAMES} == names - {"cpu"}


def test_arch_rules():
    cuda13 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
    assert not arch_supported((7, 0), cuda13)           # Volta: dropped by CUDA 13
    assert arch_supported((7, 5), cuda13)
    assert arch_supported((8, 9), cuda13)               # sm_86 cubin runs on 8.9 (same major, higher minor)
    assert not arch_supported((8, 0), ["sm_86", "sm_90"])  # not on a lower minor
    assert arch_supported((9, 0), ["sm_80", "compute_80"])  # PTX JIT-compiled for a newer device
    assert not arch_supported((8, 0), ["sm_90a", "compute_90a"])  # arch-specific targets do not count
    assert arch_supported((7, 0), ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"])


def test_check_arch_names_the_build_to_install():
    assert check_arch((9, 0), ["sm_80", "sm_90"]) is None
    msg = check_arch((7, 0), ["sm_75", "sm_80"], "Tesla V100-SXM2-16GB")
    assert "sm_70" in msg and BUILD_FOR_VOLTA in msg and "\n" not in msg
    cu126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
    assert arch_supported(CAPABILITY["H100-80"], cu126) and not arch_supported(CAPABILITY["GB300-279"], cu126)
    blackwell = check_arch(CAPABILITY["GB200-186"], cu126, "NVIDIA GB200")
    assert "sm_100" in blackwell and "cu126" not in blackwell  # the cu126 build has no Blackwell kernels
    assert check_arch(CAPABILITY["GB300-279"], ["sm_90", "sm_100"]) is None  # sm_100 cubins run on 10.3
    assert "cu126" in BUILD_FOR_VOLTA
