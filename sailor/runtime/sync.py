"""Host barriers that block until every member has arrived.

Under NCCL a collective returns once it is queued on the device stream (torch.distributed docs,
"Synchronous and asynchronous collective operations": for CUDA collectives "the function call returns
... the collective is enqueued"), so an all-reduce alone does not make the host wait for the other
ranks. `barrier` all-reduces a one-element tensor and reads it back with `.item()`: the copy to the
host waits for the collective on the device (torch docs, `Tensor.item`: a device-to-host copy, which
synchronizes), so no rank returns before every member has called it. Under gloo the all-reduce
itself blocks; the read-back also checks the count. Used where the host must wait for the others:
the checkpoint commit (every rank's files are on disk), the end of start-up and shutdown.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sailor.core.errors import counted


def barrier(device: torch.device, group=None) -> None:
    """Block until every rank of `group` (default: the world) has called it.

    Args:
        device: this rank's device (the tensor must live where the group's backend runs: CUDA for NCCL).
        group: a process group; None for the world.

    Raises:
        RuntimeError: the members did not all contribute (the sum read back is not the group size).
    """
    one = torch.ones(1, dtype=torch.int32, device=device)
    dist.all_reduce(one, group=group)
    got, want = int(one.item()), dist.get_world_size(group)
    if got != want:
        raise RuntimeError(f"barrier: {got} of {counted(want, 'rank')} arrived")
