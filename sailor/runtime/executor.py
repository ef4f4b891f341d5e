"""One stage's forward and backward of a micro-batch, layer by layer, with the optimizer's layer hooks.

Forward of micro-batch k, for each layer l of the stage in order: `hooks.before_forward(l, next)`, then
out_l = layer(in_l), then `hooks.after_forward(l)`. in_l is the stage input for the first layer
(token ids or the received activation) and out_{l-1} detached, requiring grad, for the others; the
last stage applies the loss inside its last layer's step. Backward of k, for each layer in reverse:
`hooks.before_backward(l, next)`, autograd backward from out_l with the gradient of the next layer's
input, `hooks.after_backward(l)`. `next` is the layer the same pass runs after l (None after its last),
so that the hooks may start fetching it (the ZeRO-3 prefetch, `runtime.zero`). Cutting the graph between layers costs no memory (in_l shares the storage
of out_{l-1}) and fixes the order of every collective the hooks issue (ZeRO-3 gathers, ZeRO-2/3
reduce-scatters, `runtime.zero`) to the layer order on every rank: inside one autograd graph the
order of such hooks could differ between replicas of different TP degrees, whose graphs differ.

Split backward (zero-bubble schedules, `backward_input` then `backward_weight`): per layer in
reverse, `hooks.before_backward(l)` and the input-gradient pass (`torch.distributed.pipelining`'s
`stage_backward_input`: the gradient of the layer's input only, keeping the graph and the gradients
that reach the weights' operations), and later, per layer in the same order, the weight-gradient
pass from those (`stage_backward_weight`) and `hooks.after_backward(l)`: the hooks see a layer's
gradients when they exist, after its W pass. The embedding's input is token ids, so its input pass
is empty and its whole backward runs as its weight pass. The profiler times the two passes the same
way (`runtime.profile_measure`).

`skip_forward` / `skip_backward` / `skip_weight` run only the hooks: a round of the schedule for
which this pipeline has no micro-batch (uneven shares) still joins its stage's ZeRO collectives.

Under interleaved 1F1B a rank holds several chunks of non-contiguous layers: one executor per chunk
(`layers`), all sharing the rank's stage module and optimizer hooks.

`ActivationMeter` measures the bytes a micro-batch keeps until its backward, per layer: the distinct
storages autograd saves during the layer's forward (`torch.autograd.graph.saved_tensors_hooks`;
parameters excluded), plus the tensors the executor itself keeps (each layer's input and output),
each storage counted once, for the first layer that keeps it. Tensors saved inside a checkpointed
region are not kept and not seen (the checkpoint's own hooks take them); its inputs are.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch
from torch import nn


class LayerHooks(Protocol):
    """What the executor calls around each layer (implemented by `zero.ShardedAdamW`)."""

    def before_forward(self, layer: int, upcoming: int | None = None) -> None: ...
    def after_forward(self, layer: int) -> None: ...
    def before_backward(self, layer: int, upcoming: int | None = None) -> None: ...
    def after_backward(self, layer: int) -> None: ...


class NoHooks:
    """Layer hooks that do nothing (a stage whose parameters need no gathering, e.g. the profiler's)."""

    def before_forward(self, layer: int, upcoming: int | None = None) -> None:
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
    """Forward and backward of one stage, or one chunk of it, a micro-batch at a time (module
    docstring).

    Args:
        stage: the stage (a GPT with the other layers deleted, TP and recomputation applied).
        hooks: the optimizer's layer hooks.
        first_stage: the input is token ids (no gradient to send back).
        layers: the half-open layer range this executor runs (one chunk of the stage); None: all of
            the stage's layers.
    """

    def __init__(self, stage: nn.Module, hooks: LayerHooks, *, first_stage: bool,
                 layers: tuple[int, int] | None = None) -> None:
        self.layers = [(int(i), m) for i, m in stage.layers.items() if layers is None or layers[0] <= int(i) < layers[1]]
        self.hooks, self.first_stage = hooks, first_stage
        self.saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # k -> [(in_l, out_l)]
        self.weight_passes: dict[int, list[Callable[[], None]]] = {}  # k -> its W pass, layer by layer

    def forward(self, k: int, x: torch.Tensor, *, loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                meter: ActivationMeter | None = None) -> torch.Tensor:
        """Micro-batch `k`'s forward from stage input `x`; returns the stage output, or `loss(logits)`
        on the last stage (given there). `meter` measures what this micro-batch keeps."""
        kept = []
        if not self.first_stage:
            x.requires_grad_()
        for n, (index, layer) in enumerate(self.layers):
            inp = x if n == 0 else x.detach().requires_grad_()
            self.hooks.before_forward(index, self._next(n))
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
        for n, ((index, _), (inp, out)) in enumerate(zip(reversed(self.layers), reversed(kept))):
            self.hooks.before_backward(index, self._next(n, backward=True))
            torch.autograd.backward(out, grad)
            grad = inp.grad if inp.requires_grad else None
            self.hooks.after_backward(index)
        return grad

    def backward_input(self, k: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Micro-batch `k`'s input-gradient pass (as `backward`, without the weights' gradients,
        which `backward_weight(k)` computes later); returns the gradient of the stage input."""
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

        kept = self.saved.pop(k)
        passes = []
        for n, ((index, layer), (inp, out)) in enumerate(zip(reversed(self.layers), reversed(kept))):
            self.hooks.before_backward(index, self._next(n, backward=True))
            weights = [p for p in layer.parameters() if p.requires_grad]
            if inp.requires_grad:
                (grad,), groups = stage_backward_input([out], None if grad is None else [grad], [inp], iter(weights))
                passes.append(functools.partial(stage_backward_weight, iter(weights), groups))
            else:  # token ids in: the whole backward is the weight pass
                passes.append(functools.partial(torch.autograd.backward, out, grad))
                grad = None
            passes.append(functools.partial(self.hooks.after_backward, index))
        self.weight_passes[k] = passes
        return grad

    def backward_weight(self, k: int) -> None:
        """Micro-batch `k`'s weight-gradient pass (after its `backward_input`)."""
        for run in self.weight_passes.pop(k):
            run()

    def _next(self, n: int, *, backward: bool = False) -> int | None:
        """The layer a pass runs after its n-th (counted in the pass's direction); None after its last."""
        if n + 1 >= len(self.layers):
            return None
        return self.layers[len(self.layers) - n - 2][0] if backward else self.layers[n + 1][0]

    def skip_forward(self) -> None:
        for n, (index, _) in enumerate(self.layers):
            self.hooks.before_forward(index, self._next(n))
            self.hooks.after_forward(index)

    def skip_backward(self, *, split: bool = False) -> None:
        """The hooks of a backward (`split`: of an input-gradient pass only)."""
        for n, (index, _) in enumerate(reversed(self.layers)):
            self.hooks.before_backward(index, self._next(n, backward=True))
            if not split:
                self.hooks.after_backward(index)

    def skip_weight(self) -> None:
        """The hooks of a weight-gradient pass."""
        for index, _ in reversed(self.layers):
            self.hooks.after_backward(index)
