"""The mixture-of-experts part of a model's geometry (`MoE`, `sailor.model.spec.ModelSpec.moe`)."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from sailor.core.limits import MAX_BLOCKS, MAX_WIDTH
from sailor.core.schema import SPEC_CONFIG, Whole


class MoE(BaseModel):
    """Mixture-of-experts MLPs (frozen; unknown fields are an error): in a block that has one, the
    dense MLP is replaced by a router and `num_experts` SwiGLU experts of width `expert_ffn_size`, of
    which each token uses `top_k` (Shazeer et al. 2017; Mixtral, Jiang et al. 2024, §2.1), plus
    optional shared experts every token uses (DeepSeekMoE, Dai et al. 2024, §3.2; Qwen2-MoE's one
    shared expert with a sigmoid gate).

    Routing (Hugging Face `MixtralSparseMoeBlock` / `Qwen2MoeSparseMoeBlock`): router logits
    x·Wᵣᵀ (no bias), softmax over the experts in fp32, the top_k probabilities kept, renormalised to
    sum 1 when `norm_topk_prob` (Mixtral always), each chosen expert's output weighted by its
    probability; a shared expert's output is added, times sigmoid(x·w_g) when `shared_gate`.

    Which blocks are MoE (block j, 0-based among the blocks): j >= `first_dense` (DeepSeek's
    first_k_dense_replace), (j + 1) % `sparse_step` == 0 (Qwen2-MoE's decoder_sparse_step) and j
    not in `dense_blocks` (Qwen2-MoE's mlp_only_layers); the others keep the dense MLP of
    `ModelSpec.ffn_hidden_size`. `capacity_factor` None is dropless routing (every token reaches its
    top_k experts, as Hugging Face computes); a number c caps each expert at c·k·T/E of a batch's T
    tokens (GShard, Lepikhin et al. 2021, §2.2), which the simulator counts as padded buffers and
    the runtime refuses.
    """

    model_config = SPEC_CONFIG

    num_experts: Whole(2, MAX_WIDTH) = Field(description="Routed experts E per MoE block.")
    top_k: Whole(1, MAX_WIDTH) = Field(description="Experts each token is routed to (num_experts_per_tok).")
    expert_ffn_size: Whole(1, MAX_WIDTH) = Field(description="Width of each routed expert's SwiGLU"
                                                 " (moe_intermediate_size; Mixtral: intermediate_size).")
    shared_experts: Whole(0, MAX_WIDTH) = Field(default=0, description="Shared experts every token uses, built as"
                                                " one SwiGLU of shared_experts x shared_ffn_size (DeepSeek).")
    shared_ffn_size: Whole(1, MAX_WIDTH) | None = Field(default=None, description="Width of each shared expert;"
                                                        " default expert_ffn_size.")
    shared_gate: bool = Field(strict=True, default=False, description="Sigmoid gate on the shared experts'"
                              " output (Qwen2-MoE shared_expert_gate, h weights).")
    first_dense: Whole(0, MAX_BLOCKS) = Field(default=0, description="Leading dense blocks (first_k_dense_replace).")
    sparse_step: Whole(1, MAX_BLOCKS) = Field(default=1, description="Every sparse_step-th block is MoE"
                                              " (decoder_sparse_step).")
    dense_blocks: tuple[Whole(0, MAX_BLOCKS), ...] = Field(default=(), description="Blocks (0-based) kept dense"
                                                           " (mlp_only_layers).")
    norm_topk_prob: bool = Field(strict=True, default=True, description="Renormalise the top_k probabilities to"
                                 " sum 1 (Mixtral: always; Qwen-MoE, OLMoE: norm_topk_prob).")
    aux_loss_coef: float = Field(default=0.0, ge=0, description="Weight of the load-balancing loss added to the"
                                 " training loss (router_aux_loss_coef; Hugging Face `load_balancing_loss_func`).")
    capacity_factor: float | None = Field(default=None, gt=0, description="Expert capacity factor; None: dropless.")

    @model_validator(mode="after")
    def _check(self) -> MoE:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.shared_gate and not self.shared_experts:
            raise ValueError("shared_gate needs shared_experts >= 1")
        return self

    @property
    def shared_width(self) -> int:
        """Width of the one SwiGLU the shared experts form (0 without shared experts)."""
        return self.shared_experts * (self.shared_ffn_size or self.expert_ffn_size)

    def is_sparse(self, block: int) -> bool:
        """Whether block `block` (0-based among the blocks) has the MoE MLP."""
        return block >= self.first_dense and (block + 1) % self.sparse_step == 0 and block not in self.dense_blocks
