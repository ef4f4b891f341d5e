"""The geometry of a dense decoder-only transformer, as a layer list `embedding, N x block, head`:
`ModelGeometry`, the base of `spec.ModelSpec`, holds the fields of a model spec, their checks and
the widths derived from them; `spec` adds the per-layer accounting.

Layer index 0 is the embedding (token + learned position embeddings), 1..N the transformer blocks,
N+1 the head (final norm + LM head + loss), as in the public Sailor data (`LayerKind`). The
vocabulary is padded to a multiple of 128 x TP, as Megatron-LM does (`padded_vocab`). Qwen3's
`head_size` sets the attention width a·d apart from h. A mixture of experts is the `moe` field
(`sailor.model.moe.MoE`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from sailor.core.errors import SailorInputError
from sailor.core.limits import MAX_BLOCKS, MAX_SEQUENCE_LENGTH, MAX_WIDTH
from sailor.core.schema import SPEC_CONFIG, Whole
from sailor.model.moe import MoE

VOCAB_MULTIPLE = 128  # Megatron-LM default for --make-vocab-size-divisible-by


class LayerKind(str, Enum):
    """The three kinds of layer in the layer list."""

    EMBEDDING = "embedding"
    BLOCK = "block"
    HEAD = "head"


Activation = Literal["gelu", "gelu_tanh", "relu", "silu"]
"""MLP non-linearity: exact (erf) GELU, its tanh approximation (GPT-2's `gelu_new`), ReLU (OPT),
SiLU (the gate of SwiGLU in Llama, Mistral, Qwen2)."""


class RopeScaling(BaseModel):
    """Rotary-frequency rescaling for long contexts (Hugging Face `rope_scaling`).

    `linear`: every frequency divided by `factor` (position interpolation, Chen et al. 2023).
    `llama3`: wavelengths shorter than `original_max_position_embeddings / high_freq_factor` kept,
    longer than `.../ low_freq_factor` divided by `factor`, a linear blend in between (Llama 3.1,
    Meta's reference `apply_scaling`).
    """

    model_config = SPEC_CONFIG

    kind: Literal["linear", "llama3"] = Field(description="Rescaling rule (module docstring).")
    factor: float = Field(gt=0, description="How much longer the context is than the one trained on.")
    low_freq_factor: float | None = Field(default=None, gt=0, description="llama3 only (Llama 3.1: 1).")
    high_freq_factor: float | None = Field(default=None, gt=0, description="llama3 only (Llama 3.1: 4).")
    original_max_position_embeddings: Whole(1, MAX_SEQUENCE_LENGTH) | None = Field(default=None,
                                                         description="llama3 only: context before scaling (8192).")

    @model_validator(mode="after")
    def _check(self) -> "RopeScaling":
        llama3 = (self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings)
        if self.kind == "llama3" and None in llama3:
            raise ValueError("llama3 rope scaling needs low_freq_factor, high_freq_factor and"
                             " original_max_position_embeddings")
        if self.kind == "llama3" and self.low_freq_factor >= self.high_freq_factor:
            raise ValueError("llama3 rope scaling needs low_freq_factor < high_freq_factor")
        if self.kind == "linear" and any(v is not None for v in llama3):
            raise ValueError("linear rope scaling takes only a factor")
        return self


class ModelGeometry(BaseModel):
    """Geometry of a decoder-only transformer (frozen; unknown fields are an error), the base of
    `spec.ModelSpec`.

    The fields after `tied_embeddings` describe where Hugging Face architectures differ (RoPE base
    and scaling, partial rotary, norm epsilon, activation, parallel residual, per-projection biases,
    position offset); their defaults are the built-in models' (GPT-style pre-norm blocks), so a spec
    that does not set them means what it meant before they existed.
    """

    model_config = SPEC_CONFIG

    name: str = Field(min_length=1, max_length=200, description="Short name, e.g. 'opt-350m'.")
    num_blocks: Whole(1, MAX_BLOCKS) = Field(description="Transformer blocks N; the layer list has N + 2 layers.")
    hidden_size: Whole(1, MAX_WIDTH) = Field(description="Model width h.")
    num_heads: Whole(1, MAX_WIDTH) = Field(description="Attention heads a; TP degrees must divide it.")
    num_kv_heads: Whole(1, MAX_WIDTH) | None = Field(default=None, description="KV heads for grouped-query attention;"
                                                     " default a.")
    ffn_hidden_size: Whole(1, MAX_WIDTH) | None = Field(default=None, description="MLP width f; default 4h.")
    vocab_size: Whole(1, MAX_WIDTH) = Field(description="Vocabulary size before padding.")
    max_sequence_length: Whole(1, MAX_SEQUENCE_LENGTH) = Field(description="Context length (learned position table"
                                                               " size).")
    gated_mlp: bool = Field(strict=True, default=False, description="SwiGLU-style MLP with three matrices (Llama).")
    learned_positions: bool = Field(strict=True, default=True, description="Learned position table in the embedding (OPT, GPT); False for rotary.")
    bias: bool = Field(strict=True, default=True, description="Linear layers carry biases.")
    rms_norm: bool = Field(strict=True, default=False, description="RMSNorm (h params) instead of LayerNorm (2h).")
    tied_embeddings: bool = Field(strict=True, default=True, description="LM head reuses the input embedding matrix"
                                  " (OPT, GPT-Neo, GPT-3; Hugging Face tie_word_embeddings).")
    rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base (RoFormer, Su et al. 2021: 10000;"
                              " Llama 3: 500000). Rotary models only.")
    rope_scaling: RopeScaling | None = Field(default=None, description="Long-context frequency rescaling; None: none.")
    rotary_fraction: float = Field(default=1.0, gt=0, le=1, description="Fraction of each head's dimensions"
                                   " that rotate (GPT-NeoX rotary_pct 0.25; 1 for Llama).")
    norm_eps: float | None = Field(default=None, gt=0, description="Norm epsilon; None: torch's default"
                                   " (1e-5 for LayerNorm, the dtype's machine epsilon for RMSNorm).")
    activation: Activation | None = Field(default=None, description="MLP activation; None: silu when gated, else"
                                          " exact gelu.")
    parallel_residual: bool = Field(strict=True, default=False, description="x + attn(norm1(x)) + mlp(norm2(x)) in one step"
                                    " (GPT-NeoX, GPT-J) instead of two residual steps.")
    qkv_bias: bool | None = Field(strict=True, default=None, description="Biases on q, k, v; None: `bias` (Qwen2: True).")
    out_bias: bool | None = Field(strict=True, default=None, description="Bias on the attention output; None: `bias`.")
    mlp_bias: bool | None = Field(strict=True, default=None, description="Biases on the MLP matrices; None: `bias`.")
    position_offset: Whole(0, MAX_SEQUENCE_LENGTH) = Field(default=0, description="Rows of the learned position table before"
                                 " position 0 (OPT: 2); the table has max_sequence_length + offset rows.")
    sliding_window: Whole(1, MAX_SEQUENCE_LENGTH) | None = Field(default=None, description="Attention window (Mistral); the runtime"
                                       " attends to the whole causal prefix, so sequences beyond it are refused.")
    head_size: Whole(1, MAX_WIDTH) | None = Field(default=None, description="Width d of each attention head;"
                                                  " None: hidden_size / num_heads (Qwen3 sets it apart: 128 in"
                                                  " Qwen3-30B-A3B, whose h / a is 64).")
    qk_norm: bool = Field(strict=True, default=False, description="RMSNorm over each head of q and k before RoPE"
                          " (Qwen3; d weights each, norm_eps).")
    qk_norm_span: Literal["head", "all"] = Field(default="head", description="What one q (k) norm spans: each head"
                                                 " (Qwen3) or all heads at once (OLMoE: a·d and kv·d weights; not"
                                                 " split over TP ranks, so TP 1 only).")
    moe: MoE | None = Field(default=None, description="Mixture-of-experts MLPs (`MoE`); None: every block dense.")
    hf_model_type: Literal["llama", "mistral", "qwen2", "gpt_neox", "opt", "gpt2", "mixtral", "qwen2_moe",
                           "qwen3_moe", "olmoe"] | None = Field(
        default=None, description="The Hugging Face architecture this spec came from (`sailor.model.hf_config`); export"
                                  " writes that format. None: a built-in or inline spec.")

    @model_validator(mode="after")
    def _check(self) -> "ModelGeometry":
        if self.head_size is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.kv_heads}")
        if not self.learned_positions and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ValueError(f"rotary_fraction {self.rotary_fraction} of head_dim {self.head_dim} rotates"
                             f" {self.rotary_dim} dimensions; RoPE needs an even number")
        if self.learned_positions and (self.rope_scaling is not None or self.rotary_fraction != 1.0):
            raise ValueError("rope_scaling and rotary_fraction need rotary positions (learned_positions: false)")
        if self.position_offset and not self.learned_positions:
            raise ValueError("position_offset needs a learned position table (learned_positions: true)")
        if self.qk_norm and not self.rms_norm:
            raise ValueError("qk_norm is an RMSNorm per head (Qwen3): it needs rms_norm: true")
        if self.moe is not None and (not self.gated_mlp or self.has_mlp_bias or self.parallel_residual):
            raise ValueError("moe needs gated_mlp: true, no MLP biases and no parallel residual (SwiGLU experts)")
        if self.moe is not None and any(b >= self.num_blocks for b in self.moe.dense_blocks):
            raise ValueError(f"moe.dense_blocks names a block past the {self.num_blocks} blocks")
        return self

    # ---- derived geometry -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def attn_width(self) -> int:
        """Width of all query heads a·d (the q projection's output, the out projection's input); h
        unless `head_size` sets d apart."""
        return self.num_heads * self.head_dim

    def is_moe_block(self, layer: int) -> bool:
        """Whether layer `layer` (index into the layer list) is a block with the MoE MLP."""
        return (self.moe is not None and self.layer_kind(layer) is LayerKind.BLOCK
                and self.moe.is_sparse(layer - 1))

    def holds_moe_block(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Whether any of the half-open layer ranges `ranges` (e.g. a stage's chunks) holds an MoE block."""
        return self.moe is not None and any(self.is_moe_block(layer) for a, b in ranges for layer in range(a, b))

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (GPT-NeoX: int(head_dim x rotary_pct))."""
        return int(self.head_dim * self.rotary_fraction)

    @property
    def act(self) -> Activation:
        """The MLP activation, defaults resolved."""
        return self.activation or ("silu" if self.gated_mlp else "gelu")

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def has_out_bias(self) -> bool:
        return self.bias if self.out_bias is None else self.out_bias

    @property
    def has_mlp_bias(self) -> bool:
        return self.bias if self.mlp_bias is None else self.mlp_bias

    @property
    def position_rows(self) -> int:
        """Rows of the learned position table (0 for rotary models)."""
        return self.max_sequence_length + self.position_offset if self.learned_positions else 0

    @property
    def num_layers(self) -> int:
        """Length of the layer list: embedding + blocks + head."""
        return self.num_blocks + 2

    def layer_kind(self, layer: int) -> LayerKind:
        """Kind of layer `layer` (0-based index into the layer list)."""
        assert 0 <= layer < self.num_layers, layer
        if layer == 0:
            return LayerKind.EMBEDDING
        return LayerKind.HEAD if layer == self.num_layers - 1 else LayerKind.BLOCK

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary padded to a multiple of 128 x tp (Megatron-LM)."""
        m = VOCAB_MULTIPLE * tp
        return math.ceil(self.vocab_size / m) * m

    def tp_degrees(self, max_tp: int) -> list[int]:
        """TP degrees <= max_tp that divide the attention (and KV) heads; only 1 for q and k norms
        over all heads (OLMoE), which TP would split."""
        if self.qk_norm and self.qk_norm_span == "all":
            return [1]
        return [t for t in range(1, max_tp + 1) if self.num_heads % t == 0 and self.kv_heads % t == 0]

    def check_tp(self, tp: int) -> None:
        """Raise SailorInputError unless `tp` divides the attention heads."""
        if tp < 1 or self.num_heads % tp or self.kv_heads % tp:
            raise SailorInputError(f"TP {tp} does not divide the {self.num_heads} attention heads"
                                   f" ({self.kv_heads} KV heads) of {self.name}")
        if tp > 1 and self.qk_norm and self.qk_norm_span == "all":
            raise SailorInputError(f"TP {tp}: {self.name} normalises q and k over all heads at once (OLMoE), which"
                                   " the runtime does not split over TP ranks", fix="use TP 1")
