"""The runtime: executes any Plan exactly with torch.distributed (gloo on CPU, NCCL on GPU).

Modules, one concept each, applied in this order by `worker`:
- `topology` (torch-free): Plan -> each rank's role, pipeline neighbours and sync groups;
  `messages` (torch-free): the pipeline's point-to-point channels and each rank's transfers in order;
  `groups` creates the torch process groups from them (one 2-rank group per channel);
  `comm_check` (torch-free): a model of one step's communication under NCCL's rules (CPU tests).
- `model`: a plain single-device GPT as the layer list (embedding, blocks, head), canonical names.
- `pipeline.build_stage`: keep one stage's layers; `tensor_parallel.apply_tp`: shard them (and
  sequence parallelism); `recompute.apply_recompute`: activation recomputation.
- `worker.materialize`: seeded full weights (or a checkpoint's), sharded for the TP rank;
  `hf_weights`: Hugging Face safetensors in (per stage and TP shard) and out (`sailor export`).
- `zero.ShardedAdamW`: AdamW with ZeRO-0..3 over `buckets` (which ranks sum, shard and update which
  elements: the sample-weighted gradient sum), global-norm clipping, mixed precision (SGD too, as the
  job's recipe says); `tied`: which ranks add which elements of a tied embedding's two copies;
  `optim`: its settings, from the job's recipe (`specs.recipe`; each step's learning rate is
  `specs.recipe.learning_rate`); `scaler`: fp16's dynamic loss scale (skipped steps on overflow).
- `pipeline.run_pipeline`: the schedule's op order (1F1B, interleaved 1F1B, ZB-H1) with its
  transfers; `executor`: one stage's layers for one micro-batch, with the optimizer's layer hooks
  (ZeRO-3 gathers, ZeRO-2/3 reduce-scatters) and activation metering; `moe`: mixture-of-experts
  MLPs (TP, EP all-to-all); `balance`: their load-balancing loss, per micro-batch across stages.
- `data`: deterministic samples of byte tokens or memory-mapped token files (`tokens`, made by
  `dataprep`); `checkpoint`: plan-independent, atomic, checksummed, the newest kept; `metrics`: MFU,
  TensorBoard; `evaluation`: held-out loss through the plan's pipeline, forwards only.
- `command` (torch-free): the worker's settings and its command line, the one builder every launch
  path uses; `launcher`: validation and torchrun; `reference`: the single-process loop every plan
  must match.
Importing this package does not import torch.
"""
