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

import contextlib
import hashlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from sailor.model.spec import ModelSpec
from sailor.runtime.moe import ACTIVATIONS, MoEMLP

INIT_STD = 0.02  # GPT-2 initialisation (Radford et al. 2019); residual projections scaled by 1/sqrt(2N)


def runtime_vocab(spec: ModelSpec) -> int:
    """The one padded vocabulary of the runtime: a multiple of 128, so every power-of-two TP degree
    up to 128 divides it and the model is the same under every plan. Rows past `spec.vocab_size`
    are padding: the head drops their logits, so no token id ever reaches them."""
    return spec.padded_vocab(1)


def _norm(spec: ModelSpec) -> nn.Module:
    cls = nn.RMSNorm if spec.rms_norm else nn.LayerNorm
    return cls(spec.hidden_size) if spec.norm_eps is None else cls(spec.hidden_size, eps=spec.norm_eps)




class Embedding(nn.Module):
    """Layer 0: token embedding plus, for learned positions, a position table (position t reads row
    t + `position_offset`, as OPT's table does)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(runtime_vocab(spec), spec.hidden_size)
        self.pos = nn.Embedding(spec.position_rows, spec.hidden_size) if spec.learned_positions else None
        self.offset = spec.position_offset

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) int64 token ids -> (B, T, h)."""
        x = self.tok(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device) + self.offset)
        return x


def rope_inv_freq(spec: ModelSpec, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies θ^(-2i/d) for i < d/2, d = `spec.rotary_dim` (RoFormer, Su et al.
    2021), rescaled by `spec.rope_scaling` (see `sailor.model.geometry.RopeScaling`): (d/2,) fp32."""
    d = spec.rotary_dim
    inv = 1.0 / spec.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    sc = spec.rope_scaling
    if sc is None:
        return inv
    if sc.kind == "linear":
        return inv / sc.factor
    # llama3 (Meta's Llama 3.1 `apply_scaling`): keep short wavelengths, divide long ones by the
    # factor, and blend linearly in wavelength's inverse between the two thresholds.
    wavelen = 2 * math.pi / inv
    old = sc.original_max_position_embeddings
    smooth = ((old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)).clamp(0.0, 1.0)
    return (1 - smooth) * inv / sc.factor + smooth * inv


def _rope(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (B, heads, T, hd): the first 2·len(inv) dimensions rotate as
    two halves (GPT-NeoX / Llama layout), the rest pass through."""
    T, d = x.shape[-2], 2 * inv.shape[0]
    ang = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv)  # (T, d/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2, rest = x[..., : d // 2], x[..., d // 2: d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v, o projections (grouped-query when nkv < nh); with
    `qk_norm` an RMSNorm over each head of q and k (Qwen3; `q_norm`, `k_norm`: d weights each, shared
    by the heads) or over all heads at once (OLMoE, `qk_norm_span` "all"; TP 1 only) before RoPE."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, hd = spec.hidden_size, spec.head_dim
        self.head_dim = hd
        self.spec = spec if not spec.learned_positions else None  # rotary settings
        self._inv: dict[torch.device, torch.Tensor] = {}
        self.q = nn.Linear(h, spec.num_heads * hd, bias=spec.has_qkv_bias)
        self.k = nn.Linear(h, spec.kv_heads * hd, bias=spec.has_qkv_bias)
        self.v = nn.Linear(h, spec.kv_heads * hd, bias=spec.has_qkv_bias)
        self.o = nn.Linear(spec.num_heads * hd, h, bias=spec.has_out_bias)
        self.qk_norm = spec.qk_norm and spec.qk_norm_span  # "head", "all" or False
        if spec.qk_norm:
            whole = spec.qk_norm_span == "all"  # OLMoE: one norm over all q heads, one over all k heads
            self.q_norm = nn.RMSNorm(spec.num_heads * hd if whole else hd, eps=spec.norm_eps)
            self.k_norm = nn.RMSNorm(spec.kv_heads * hd if whole else hd, eps=spec.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, h). Sizes are read from the projections' outputs, not from `x`: under
        sequence parallelism `x` holds a slice of the sequence and the projections return all of it."""
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, nh·hd), (B, T, nkv·hd) x 2
        if self.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        B, T = q.shape[0], q.shape[1]
        q = q.view(B, T, -1, self.head_dim)  # (B, T, nh, hd)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, nkv, hd)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hd), (B, nkv, T, hd)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        y = self.core(q, k, v)  # (B, nh, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core (what selective recomputation recomputes): rotary embedding (the
        spec's base, scaling and rotary fraction), KV-head repetition and causal SDPA.
        (B, nh, T, hd), (B, nkv, T, hd) x 2 -> (B, nh, T, hd)."""
        if self.spec is not None:
            if q.device not in self._inv:  # computed on first use: the module is built on `meta`
                self._inv[q.device] = rope_inv_freq(self.spec, q.device)
            q, k = _rope(q, self._inv[q.device]), _rope(k, self._inv[q.device])
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MLP(nn.Module):
    """Two-matrix MLP (fc1, act, fc2), or gated (down(act(gate(x)) * up(x)), SwiGLU with silu)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, f, bias = spec.hidden_size, spec.ffn, spec.has_mlp_bias
        self.gated = spec.gated_mlp
        self.act = ACTIVATIONS[spec.act]
        if self.gated:
            self.gate = nn.Linear(h, f, bias=bias)
            self.up = nn.Linear(h, f, bias=bias)
            self.down = nn.Linear(f, h, bias=bias)
        else:
            self.fc1 = nn.Linear(h, f, bias=bias)
            self.fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, h)."""
        if self.gated:
            return self.down(self.act(self.gate(x)) * self.up(x))
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x)); with a parallel
    residual (GPT-NeoX) both branches read x: x + attn(norm1(x)) + mlp(norm2(x)). Layer `layer` of
    the layer list has the mixture-of-experts MLP (`runtime.moe.MoEMLP`) where
    `ModelSpec.is_moe_block` says so."""

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.norm1, self.attn = _norm(spec), Attention(spec)
        self.norm2, self.mlp = _norm(spec), (MoEMLP(spec) if spec.is_moe_block(layer) else MLP(spec))
        self.parallel = spec.parallel_residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, h)."""
        if self.parallel:
            return x + self.attn(self.norm1(x)) + self.mlp(self.norm2(x))
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Last layer: final norm and LM head. Returns the logits of the real vocabulary (padding rows
    dropped); `lm_loss_sum` turns them into the loss. A tied head is a copy of the embedding whose
    gradient is summed with the embedding's (`sailor.runtime.tied`)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = _norm(spec)
        self.lm = nn.Linear(spec.hidden_size, runtime_vocab(spec), bias=False)
        self.vocab = spec.vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, vocab_size) logits."""
        return self.lm(self.norm(x))[..., : self.vocab]


class GPT(nn.Module):
    """The layer list `layers.0` (Embedding), `layers.1..N` (Block), `layers.N+1` (Head).

    `forward` runs whatever layers are present, in order, so a stage is this module with the other
    layers deleted (tokens in for the first stage, (B, T, h) activations otherwise).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        layers: list[nn.Module] = [Embedding(spec)] + [Block(spec, i) for i in range(1, spec.num_blocks + 1)] + [Head(spec)]
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
    if "norm" in name.rsplit(".", 2)[-2]:  # norm1, norm2, the head's norm, attn.q_norm, attn.k_norm
        return torch.ones(shape)
    std = INIT_STD
    if name.endswith(("attn.o.weight", "mlp.fc2.weight", ".down.weight")):  # dense, expert and shared down
        std = INIT_STD / math.sqrt(2 * num_blocks)
    g = torch.Generator().manual_seed(_seed_for(seed, name))
    return torch.randn(shape, generator=g) * std


