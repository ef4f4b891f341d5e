"""Bytes crossing zones, itemised per zone pair and kind: what the simulator charges as egress.

The terms that charge a transfer name each crossing as they charge it: a pipeline's boundary
transfer (`terms.link_transfer`, kept per micro-batch in `PipelineTimes.crossings`), each edge
of a gradient-sync ring between two zones (`collectives.ring_crossings`) and each pair of an
expert-parallel all-to-all in two zones (`collectives.all_to_all_crossings`). Their totals are the
simulator's bytes across zones and egress $ (`totals`), and `simulate` adds them up per zone pair
and kind into `Estimate.traffic` (`tally`), so the pairs add up to `Estimate.cross_zone_bytes` and
`Estimate.egress_per_iteration_usd`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

ZonePair = tuple[str, str]
"""Two zone names, sorted: traffic between two zones counts both directions together."""


class TrafficKind(str, Enum):
    """What a crossing carries."""

    P2P = "p2p"
    """Activations and their gradients between consecutive stages (chunks) of a pipeline."""
    SYNC = "sync"
    """Gradient reductions across pipelines: each stage's sync and the tied-embedding all-reduce."""
    ALL_TO_ALL = "all-to-all"
    """Expert parallelism's dispatch and combine among the replicas of an EP group (`simulator.experts`)."""


@dataclass(frozen=True)
class Crossing:
    """Bytes one transfer or one ring edge moves between two zones (both directions), with their
    egress $ at the price of the pair's link class."""

    zones: ZonePair
    moved_bytes: float
    egress_usd: float

    @classmethod
    def between(cls, a: str, b: str, moved_bytes: float, egress_usd: float) -> Crossing:
        """The crossing between zones `a` and `b`, in either order."""
        return cls((a, b) if a <= b else (b, a), moved_bytes, egress_usd)

    def scaled(self, factor: float) -> Crossing:
        """The same crossing with `factor` times its bytes and $ (e.g. a collective's share of a ring)."""
        return Crossing(self.zones, factor * self.moved_bytes, factor * self.egress_usd)


def totals(crossings: Iterable[Crossing]) -> tuple[float, float]:
    """(bytes, egress $) of `crossings`, added in their order."""
    moved, usd = 0.0, 0.0
    for c in crossings:
        moved += c.moved_bytes
        usd += c.egress_usd
    return moved, usd


@dataclass(frozen=True)
class ZoneTraffic:
    """Bytes per iteration of one kind crossing between two zones, and their egress $ per iteration."""

    zones: ZonePair
    kind: TrafficKind
    moved_bytes: float
    egress_usd: float

    def to_dict(self) -> dict[str, Any]:
        return {"zones": list(self.zones), "kind": self.kind.value, "bytes_per_iteration": self.moved_bytes,
                "egress_usd_per_iteration": self.egress_usd}


def tally(items: Iterable[tuple[TrafficKind, Crossing, int]]) -> list[ZoneTraffic]:
    """Crossings added up per (zone pair, kind), each taken `count` times per iteration (a pipeline's
    boundary transfer once per micro-batch, a sync crossing once: `sync.stage_sync_crossings` already
    counts each collective's runs, the ZeRO-2/3 reduce-scatter's once per micro-batch round); sorted by
    zone pair, then kind."""
    sums: dict[tuple[ZonePair, TrafficKind], list[float]] = {}
    for kind, c, count in items:
        acc = sums.setdefault((c.zones, kind), [0.0, 0.0])
        acc[0] += c.moved_bytes * count
        acc[1] += c.egress_usd * count
    return [ZoneTraffic(zones, kind, moved, usd) for (zones, kind), (moved, usd)
            in sorted(sums.items(), key=lambda kv: (kv[0][0], kv[0][1].value))]
