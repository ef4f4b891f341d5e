"""One stage's forward and backward of a micro-batch, layer by layer, with the optimizer's layer hooks.

Forward of micro-batch k, for each layer l of the stage in order: `hooks.before_forward(l)`, then
out_l = layer(in_l), then `hooks.after_forward(l)`. in_l is the stage input for the first layer
(token ids or the received activation) and out_{l-1} detached, requiring grad, for the others; the
last stage applies the loss inside its last layer's step. Backward of k, for each layer in reverse:
`hooks.before_backward(l)`, autograd backward from out_l with the gradient of the next layer's input,
`hooks.after_backward(l)`. Cutting the graph between layers costs no memory (in_l shares the storage
of out_{l-1}) and fixes the order of every collective the hooks issue (ZeRO-3 gathers, ZeRO-2/3
reduce-scatters, `runtime.zero`) to the layer order on every rank: inside one autograd graph the
order of such hooks could differ between replicas of different TP degrees, whose graphs differ.

`skip_forward` / `skip_backward` run only the hooks: a round of the 1F1B schedule for which this
pipeline has no micro-batch (uneven shares) still joins its stage's ZeRO collectives.

`ActivationMeter` measures the bytes a micro-batch keeps until its backward, per layer: the distinct
storages autograd saves during the layer's forward (`torch.autograd.graph.saved_tensors_hooks`;
parameters excluded), plus the tensors the executor itself keeps (each layer's input and output),
each storage counted once, for the first layer that keeps it. Tensors saved inside a checkpointed
region are not kept and not seen (the checkpoint's own hooks take them); its inputs are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch
from torch import nn


class LayerHooks(Protocol):
    """What the executor calls around each layer (implemented by `zero.ShardedAdamW`)."""

    def before_forward(self, layer: int) -> None: ...
    def after_forward(self, layer: int) -> None: ...
    def before_backward(self, layer: int) -> None: ...
    def after_backward(self, layer: int) -> None: ...


class NoHooks:
    """Layer hooks that do nothing (a stage whose parameters need no gathering, e.g. the profiler's)."""

    def before_forward(self, layer: int) -> None:
        pass

    after_forward = before_backward = after_backward = before_forward


class ActivationMeter:
    """Bytes kept for backward by one micro-batch, per global layer index (module docstring)."""

    def __init__(self) -> None:
        self.per_layer: dict[int, int] = {}
        self._seen: set[int] = set()

    def keep(self, layer: int, t: torch.Tensor | None) -> None:
        """Count `t`'s storage for `layer` unless already counted."""
        if t is None:
            return
        s = t.untyped_storage()
        self.per_layer.setdefault(layer, 0)
        if s.nbytes() and s.data_ptr() not in self._seen:
            self._seen.add(s.data_ptr())
            self.per_layer[layer] += s.nbytes()

    @contextlib.contextmanager
    def saving(self, layer: int, params: Iterable[nn.Parameter]) -> Iterator[None]:
        """Count what autograd saves inside the block, except the storages of `params`."""
        weights = {p.untyped_storage().data_ptr() for p in params}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in weights:
                self.keep(layer, t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


class StageExecutor:
    """Forward and backward of one stage, a micro-batch at a time (module docstring).

    Args:
        stage: the stage (a GPT with the other layers deleted, TP and recomputation applied).
        hooks: the optimizer's layer hooks.
        first_stage: the stage input is token ids (no gradient to send back).
    """

    def __init__(self, stage: nn.Module, hooks: LayerHooks, *, first_stage: bool) -> None:
        self.layers = [(int(i), m) for i, m in stage.layers.items()]
        self.hooks, self.first_stage = hooks, first_stage
        self.saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # k -> [(in_l, out_l)]

    def forward(self, k: int, x: torch.Tensor, *, loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                meter: ActivationMeter | None = None) -> torch.Tensor:
        """Micro-batch `k`'s forward from stage input `x`; returns the stage output, or `loss(logits)`
        on the last stage (given there). `meter` measures what this micro-batch keeps."""
        kept = []
        if not self.first_stage:
            x.requires_grad_()
        for n, (index, layer) in enumerate(self.layers):
            inp = x if n == 0 else x.detach().requires_grad_()
            self.hooks.before_forward(index)
            with meter.saving(index, layer.parameters()) if meter else contextlib.nullcontext():
                out = layer(inp)
                if loss is not None and n == len(self.layers) - 1:
                    out = loss(out)
            self.hooks.after_forward(index)
            kept.append((inp, out))
            x = out
        if meter:
            for (index, _), (inp, out) in zip(self.layers, kept):
                meter.keep(index, inp)
                meter.keep(index, out)
        self.saved[k] = kept
        return x

    def backward(self, k: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Micro-batch `k`'s backward from the gradient of the stage output (None: the output is the
        loss); returns the gradient of the stage input (None on the first stage)."""
        kept = self.saved.pop(k)
        for (index, _), (inp, out) in zip(reversed(self.layers), reversed(kept)):
            self.hooks.before_backward(index)
            torch.autograd.backward(out, grad)
            grad = inp.grad if inp.requires_grad else None
            self.hooks.after_backward(index)
        return grad

    def skip_forward(self) -> None:
        for index, _ in self.layers:
            self.hooks.before_forward(index)
            self.hooks.after_forward(index)

    def skip_backward(self) -> None:
        for index, _ in reversed(self.layers):
            self.hooks.before_backward(index)
            self.hooks.after_backward(index)
