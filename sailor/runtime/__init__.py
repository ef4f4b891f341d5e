"""The runtime: executes any Plan exactly with torch.distributed (gloo on CPU, NCCL on GPU).

Modules, one concept each, applied in this order by `worker`:
- `topology` (torch-free): Plan -> each rank's role, pipeline neighbours and sync groups;
  `groups` creates the torch process groups from it.
- `model`: a plain single-device GPT as the layer list (embedding, blocks, head), canonical names.
- `pipeline.build_stage`: keep one stage's layers; `tensor_parallel.apply_tp`: shard them.
- `worker.materialize`: seeded full weights (or a checkpoint's), sharded for the TP rank.
- `pipeline.run_pipeline`: the 1F1B schedule; `grad_sync`: sample-weighted gradient sum over the
  ranks holding each block, then global-norm clipping; `optim`: AdamW.
- `data`: deterministic byte-token samples; `checkpoint`: plan-independent, atomic, checksummed.
- `launcher`: validation and torchrun; `reference`: the single-process loop every plan must match.
Importing this package does not import torch.
"""
