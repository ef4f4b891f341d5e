"""The device a rank computes on, what it is in the catalog, and whether the installed torch runs it.

`rank_device("cuda")` is the CUDA device of torchrun's LOCAL_RANK, made current, after
`check_cuda_arch`: the installed torch must carry kernels for the device's compute capability
(`torch.cuda.get_arch_list()` against `torch.cuda.get_device_capability()`, rules in
`sailor.catalog.cuda`), else start-up stops with one line naming the torch build to install. Without
this check a V100 under the CUDA 13 wheel of PyPI fails at its first kernel with "no kernel image is
available for execution on the device", after the process groups formed.

`device_gpu_type` names a device's catalog type exactly (`sailor.catalog.cuda.gpu_type`: the whole
driver name and the memory band), for profiles and checks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from sailor.catalog.cuda import check_arch, gpu_type, unknown_message
from sailor.core.errors import SailorInputError

Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class CudaIdentity:
    """What the driver reports for one CUDA device."""

    index: int
    name: str
    total_memory: int  # bytes
    capability: tuple[int, int]

    @property
    def gpu(self) -> str | None:
        """The catalog type, or None (`sailor.catalog.cuda.gpu_type`)."""
        return gpu_type(self.name, self.total_memory)


def cuda_identity(index: int = 0) -> CudaIdentity:
    """Name, memory and compute capability of CUDA device `index`."""
    props = torch.cuda.get_device_properties(index)
    return CudaIdentity(index=index, name=torch.cuda.get_device_name(index), total_memory=int(props.total_memory),
                        capability=tuple(torch.cuda.get_device_capability(index)))  # type: ignore[arg-type]


def require_cuda(field: str = "--device") -> None:
    """Raise SailorInputError when this machine has no usable CUDA device."""
    if not torch.cuda.is_available():
        raise SailorInputError("no CUDA device on this machine (or this torch is a CPU build)", field=field,
                               fix="use --device cpu, or install a CUDA build of torch (README \"GPU\")")


def check_cuda_arch(index: int = 0) -> None:
    """Raise SailorInputError (one line, naming the torch build to install) when the installed torch
    has no kernels for CUDA device `index` (module docstring)."""
    ident = cuda_identity(index)
    problem = check_arch(ident.capability, list(torch.cuda.get_arch_list()), ident.name)
    if problem is not None:
        raise SailorInputError(problem, field="--device")


def rank_device(kind: Device, local_rank: int | None = None) -> torch.device:
    """The device of this rank: the CPU, or CUDA device `local_rank` (default $LOCAL_RANK, else 0)
    made current after `check_cuda_arch`. Raises SailorInputError as `require_cuda` and
    `check_cuda_arch` do, or when there are fewer devices than local_rank + 1."""
    if kind == "cpu":
        return torch.device("cpu")
    require_cuda()
    index = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    if index >= torch.cuda.device_count():
        raise SailorInputError(f"local rank {index} needs CUDA device {index}; this machine has"
                               f" {torch.cuda.device_count()}", field="--device",
                               fix="start at most one rank per GPU on each machine")
    check_cuda_arch(index)
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def device_gpu_type(device: Device, index: int = 0) -> str:
    """Catalog GPU type of this machine's `device`: "cpu", or the CUDA device's exact catalog type.

    Raises SailorInputError when CUDA is asked for and absent, or its device is not a catalog type.
    """
    if device == "cpu":
        return "cpu"
    require_cuda()
    ident = cuda_identity(index)
    gpu = ident.gpu
    if gpu is None:
        raise SailorInputError(unknown_message(ident.name, ident.total_memory), field="--device",
                               fix="add the device to sailor/catalog/cuda.py and its type to gpus.yaml")
    return gpu


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
