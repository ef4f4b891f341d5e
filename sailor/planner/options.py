"""Planner settings: objective, search space, constraints and bounds of the search."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from sailor.core.errors import SailorInputError
from sailor.core.units import HOUR_S

# Clusters of at most this many GPUs are searched in exact mode (engine.py: every pipeline kind and
# count vector when few enough, valid bounds; the brute-force tests check it).
EXACT_MAX_GPUS = 32


class Objective(str, Enum):
    """What to optimise. With a fixed global batch, these are time-to-train and cost-to-train."""

    THROUGHPUT = "throughput"  # maximise iterations/s
    COST = "cost"              # minimise $/iteration


class SearchSpace(str, Enum):
    """`full`: our space. `paper`: the published one (even layer split, equal batch per pipeline, one
    TP per GPU type by its fixed rule, each stage's replicas on any GPU types of one region).
    `homogeneous`: one GPU type in one zone, uniform TP, even split, equal shares."""

    FULL = "full"
    PAPER = "paper"
    HOMOGENEOUS = "homogeneous"


LIMIT_TOLERANCE = 1e-9  # relative; `Constraints.ok`


@dataclass(frozen=True)
class Constraints:
    """Limits a plan must respect (None = no limit). Units: $/iteration, $/hour, iterations/s."""

    max_cost_per_iteration: float | None = None
    max_cost_per_hour: float | None = None
    min_throughput: float | None = None

    def ok(self, time_s: float, cost_usd: float) -> bool:
        """Whether an iteration of `time_s` seconds and `cost_usd` $ meets every limit, within a
        relative LIMIT_TOLERANCE: the closed form and the event simulation of one plan can differ in
        their last bits, and a limit copied from a printed figure is that figure."""
        if self.max_cost_per_iteration is not None and cost_usd > self.max_cost_per_iteration * (1 + LIMIT_TOLERANCE):
            return False
        if self.max_cost_per_hour is not None and cost_usd * HOUR_S / time_s > self.max_cost_per_hour * (1 + LIMIT_TOLERANCE):
            return False
        if self.min_throughput is not None and 1.0 / time_s < self.min_throughput * (1 - LIMIT_TOLERANCE):
            return False
        return True


# Fraction of every GPU's memory a plan leaves free. The simulator's memory model misses measured
# peaks by up to ~5 % on the GPU type it was calibrated on (GH200: 3.3 % worst on OPT-350, 4.6 % on
# the held-out GPT-Neo runs but one outlier; README "Measured results"), and GPU types without
# measured runs rely on catalog framework constants (gpus.yaml) that no run has checked; 10 % of a
# 16 GiB V100 is 1.6 GiB, about that framework constant.
DEFAULT_MEMORY_MARGIN = 0.10


@dataclass
class PlanOptions:
    """Search settings. `max_stages` bounds P; `max_mbs` the micro-batch size; `top_k` the
    alternatives kept; `rescore` how many closed-form finalists get the event simulation;
    `memory_per_partition` how many memory-option candidates per layer partition (the lightest,
    `space.memory_candidates`) are searched (in every mode: it is part of the space);
    `time_limit_s` stops the search after that many seconds with the best plan found (an error when
    none was; None: no limit);
    `memory_margin` the fraction of each GPU's memory a plan must leave free (0 <= margin < 1,
    default DEFAULT_MEMORY_MARGIN): a stage fits when its predicted peak is at most
    (1 - margin) x the GPU's memory;
    `schedules` whether the full search also tries ZB-H1 and interleaved 1F1B on its finalists and
    the best plan of each pipeline depth (`planner.schedules`; the published planner's space is 1F1B
    only).
    Raises SailorInputError for a margin outside [0, 1)."""

    objective: Objective = Objective.THROUGHPUT
    constraints: Constraints = field(default_factory=Constraints)
    search: SearchSpace = SearchSpace.FULL
    max_stages: int = 16
    max_mbs: int = 32
    top_k: int = 5
    rescore: int = 8
    memory_per_partition: int = 2
    time_limit_s: float | None = None
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    schedules: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.memory_margin < 1.0:
            raise SailorInputError(f"memory margin must be in [0, 1), got {self.memory_margin}",
                                   source="--memory-margin", fix="a fraction of each GPU's memory, e.g. 0.1")


def objective_key(objective: Objective) -> Callable[[float, float], tuple[float, float]]:
    """Sort key of a (iteration time s, $/iteration) pair under `objective`: smaller is better."""
    if objective is Objective.THROUGHPUT:
        return lambda t, c: (t, c)
    return lambda t, c: (c, t)
