"""CUDA devices as the catalog names them, and which torch builds can run them (no torch import).

`gpu_type(name, total_memory)` maps what the CUDA driver reports for a device
(`torch.cuda.get_device_name`, `torch.cuda.get_device_properties(i).total_memory`) to exactly one
catalog type (`sailor/catalog/gpus.yaml`), or None. Matching is on the whole name, not a substring:
"NVIDIA GH200 480GB" is not an H200, "NVIDIA L40S" is not an L4, "NVIDIA H100 PCIe" is not the SXM
H100-80, and the memory the driver reports must lie in the row's band, which separates the 16 and
32 GB V100s and keeps a card of another memory size (the GH200 with 144 GB HBM3e, an H100 94 GB
SXM) out of a type it is not. The names are the strings the driver reports (the product names
`nvidia-smi --query-gpu=name` prints, which `torch.cuda.get_device_name` returns); the bands are a
few per cent around the datasheet capacity, as the driver reports a little less (ECC, reserved
memory) or, for HBM3e parts, a little more in GiB than the datasheet's GB.

`check_arch(capability, arch_list)` says whether a torch build whose kernels are `arch_list`
(`torch.cuda.get_arch_list()`, e.g. ["sm_75", "sm_80", "sm_90", "compute_90"]) runs on a device of
compute capability `capability` (major, minor), and if not, which build to install. The rules
(NVIDIA CUDA C++ Programming Guide, "Binary Compatibility" and "PTX Compatibility"): a cubin for
sm_XY runs on devices of the same major version X and minor >= Y; PTX for compute_XY is compiled
by the driver for any device of capability >= X.Y; arch-specific targets (sm_90a, sm_100f) run only
on their own architecture and are not counted for others.

Which torch build covers which GPU (sources: NVIDIA CUDA 13.0 release notes, "Deprecated or Dropped
Features": offline compilation and library support for Maxwell, Pascal and Volta (sm_50 to sm_72)
is removed, and CUDA 13 needs driver 580 or newer; PyTorch's install matrix,
https://pytorch.org/get-started/locally/ and https://download.pytorch.org/whl/): the default
Linux wheel of torch 2.13 on PyPI is built with CUDA 13, so it runs Turing and newer (sm_75+) with
driver >= 580 and cannot run a V100; the CUDA 12.6 wheels on PyTorch's own index (cu126) still carry
sm_70 kernels and run every catalog GPU up to Hopper (driver >= 560); Blackwell (GB200 10.0, GB300
10.3) needs CUDA 12.8 or newer (CUDA 12.8 release notes), so only the CUDA 13 wheel, whose sm_100
cubins run on 10.x. `BUILD_FOR_VOLTA` is that install line.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30

TORCH_VERSION = "2.13.0"
CU126_INDEX = "https://download.pytorch.org/whl/cu126"
BUILD_FOR_VOLTA = f"pip install torch=={TORCH_VERSION} --index-url {CU126_INDEX}"
BUILD_DEFAULT = f"pip install torch=={TORCH_VERSION}"
CUDA13_MIN_CAPABILITY = (7, 5)  # CUDA 13 dropped sm_50..sm_72 (release notes, module docstring)
CUDA13_MIN_DRIVER = 580
CU126_MAX_CAPABILITY = (9, 0)  # Blackwell (sm_100) needs CUDA 12.8 or newer (CUDA 12.8 release notes)


@dataclass(frozen=True)
class CudaName:
    """One device name the driver reports, the catalog type it is, and the memory band (GiB,
    inclusive) that `total_memory` must lie in for the match."""

    name: str
    gpu: str
    min_gib: float
    max_gib: float


# Names as the NVIDIA driver reports them (nvidia-smi / cudaGetDeviceProperties), one row each.
CUDA_NAMES: tuple[CudaName, ...] = (
    CudaName("Tesla V100-SXM2-16GB", "V100-16", 14.5, 16.5),
    CudaName("Tesla V100-PCIE-16GB", "V100-16", 14.5, 16.5),
    CudaName("Tesla V100-SXM2-32GB", "V100-32", 30.0, 32.5),
    CudaName("Tesla V100-PCIE-32GB", "V100-32", 30.0, 32.5),
    CudaName("Tesla V100-SXM3-32GB", "V100-32", 30.0, 32.5),
    CudaName("NVIDIA A100-SXM4-40GB", "A100-40", 38.0, 40.5),
    CudaName("NVIDIA A100-SXM4-80GB", "A100-80", 76.0, 80.5),
    CudaName("NVIDIA A100 80GB PCIe", "A100-80-PCIe", 76.0, 80.5),
    CudaName("NVIDIA H100 80GB HBM3", "H100-80", 76.0, 80.5),
    CudaName("NVIDIA H100 PCIe", "H100-PCIe", 76.0, 80.5),
    CudaName("NVIDIA H100 NVL", "H100-NVL", 87.0, 95.0),
    CudaName("NVIDIA H200", "H200-141", 130.0, 141.0),
    CudaName("NVIDIA GH200 480GB", "GH200-96", 90.0, 96.5),
    # Blackwell: bands below the datasheet's HBM (GB300: 288 GB of stacks, 279 GB in NVIDIA's rack figure;
    # a DGX Station GB300 reports 256,703 MiB = 250.7 GiB), as the driver reserves more on these parts.
    CudaName("NVIDIA GB200", "GB200-186", 170.0, 186.0),
    CudaName("NVIDIA GB300", "GB300-279", 245.0, 280.0),
    CudaName("NVIDIA L4", "L4", 21.0, 23.0),
    CudaName("Tesla T4", "T4", 14.5, 16.0),
    CudaName("NVIDIA GeForce RTX 3090", "RTX-3090", 23.0, 24.5),
    CudaName("NVIDIA GeForce RTX 2080 Ti", "RTX-2080", 10.5, 11.5),
    CudaName("NVIDIA TITAN RTX", "Titan-RTX", 23.0, 24.5),
)

# Compute capability of each catalog type (NVIDIA, "CUDA GPUs - Compute Capability",
# https://developer.nvidia.com/cuda-gpus): Volta 7.0, Turing 7.5, Ampere 8.0 / 8.6, Ada 8.9, Hopper 9.0,
# Blackwell GB200 10.0, Blackwell Ultra GB300 10.3.
CAPABILITY: dict[str, tuple[int, int]] = {
    "V100-16": (7, 0), "V100-32": (7, 0), "T4": (7, 5), "RTX-2080": (7, 5), "Titan-RTX": (7, 5),
    "A100-40": (8, 0), "A100-80": (8, 0), "A100-80-PCIe": (8, 0), "RTX-3090": (8, 6), "L4": (8, 9),
    "H100-80": (9, 0), "H100-PCIe": (9, 0), "H100-NVL": (9, 0), "H200-141": (9, 0), "GH200-96": (9, 0),
    "GB200-186": (10, 0), "GB300-279": (10, 3),
}


def _norm(name: str) -> str:
    return " ".join(name.split()).casefold()


def gpu_type(name: str, total_memory: int) -> str | None:
    """The catalog type of a CUDA device reported as `name` with `total_memory` bytes, or None when
    no row matches both (module docstring)."""
    gib = total_memory / GIB
    for row in CUDA_NAMES:
        if _norm(row.name) == _norm(name) and row.min_gib <= gib <= row.max_gib:
            return row.gpu
    return None


def unknown_message(name: str, total_memory: int) -> str:
    """One line saying why a device is not a catalog type, naming a same-named row of other memory."""
    same = [r for r in CUDA_NAMES if _norm(r.name) == _norm(name)]
    if same:
        r = same[0]
        return (f"CUDA device {name!r} reports {total_memory / GIB:.1f} GiB, outside the {r.min_gib}-{r.max_gib}"
                f" GiB of catalog type {r.gpu}; it is not a catalog GPU type")
    return (f"CUDA device {name!r} ({total_memory / GIB:.1f} GiB) is not a catalog GPU type"
            " (sailor/catalog/cuda.py lists the device names each type matches)")


def _sm(entry: str) -> tuple[str, int, int] | None:
    """("sm" | "compute", major, minor) of an arch list entry such as "sm_86" or "compute_90";
    None for arch-specific targets ("sm_90a", "sm_100f") and anything else."""
    kind, _, digits = entry.partition("_")
    if kind not in ("sm", "compute") or not digits.isdigit() or len(digits) < 2:
        return None
    return kind, int(digits[:-1]), int(digits[-1])


def arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether kernels listed in `arch_list` run on a device of `capability` (module docstring)."""
    major, minor = capability
    for entry in arch_list:
        parsed = _sm(entry)
        if parsed is None:
            continue
        kind, x, y = parsed
        if kind == "sm" and x == major and y <= minor:
            return True
        if kind == "compute" and (x, y) <= (major, minor):
            return True
    return False


def build_for(capability: tuple[int, int]) -> str:
    """The torch install line for a device of `capability` (module docstring)."""
    if capability < CUDA13_MIN_CAPABILITY:
        return BUILD_FOR_VOLTA
    if capability > CU126_MAX_CAPABILITY:
        return f"{BUILD_DEFAULT} (CUDA 13, driver >= {CUDA13_MIN_DRIVER})"
    return f"{BUILD_DEFAULT} (CUDA 13, driver >= {CUDA13_MIN_DRIVER}; or {BUILD_FOR_VOLTA} for older drivers)"


def check_arch(capability: tuple[int, int], arch_list: list[str], device_name: str = "the CUDA device") -> str | None:
    """None when the build runs on the device; else one line saying why not and what to install."""
    if arch_supported(capability, arch_list):
        return None
    cc = f"sm_{capability[0]}{capability[1]}"
    return (f"the installed torch has no kernels for {device_name} ({cc}; it has {' '.join(arch_list) or 'none'});"
            f" install a build that does: {build_for(capability)}")
