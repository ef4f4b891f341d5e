"""A plain, single-device GPT built as the model spec's layer list: embedding, N blocks, head.

The model knows nothing about parallelism. Layers sit in `GPT.layers`, a ModuleDict keyed by their
global index, so parameter names (`layers.<i>.attn.q.weight`, ...) are canonical: the same under
every plan, which makes checkpoints plan-independent. Stage slicing, tensor parallelism and gradient
sync are applied on top by other modules (see `sailor.runtime`).

Shapes: B micro-batch size, T sequence length, h hidden size, V padded vocabulary, nh/nkv heads
(local heads under TP: every reshape derives the head count from the tensor, never from the spec).

Weights are initialised per canonical name from the seed (`init_param`), independently of which
layers a process builds and of its TP degree: the full tensor is made first and then sharded, so every
plan starts from exactly the same model.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from sailor.models import ModelSpec

INIT_STD = 0.02  # GPT-2 initialisation (Radford et al. 2019); residual projections scaled by 1/sqrt(2N)
ROPE_THETA = 10000.0  # RoFormer (Su et al. 2021) base; ModelSpec does not carry a per-model theta


def runtime_vocab(spec: ModelSpec) -> int:
    """The one padded vocabulary of the runtime: a multiple of 128, so every power-of-two TP degree
    up to 128 divides it and the model is the same under every plan."""
    return spec.padded_vocab(1)


def _norm(spec: ModelSpec) -> nn.Module:
    return nn.RMSNorm(spec.hidden_size) if spec.rms_norm else nn.LayerNorm(spec.hidden_size)


class Embedding(nn.Module):
    """Layer 0: token embedding plus, for learned positions, a position table."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(runtime_vocab(spec), spec.hidden_size)
        self.pos = nn.Embedding(spec.max_sequence_length, spec.hidden_size) if spec.learned_positions else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) int64 token ids -> (B, T, h)."""
        x = self.tok(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return x


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (B, heads, T, hd), rotating halves of the head dimension."""
    T, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv)  # (T, hd/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v, o projections (grouped-query when nkv < nh)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, hd = spec.hidden_size, spec.head_dim
        self.head_dim = hd
        self.rotary = not spec.learned_positions
        self.q = nn.Linear(h, spec.num_heads * hd, bias=spec.bias)
        self.k = nn.Linear(h, spec.kv_heads * hd, bias=spec.bias)
        self.v = nn.Linear(h, spec.kv_heads * hd, bias=spec.bias)
        self.o = nn.Linear(spec.num_heads * hd, h, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, h). Sizes are read from the projections' outputs, not from `x`: under
        sequence parallelism `x` holds a slice of the sequence and the projections return all of it."""
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, nh·hd), (B, T, nkv·hd) x 2
        B, T = q.shape[0], q.shape[1]
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        y = self.core(q, k, v)  # (B, nh, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core (what selective recomputation recomputes): rotary embedding, KV-head
        repetition and causal SDPA. (B, nh, T, hd), (B, nkv, T, hd) x 2 -> (B, nh, T, hd)."""
        if self.rotary:
            q, k = _rope(q), _rope(k)
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MLP(nn.Module):
    """GELU MLP (fc1, fc2), or SwiGLU (gate, up, down) for gated models."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, f = spec.hidden_size, spec.ffn
        self.gated = spec.gated_mlp
        if self.gated:
            self.gate = nn.Linear(h, f, bias=spec.bias)
            self.up = nn.Linear(h, f, bias=spec.bias)
            self.down = nn.Linear(f, h, bias=spec.bias)
        else:
            self.fc1 = nn.Linear(h, f, bias=spec.bias)
            self.fc2 = nn.Linear(f, h, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, h)."""
        if self.gated:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm1, self.attn = _norm(spec), Attention(spec)
        self.norm2, self.mlp = _norm(spec), MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, h)."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Last layer: final norm and LM head (untied). Returns logits; `lm_loss` turns them into the loss."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = _norm(spec)
        self.lm = nn.Linear(spec.hidden_size, runtime_vocab(spec), bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, V) logits."""
        return self.lm(self.norm(x))


class GPT(nn.Module):
    """The layer list `layers.0` (Embedding), `layers.1..N` (Block), `layers.N+1` (Head).

    `forward` runs whatever layers are present, in order, so a stage is this module with the other
    layers deleted (tokens in for the first stage, (B, T, h) activations otherwise).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        layers: list[nn.Module] = [Embedding(spec)] + [Block(spec) for _ in range(spec.num_blocks)] + [Head(spec)]
        self.layers = nn.ModuleDict({str(i): m for i, m in enumerate(layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the next-token cross-entropy (nats), in fp32: (B, T, V), (B, T) -> ()."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_param(name: str, shape: tuple[int, ...], *, seed: int, num_blocks: int) -> torch.Tensor:
    """The full (unsharded) initial value of parameter `name`, a function of (seed, name) only.

    Biases 0, norm weights 1, other weights N(0, 0.02²); the output projections of attention and MLP
    (which add into the residual stream) use 0.02 / sqrt(2N) (GPT-2).
    """
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape)
    if ".norm" in name:
        return torch.ones(shape)
    std = INIT_STD
    if name.endswith(("attn.o.weight", "mlp.fc2.weight", "mlp.down.weight")):
        std = INIT_STD / math.sqrt(2 * num_blocks)
    g = torch.Generator().manual_seed(_seed_for(seed, name))
    return torch.randn(shape, generator=g) * std


def init_full_model(spec: ModelSpec, seed: int) -> GPT:
    """A whole GPT on CPU with its canonical initial weights (the single-process reference)."""
    model = GPT(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_param(name, tuple(p.shape), seed=seed, num_blocks=spec.num_blocks))
    return model
