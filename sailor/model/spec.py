"""Model specs: a dense decoder-only transformer as a layer list `embedding, N x block, head`.

`ModelSpec` is its geometry (`sailor.model.geometry.ModelGeometry`: the fields, their checks, the
derived widths and the layer list's `LayerKind`s) with the accounting of this module: per layer and
TP degree it gives parameters, forward FLOPs, activation bytes kept for backward and the size of the
tensor passed on. Formulas:
- parameters and FLOPs: Megatron accounting (Narayanan et al., SC'21, "Efficient Large-Scale Language
  Model Training on GPU Clusters", §5.1), generalised to grouped-query attention and gated MLPs;
  backward = 2 x forward (no recomputation).
- activations: `sailor.model.activations`, per framework (`Framework`: Megatron-LM's accounting of
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2,
  or Sailor's runtime with memory-efficient attention) and per memory option (`Recompute`, sequence
  parallelism);
- recomputation FLOPs (`recompute_flop`) and the TP collectives of each layer (`tp_collectives`);
- the vocabulary is padded to a multiple of 128 x TP, as Megatron-LM does (`--make-vocab-size-
  divisible-by 128`); the public Sailor `llm_info.json` parameter counts match this exactly.
The head holds its own LM-head weights: untied models have them anyway, and tied ones keep a
duplicate on the last pipeline stage under Megatron's pipelining.
Mixtures of experts (`MoE`, `ModelSpec.moe`): a block that has one counts all its experts'
parameters (every rank of a stage holds all of them: expert-parallel degree 1), and per token the
router, top_k experts and the shared experts' FLOPs; `active_params` counts top_k experts only.
"""

from __future__ import annotations

from enum import Enum

from sailor.model.geometry import LayerKind, ModelGeometry


class Framework(str, Enum):
    """Whose implementation of the layers a job is modelled after; decides which tensors a layer
    saves for its backward (`sailor.model.activations`), how the head's loss is parallelised and how
    activations cross stage boundaries.

    - `sailor` (default): this project's runtime (`sailor.runtime.model`): attention through
      `F.scaled_dot_product_attention` (memory-efficient / flash kernels, no s x s score tensor is
      kept), no dropout, logits all-gathered before a plain cross entropy, activations crossing
      stage boundaries scattered and all-gathered like Megatron-LM's (`runtime.pipeline`).
    - `megatron-lm`: Megatron-LM's GPT as published (Narayanan et al. SC'21; Korthikanti et al.
      2022): materialised attention scores with softmax and dropout masks, fused kernels,
      vocab-parallel cross entropy, and the scatter/gather of activations across stage boundaries
      (SC'21 §4.1). Use it for published Megatron-LM setups.
    - `deepspeed`: as `sailor`, except that every TP rank of a stage sends the full activation to its
      peer rank of the next stage, as DeepSpeed's pipeline engine does: the runtime of the public
      Sailor artifact, whose measured runs `sailor validate` reads (`simulator.fidelity`).
    """

    SAILOR = "sailor"
    MEGATRON = "megatron-lm"
    DEEPSPEED = "deepspeed"


class Recompute(str, Enum):
    """Activation recomputation of a stage's transformer blocks (Korthikanti et al. 2022, §4-5).

    - `none`: every block keeps its activations for the backward pass.
    - `selective`: the attention core (RoPE, QKᵀ, softmax, dropout, attention·V) is recomputed in the
      backward pass; the rest is kept (§5, "selective activation recomputation").
    - `full`: each recomputed block keeps only its input and re-runs its forward in the backward
      pass (Chen et al. 2016 gradient checkpointing at block granularity); `recompute_blocks` says how
      many of the stage's blocks (the first ones) are recomputed, the others keep everything.
    """

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class Collective(str, Enum):
    """Collectives inside a TP group (ring algorithms; see `simulator.collectives`)."""

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"


