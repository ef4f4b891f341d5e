"""Sailor: plan, simulate and run LLM training on heterogeneous, geo-distributed, changing GPU clusters.

Data flows one way: specs (`specs`, `models`, `catalog`, `profiles`, `network`) -> `planner` <->
`simulator` -> `plan` -> `runtime` <- `elastic`. The modules below `runtime` never import torch.
"""

__version__ = "0.1.0"
