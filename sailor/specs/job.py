"""Job and cluster specs: what to train, and which GPUs can be had where, at what price.

Both are frozen pydantic models with `extra="forbid"` (a misspelt field is an error). Load them from
YAML or JSON with `load_job` / `load_cluster`; both raise `SailorInputError` naming file and field.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from sailor.core.errors import SailorInputError, note
from sailor.core.limits import MAX_GLOBAL_BATCH, MAX_SEQUENCE_LENGTH
from sailor.core.schema import SPEC_CONFIG, Whole
from sailor.model.registry import get_model
from sailor.model.spec import Framework, ModelSpec
from sailor.specs.recipe import Recipe

Precision = Literal["fp32", "bf16", "fp16"]


class Optimizer(str, Enum):
    """Optimizers whose state size the simulator knows."""

    ADAM = "adam"
    SGD = "sgd"


# Bytes per parameter held on a GPU without sharding: model weights, model gradients, optimizer
# states. Counted as Megatron-LM's distributed optimizer counts them (NVIDIA/Megatron-LM,
# docs/source/distrib_optimizer.md, "theoretical number of bytes per parameter"; d = data-parallel
# size): fp32 params and grads 16 (4 + 4 + Adam's two fp32 moments 8), distributed 8 + 8/d;
# bf16 params with fp32 main grads 18 (2 + 4 + fp32 master weights and moments 12), distributed
# 6 + 12/d; fp16 params and grads 20 (2 + 2 + an fp32 copy of the grads, master weights and moments
# 16), distributed 4 + 16/d. "optimizer" is what the distributed optimizer (ZeRO-1) shards;
# ZeRO-2 also shards "gradients", ZeRO-3 also "weights" (`simulator.memory.state_bytes`). bf16 keeps
# fp32 gradients because Megatron-LM accumulates bf16 training's gradients in fp32 (and so does
# Sailor's runtime, per parameter). SGD without momentum keeps no moments: fp32 4 + 4; bf16 2 + 4 +
# 4 master; fp16 2 + 2 + 8 (fp32 grad copy and master). These fp16 rows are Megatron-LM's; Sailor's
# runtime accumulates fp16 gradients in fp32 as it does bf16's (`runtime.zero`), so a job of
# framework "sailor" in fp16 holds the bf16 rows' bytes (`JobSpec.state_bytes_per_param`).
STATE_BYTES_PER_PARAM: dict[tuple[str, Optimizer], dict[str, int]] = {
    ("fp32", Optimizer.ADAM): {"weights": 4, "gradients": 4, "optimizer": 8},
    ("fp32", Optimizer.SGD): {"weights": 4, "gradients": 4, "optimizer": 0},
    ("bf16", Optimizer.ADAM): {"weights": 2, "gradients": 4, "optimizer": 12},
    ("bf16", Optimizer.SGD): {"weights": 2, "gradients": 4, "optimizer": 4},
    ("fp16", Optimizer.ADAM): {"weights": 2, "gradients": 2, "optimizer": 16},
    ("fp16", Optimizer.SGD): {"weights": 2, "gradients": 2, "optimizer": 8},
}


# Sequence length of a job that sets none: the model's context, but at most this many tokens (Llama-3.1
# and Qwen2.5 configs say 131,072, which no training job means by default); said on stderr.
DEFAULT_MAX_SEQUENCE = 4096

# The recipe's optimizer name for each top-level `optimizer` (and back): the one derives from the other.
RECIPE_NAME = {"adam": "adamw", "sgd": "sgd"}


class JobSpec(BaseModel):
    """What to train. Units: samples (global batch), tokens (sequence length).

    `optimizer` and `recipe.optimizer.name` name the same choice: give either (the other follows:
    adam <-> adamw, sgd <-> sgd); both given and different is an error naming `optimizer`.
    """

    model_config = SPEC_CONFIG

    model: ModelSpec = Field(description="Built-in name/alias (e.g. 'opt-350m', 'OPT-350') or an inline architecture.")
    global_batch_size: Whole(1, MAX_GLOBAL_BATCH) = Field(description="Samples per iteration (optimizer step);"
                                                          " at most limits.MAX_GLOBAL_BATCH.")
    sequence_length: Whole(1, MAX_SEQUENCE_LENGTH) | None = Field(
        default=None, description="Tokens per sample; default the model's context length, at most"
                                  " DEFAULT_MAX_SEQUENCE (4096), said on stderr when that cuts it.")
    precision: Precision = Field(default="fp32", description="fp32, or bf16/fp16 mixed precision.")
    optimizer: Optimizer = Field(default=Optimizer.ADAM, description="adam (AdamW) or sgd; follows"
                                 " recipe.optimizer.name when only that is given.")
    recipe: Recipe = Field(default_factory=Recipe, description="Optimizer settings, learning-rate schedule,"
                           " evaluation and checkpoints (`specs.recipe`).")
    framework: Framework = Field(default=Framework.SAILOR,
                                 description="Whose layer implementation the job is modelled after (models.Framework):"
                                             " 'sailor' (this project's runtime: memory-efficient attention, no dropout;"
                                             " default) or 'megatron-lm' (materialised attention scores and dropout"
                                             " masks as Korthikanti et al. 2022 count them; published Megatron-LM runs).")

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, v: Any) -> Any:
        if isinstance(v, (str, dict)):
            return get_model(v)
        return v

    @field_validator("optimizer", "framework", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v

    @model_validator(mode="before")
    @classmethod
    def _one_optimizer(cls, data: Any) -> Any:
        """Derive `optimizer` from `recipe.optimizer.name` or the other way round (class docstring)."""
        if not isinstance(data, dict):
            return data
        top = data.get("optimizer")
        top = top.value if isinstance(top, Optimizer) else top.lower() if isinstance(top, str) else None
        recipe = data.get("recipe")
        if isinstance(recipe, Recipe):
            named = recipe.optimizer.name
        else:
            opt = recipe.get("optimizer") if isinstance(recipe, dict) else None
            named = opt.get("name") if isinstance(opt, dict) else None
        if named in RECIPE_NAME.values() and top is not None and RECIPE_NAME.get(top) != named:
            raise SailorInputError(f"{top} disagrees with recipe.optimizer.name {named}", field="optimizer",
                                   fix="give the optimizer once, in the recipe")
        if named in RECIPE_NAME.values() and top is None:
            return {**data, "optimizer": {v: k for k, v in RECIPE_NAME.items()}[named]}
        if top in RECIPE_NAME and named is None and (recipe is None or isinstance(recipe, dict)):
            recipe = dict(recipe or {})
            recipe["optimizer"] = {**(recipe.get("optimizer") or {}), "name": RECIPE_NAME[top]}
            return {**data, "recipe": recipe}
        return data

    @model_validator(mode="after")
    def _check(self) -> "JobSpec":
        assert RECIPE_NAME[self.optimizer.value] == self.recipe.optimizer.name, (self.optimizer, self.recipe)
        if self.sequence_length is None and self.model.max_sequence_length > DEFAULT_MAX_SEQUENCE:
            note(f"not set: training {self.model.name} on {DEFAULT_MAX_SEQUENCE} tokens per sample"
                 f" (its context is {self.model.max_sequence_length:,}); set sequence_length to choose", field="sequence_length")
        if self.sequence_length and self.sequence_length > self.model.max_sequence_length and self.model.learned_positions:
            raise ValueError(f"sequence_length {self.sequence_length} exceeds {self.model.name}'s learned"
                             f" position table of {self.model.max_sequence_length}")
        if self.model.sliding_window and self.seq > self.model.sliding_window:
            raise ValueError(f"sequence length {self.seq} exceeds {self.model.name}'s sliding attention window of"
                             f" {self.model.sliding_window}, which Sailor does not implement (set sequence_length"
                             f" <= {self.model.sliding_window}: within it the window changes nothing)")
        return self

    @property
    def seq(self) -> int:
        """Tokens per sample: `sequence_length`, else the model's context up to DEFAULT_MAX_SEQUENCE."""
        return self.sequence_length or min(self.model.max_sequence_length, DEFAULT_MAX_SEQUENCE)

    @property
    def elem_bytes(self) -> int:
        """Bytes per activation element: 4 for fp32, 2 for bf16/fp16."""
        return 4 if self.precision == "fp32" else 2

    @property
    def state_bytes_per_param(self) -> dict[str, int]:
        """Bytes per parameter for weights, gradients and optimizer state, unsharded
        (`STATE_BYTES_PER_PARAM`; fp16 in Sailor's runtime keeps fp32 gradients, as bf16 does; SGD with
        momentum adds its fp32 momentum buffer, 4 bytes, to "optimizer")."""
        precision = "bf16" if self.precision == "fp16" and self.framework is not Framework.MEGATRON else self.precision
        counts = STATE_BYTES_PER_PARAM[(precision, self.optimizer)]
        if self.optimizer is Optimizer.SGD and self.recipe.optimizer.momentum:  # one fp32 momentum buffer
            counts = {**counts, "optimizer": counts["optimizer"] + 4}  # (torch.optim.SGD's momentum_buffer)
        return counts

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; built-in models are written by name, the default framework and the
        default recipe are left out (so job files written before they existed read back the same); a
        sequence length cut to DEFAULT_MAX_SEQUENCE is written (files made from it say it)."""
        d = self.model_dump(mode="json")
        if self.recipe == Recipe.model_validate({"optimizer": {"name": RECIPE_NAME[self.optimizer.value]}}):
            del d["recipe"]
        if self.sequence_length is None and self.seq != self.model.max_sequence_length:
            d["sequence_length"] = self.seq
        from sailor.model.registry import BUILTIN_MODELS
        if BUILTIN_MODELS.get(self.model.name) == self.model:
            d["model"] = self.model.name
        if self.framework is Framework.SAILOR:
            del d["framework"]
        return d


