"""Create the torch process groups a topology needs (the one place groups are made)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from sailor.runtime.topology import Ranks, Topology


def create_groups(topology: Topology, timeout: timedelta) -> dict[Ranks, dist.ProcessGroup]:
    """Every group of `topology.groups()`, created collectively by all ranks in the same order;
    returns those this rank belongs to, keyed by their rank tuple. Collectives in them time out after
    `timeout`."""
    me = dist.get_rank()
    mine = {}
    for ranks in topology.groups():
        group = dist.new_group(list(ranks), timeout=timeout)
        if me in ranks:
            mine[ranks] = group
    return mine
