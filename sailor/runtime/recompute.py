"""Activation recomputation of a stage's transformer blocks (`StageMemory.recompute`).

Both modes go through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: the wrapped
function's forward keeps none of its intermediate tensors, only its inputs, and runs again inside the
backward pass when autograd first needs one of them.
- `full` (Chen et al. 2016, at block granularity): the whole forward of each of the stage's first
  `recompute_blocks` blocks (all of them when None) is checkpointed, so such a block keeps only its
  input (B, T, h).
- `selective` (Korthikanti et al. 2022, §5): the attention core of every block of the stage
  (`Attention.core`: rotary embedding, KV-head repetition, SDPA) is checkpointed; it keeps its q, k, v
  inputs and its output is kept by the output projection, while what SDPA saves for its backward
  (q, k, v after RoPE and repetition, the output, the log-sum-exp; the RoPE tables) is recomputed. The
  runtime's SDPA keeps no s x s score tensor in either case (memory-efficient attention), so the
  saving is smaller than the paper's 5·a·s/h term.

The model is not changed: the checkpointed method replaces the module's own method on that instance
(`forward` of a Block, `core` of an Attention), so parameter names and every hook stay as they are
(module hooks run outside the checkpoint; sequence-parallel entry and exit are not recomputed).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from sailor.model.spec import Recompute
from sailor.plan.spec import StageMemory
from sailor.runtime.model import Block


def stage_blocks(stage: nn.Module) -> list[tuple[int, Block]]:
    """The transformer blocks of a stage (a GPT with some layers deleted), by global layer index."""
    return [(int(i), m) for i, m in stage.layers.items() if isinstance(m, Block)]


def recomputed_blocks(stage: nn.Module, memory: StageMemory) -> list[int]:
    """Global indices of the blocks whose whole forward is recomputed under `memory`."""
    if memory.recompute is not Recompute.FULL:
        return []
    blocks = [i for i, _ in stage_blocks(stage)]
    return blocks if memory.recompute_blocks is None else blocks[:memory.recompute_blocks]


def apply_recompute(stage: nn.Module, memory: StageMemory) -> nn.Module:
    """Checkpoint `stage`'s blocks (or their attention cores) as `memory.recompute` says, in place;
    returns `stage`. Run after `apply_tp` (either order gives the same model)."""
    full = set(recomputed_blocks(stage, memory))
    for i, block in stage_blocks(stage):
        if i in full:
            _checkpoint_method(block, "forward")
        elif memory.recompute is Recompute.SELECTIVE:
            _checkpoint_method(block.attn, "core")
    return stage


def _checkpoint_method(module: nn.Module, method: str) -> None:
    run = getattr(module, method)  # the bound method of the class
    # Instance attribute: nn.Module.__call__ looks `forward` up on the instance first.
    object.__setattr__(module, method, functools.partial(checkpoint, run, use_reentrant=False))