class ModelSpec(ModelGeometry):
    """A decoder-only transformer (`ModelGeometry`: fields, checks, derived widths) and its per-layer
    accounting per GPU of a TP group (module docstring)."""

    # ---- per-layer accounting (per GPU of a TP group of size tp) -----------------------------
    def _norm_params(self) -> int:
        return self.hidden_size if self.rms_norm else 2 * self.hidden_size

    def params(self, layer: int, tp: int = 1) -> int:
        """Parameters held by one GPU of a TP group for layer `layer`.

        Sharded over TP: QKV/MLP-in weights (column-parallel) with their biases, out/MLP-out weights
        (row-parallel), the vocabulary of embedding and LM head. Replicated: norms, row-parallel biases,
        the position table.
        """
        h, qd, kvd = self.hidden_size, self.attn_width, self.kv_heads * self.head_dim
        kind = self.layer_kind(layer)
        if kind is LayerKind.EMBEDDING:
            return self.padded_vocab(tp) * h // tp + self.position_rows * h
        if kind is LayerKind.HEAD:
            return self._norm_params() + self.padded_vocab(tp) * h // tp
        mlp_sharded, mlp_replicated = self._mlp_params(layer)
        sharded = h * (qd + 2 * kvd) + qd * h + mlp_sharded
        sharded_bias = (qd + 2 * kvd) * self.has_qkv_bias
        replicated = 2 * self._norm_params() + h * self.has_out_bias + mlp_replicated + self._qk_norm_params()
        return (sharded + sharded_bias) // tp + replicated

    def _qk_norm_params(self) -> int:
        """Weights of the q and k norms: d each per head (shared by the heads), or a·d + kv·d over
        all heads (OLMoE, TP 1 only); 0 without them."""
        if not self.qk_norm:
            return 0
        return 2 * self.head_dim if self.qk_norm_span == "head" else self.attn_width + self.kv_heads * self.head_dim

    def _mlp_params(self, layer: int, experts: int | None = None) -> tuple[int, int]:
        """(TP-sharded, replicated) parameters of block `layer`'s MLP. Dense: the matrices and
        column-parallel biases sharded, the row-parallel bias replicated. MoE (`experts` routed
        experts, default all): every expert's SwiGLU (3·h·f_e) and the shared experts' (3·h·f_s)
        sharded like a dense MLP; the router (E·h) and the shared gate (h) replicated."""
        h = self.hidden_size
        if self.is_moe_block(layer):
            moe = self.moe
            n = moe.num_experts if experts is None else experts
            return 3 * h * (n * moe.expert_ffn_size + moe.shared_width), moe.num_experts * h + h * moe.shared_gate
        f, mlp_in = self.ffn, (2 if self.gated_mlp else 1)  # gate and up projections for SwiGLU
        return mlp_in * h * f + f * h + mlp_in * f * self.has_mlp_bias, h * self.has_mlp_bias

    def routed_expert_params(self, layer: int, tp: int = 1, experts: int | None = None) -> int:
        """Parameters one GPU of a TP group holds of `experts` routed experts (default all E) of
        block `layer`: 3·h·f_e each, TP-sharded (`_mlp_params`); 0 for a dense layer. The part of
        `params` that expert parallelism splits among the EP ranks."""
        if not self.is_moe_block(layer):
            return 0
        n = self.moe.num_experts if experts is None else experts
        return 3 * self.hidden_size * n * self.moe.expert_ffn_size // tp

    def total_params(self) -> int:
        """Parameters of the whole model at TP 1 (LM head counted separately from the embedding)."""
        return sum(self.params(i) for i in range(self.num_layers))

    def model_params(self) -> int:
        """Parameters of one copy of the model as Hugging Face counts them (`num_parameters()`): the
        vocabulary unpadded, a tied LM head counted once with the embedding."""
        padding_rows = self.padded_vocab(1) - self.vocab_size
        head = self.params(self.num_layers - 1) - padding_rows * self.hidden_size
        if self.tied_embeddings:
            head = self._norm_params()
        blocks = sum(self.params(i) for i in range(1, self.num_layers - 1))
        return self.params(0) - padding_rows * self.hidden_size + blocks + head

    def active_params(self) -> int:
        """`model_params` counting, in every MoE block, only the top_k routed experts a token uses
        (the "activated parameters" of Mixtral's and Qwen3's model cards); = `model_params` for a
        dense model."""
        if self.moe is None:
            return self.model_params()
        idle = 3 * self.hidden_size * self.moe.expert_ffn_size * (self.moe.num_experts - self.moe.top_k)
        return self.model_params() - idle * sum(self.is_moe_block(i) for i in range(self.num_layers))

    def forward_flop(self, layer: int, *, tp: int, mbs: int, seq: int) -> float:
        """Forward FLOPs of one micro-batch on one GPU of the TP group (SC'21 §5.1: 2 FLOPs per MAC).

        Block: 2·b·s·(h(q+2·kv_dim) + q·h + m·h·f) for the matmuls (m = 3 gated, 2 plain; q = a·d, h
        unless `head_size` is set) plus 4·b·s²·q for QKᵀ and attention·V. An MoE block's MLP instead
        costs, per token, its router 2·E·h (replicated on every TP rank), top_k experts and the
        shared experts 2·3·h·(k·f_e·c + f_s) (c the capacity factor: buffers padded to capacity;
        1 dropless) and the shared gate 2·h. Head: 2·b·s·h·V. Embedding: a lookup, 0 FLOPs.
        """
        h, qd, kvd = self.hidden_size, self.attn_width, self.kv_heads * self.head_dim
        kind = self.layer_kind(layer)
        if kind is LayerKind.EMBEDDING:
            return 0.0
        if kind is LayerKind.HEAD:
            return 2.0 * mbs * seq * h * self.padded_vocab(tp) / tp
        mlp_sharded, mlp_replicated = self._mlp_flop_per_token(layer)
        matmul = 2.0 * mbs * seq * (h * (qd + 2 * kvd) + qd * h + mlp_sharded)
        attention = 4.0 * mbs * seq * seq * qd
        return (matmul + attention) / tp + 2.0 * mbs * seq * mlp_replicated

    def _mlp_flop_per_token(self, layer: int) -> tuple[float, float]:
        """Multiply-accumulates per token of block `layer`'s MLP: (split over TP, replicated)."""
        h = self.hidden_size
        if self.is_moe_block(layer):
            moe = self.moe
            routed = moe.top_k * moe.expert_ffn_size * (moe.capacity_factor or 1.0)
            return 3.0 * h * (routed + moe.shared_width), float(moe.num_experts * h + h * moe.shared_gate)
        return (3 if self.gated_mlp else 2) * h * self.ffn, 0.0

    def backward_flop(self, layer: int, *, tp: int, mbs: int, seq: int) -> float:
        """Backward FLOPs: twice the forward (gradients w.r.t. inputs and weights)."""
        return 2.0 * self.forward_flop(layer, tp=tp, mbs=mbs, seq=seq)

    def weight_grad_flop(self, layer: int, *, tp: int, mbs: int, seq: int) -> float:
        """FLOPs of the backward's weight-gradient part (dW = Xᵀ·dY of every matmul with weights),
        the rest being the input gradient (Qi et al., ICLR 2024, §2, Table 1: a linear layer's
        backward is half each; attention's QKᵀ and attention·V have no weights, so their backward is
        all input gradient). Block: the forward's matmul FLOPs; head: its LM-head matmul (half its
        backward); embedding: 0 FLOPs (a scatter-add, and it has no input gradient at all)."""
        kind = self.layer_kind(layer)
        if kind is LayerKind.EMBEDDING:
            return 0.0
        if kind is LayerKind.HEAD:
            return self.forward_flop(layer, tp=tp, mbs=mbs, seq=seq)
        attention = 4.0 * mbs * seq * seq * self.attn_width / tp
        return self.forward_flop(layer, tp=tp, mbs=mbs, seq=seq) - attention

    def weight_grad_pending_bytes(self, layer: int, *, tp: int, mbs: int, seq: int, elem_bytes: int) -> float:
        """Bytes one GPU keeps from a layer's input-gradient pass until its deferred weight-gradient
        pass (zero-bubble schedules): the gradients dY of the outputs of its weight matmuls, beyond
        the activations (which stay held until the weight pass too). Block: QKV (h + 2·kv_dim)/t,
        attention-out h (replicated), MLP-in m'·f/t (m' = 2 gated, 1 plain), MLP-out h (replicated),
        each s·b·e. Embedding: its output gradient s·b·h·e. Head: the gradient of its LM-head
        matmul's output, the vocab-parallel logits, s·b·(V/t)·e (one micro-batch's is already the
        simulator's logits-gradient buffer; the pending ones stay until their W passes)."""
        s, b, h, e = seq, mbs, self.hidden_size, elem_bytes
        kind = self.layer_kind(layer)
        if kind is LayerKind.EMBEDDING:
            return s * b * h * e
        if kind is LayerKind.HEAD:
            return s * b * self.padded_vocab(tp) / tp * e
        kvd = self.kv_heads * self.head_dim
        if self.is_moe_block(layer):
            moe = self.moe
            mlp_in = 2 * (moe.top_k * moe.expert_ffn_size + moe.shared_width) / tp + moe.num_experts + moe.shared_gate
        else:
            mlp_in = (2 if self.gated_mlp else 1) * self.ffn / tp
        return s * b * e * ((self.attn_width + 2 * kvd) / tp + mlp_in + 2 * h)

    def recompute_flop(self, layer: int, *, tp: int, mbs: int, seq: int, recompute: Recompute) -> float:
        """FLOPs one GPU spends in the backward pass re-running forward work of layer `layer` for one
        micro-batch: the whole block's forward under full recomputation; under selective
        recomputation the attention core's two matmuls (QKᵀ and attention·V, 4·b·s²·h / t; its
        softmax and dropout are elementwise). 0 for the embedding, the head and `none`.

        With full recomputation a block costs forward + recompute + backward = 4x its forward, the
        count Narayanan et al. SC'21 §5.1 use (eq. 3: 96·B·s·l·h²(1 + s/(6h) + V/(16·l·h)), whose
        logit term is not recomputed)."""
        if recompute is Recompute.NONE or self.layer_kind(layer) is not LayerKind.BLOCK:
            return 0.0
        if recompute is Recompute.FULL:
            return self.forward_flop(layer, tp=tp, mbs=mbs, seq=seq)
        return 4.0 * mbs * seq * seq * self.attn_width / tp

    def tp_collectives(self, layer: int, *, tp: int, mbs: int, seq: int, elem_bytes: int,
                       framework: Framework = Framework.SAILOR, recompute: Recompute = Recompute.NONE,
                       sequence_parallel: bool = False) -> tuple[list[tuple[Collective, float]], list[tuple[Collective, float]]]:
        """The TP collectives of one micro-batch through layer `layer` on a TP group of `tp` GPUs:
        (forward, backward) lists of (collective, bytes of the full, unsharded tensor). Empty at TP 1.

        Block (Megatron TP, Shoeybi et al. 2019 §3; Korthikanti et al. 2022 §4.2.2 for SP), with
        n = b·s·h·e: forward 2 all-reduces of n (after the attention and MLP row-parallel linears),
        backward 2 (before the column-parallel ones, of their input gradient). With sequence
        parallelism each all-reduce becomes an all-gather (into the column-parallel linear) and a
        reduce-scatter (out of the row-parallel one) of n, and the backward all-gathers the saved
        sharded inputs of the two column-parallel linears again for their weight gradients: forward
        2 all-gathers + 2 reduce-scatters, backward 4 all-gathers + 2 reduce-scatters. Full
        recomputation repeats the forward's collectives in the backward; selective does not (the
        attention core is local to each TP rank).
        Embedding: one all-reduce of n forward (vocab-parallel lookup). Head: backward one all-reduce
        of n (the gradient into the replicated input); forward, Megatron-LM's vocab-parallel cross
        entropy all-reduces 3 fp32 values per token (max, target logit, sum of exponentials), Sailor's
        runtime all-gathers the logits (b·s·V·e). An MoE block reduces its MLP output before the
        routing weights apply (`_moe_combined_rows`): its second forward collective moves that many n.
        """
        if tp == 1:
            return [], []
        n = float(mbs * seq * self.hidden_size * elem_bytes)
        AR, AG, RS = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER
        kind = self.layer_kind(layer)
        if kind is LayerKind.EMBEDDING:
            return [(AR, n)], []
        if kind is LayerKind.HEAD:
            if framework is Framework.MEGATRON:
                return [(AR, 4.0 * mbs * seq)] * 3, [(AR, n)]
            return [(AG, float(mbs * seq * self.padded_vocab(1) * elem_bytes))], [(AR, n)]
        m = n * self._moe_combined_rows(layer)  # the MLP's reduced output: n, or every routed copy in an MoE block
        forward = [(AG, n), (RS, n), (AG, n), (RS, m)] if sequence_parallel else [(AR, n), (AR, m)]
        backward = [(AG, n), (RS, n), (AG, n)] * 2 if sequence_parallel else [(AR, n)] * 2
        if recompute is Recompute.FULL:
            backward = forward + backward
        return forward, backward

    def _moe_combined_rows(self, layer: int) -> float:
        """Rows per token of the tensor an MLP's row-parallel output reduces over TP: 1 for a dense
        block; an MoE block reduces its experts' outputs before weighting them (`runtime.moe`): the
        top_k routed copies (padded to capacity) plus one for the shared experts."""
        if not self.is_moe_block(layer):
            return 1.0
        moe = self.moe
        return moe.top_k * (moe.capacity_factor or 1.0) + (1.0 if moe.shared_experts else 0.0)

    def output_bytes(self, layer: int, *, mbs: int, seq: int, elem_bytes: int) -> float:
        """Size of the tensor layer `layer` passes to the next one (the full, unsharded activation);
        the head passes only the loss."""
        if self.layer_kind(layer) is LayerKind.HEAD:
            return 4.0
        return float(mbs * seq * self.hidden_size * elem_bytes)