EMBEDDING_WEIGHT = "layers.0.tok.weight"

RANDOM_INITS = frozenset({"normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                          "xavier_normal_", "trunc_normal_", "orthogonal_"})
"""The in-place random initialisers (`torch.nn.init`'s and the Tensor methods they call) that `on_meta`
skips on meta tensors."""


class _SkipRandomInitOnMeta(TorchFunctionMode):
    """Returns a meta tensor unchanged from a `RANDOM_INITS` call; every other call runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in RANDOM_INITS:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the `meta` device (shapes only, no memory), as `with torch.device("meta")`,
    without running the modules' default random initialisers there. On a meta tensor they compute
    nothing, but their Python decompositions (`torch._refs`) import torch._dynamo on first use: 0.9 s
    of a fresh process on this machine at load 4 (1.7 s in a testbed rank starting during a grow, load
    2 to 3), which a rank needs otherwise only when its schedule splits backwards (ZB-H1,
    `runtime.inplace.warm_up`). Every weight of a meta-built module is set later (`materialize`, a
    checkpoint, a live move), so nothing is lost."""
    with torch.device("meta"), _SkipRandomInitOnMeta():
        yield


def param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Canonical name -> full (unsharded) shape of every parameter `GPT(spec)` holds, built on the
    `meta` device (no memory, `on_meta`). A tied LM head is listed under its own name too."""
    with on_meta():
        return {n: tuple(p.shape) for n, p in GPT(spec).named_parameters(remove_duplicate=False)}


def tied_head(spec: ModelSpec) -> str | None:
    """Canonical name of the LM head when it is tied to the embedding (`ModelSpec.tied_embeddings`)."""
    return f"layers.{spec.num_layers - 1}.lm.weight" if spec.tied_embeddings else None


def initial_value(spec: ModelSpec, name: str, shape: tuple[int, ...], *, seed: int) -> torch.Tensor:
    """`init_param` for `spec`'s parameter `name`; a tied LM head starts as the embedding's value."""
    if name == tied_head(spec):
        name = EMBEDDING_WEIGHT
    return init_param(name, shape, seed=seed, num_blocks=spec.num_blocks)


def init_full_model(spec: ModelSpec, seed: int) -> GPT:
    """A whole GPT on CPU with its canonical initial weights (the single-process reference). A tied
    model shares one Parameter between embedding and LM head, as Hugging Face does."""
    model = GPT(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial_value(spec, name, tuple(p.shape), seed=seed))
    return share_tied(model)


def share_tied(model: GPT) -> GPT:
    """For a whole tied model: make the LM head use the embedding's Parameter (one matrix, as Hugging
    Face ties it), so autograd sums both gradients; returns the model."""
    if model.spec.tied_embeddings:
        model.layers[str(model.spec.num_layers - 1)].lm.weight = model.layers["0"].tok.weight
    return model
