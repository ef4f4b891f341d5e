"""Phase 2 of the planner's search: how many pipelines of each kind (a count vector), within the GPUs.

Exact (small spaces): `count_vectors` lists every count vector the free GPUs allow.

Large spaces: a makespan target τ turns the choice into packing. A pipeline of kind k finishes
cap_k(τ) micro-batches by τ (`kinds.Curve.cap`), so the plans of makespan <= τ are the count vectors
with Σ_k n_k·cap_k(τ) >= M that fit the GPUs. Kinds that sit in one (zone, GPU type) pool do not
compete with each other across pools, so the most micro-batches the GPUs finish by τ is a sum over
pools of a small knapsack each (`PoolPacking`: per pool, every kind as the main one, as many as fit,
then the best kind for the rest). Kinds over several pools (memory-mixed, spanning) enter as fixed
bases: a greedy count of them first, the pools' packing on what they leave (`Packer.variants`).

- throughput: the smallest τ whose packing reaches M, found by bisection on τ (a number of steps
  that depends on the precision wanted, log2 of the range of τ: not on the global batch beyond
  that logarithm), then pipelines the batch does not need are dropped (`trim`); and the same
  without pools it uses (`fastest_packings`, `leave_pools_out`);
- cost: at each τ of a geometric grid (`Packer.tau_grid`), the cheapest cover of M (pipelines taken in order of $ per
  micro-batch finished by τ), trimmed likewise: the trade-off curve between time and $/iteration.
Each count vector found is scored exactly (`score.Scorer`) by the caller.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np

from sailor.planner.kinds import Kind, Pool

BISECTION_STEPS = 60  # at most; the bisection stops at a relative precision of 1e-9 in τ
# (at most this many kinds, bisection steps asked at once, `bisect`); more kinds: one at a time. Per
# step, a call over 2^levels - 1 makespans against one call per step (2-core machine): 4 pay most
# up to ~60 kinds, 3 up to ~160; beyond ~200 the work per makespan outweighs the cost of a call
BATCH_LEVELS = ((64, 4), (160, 3))
GRID_PER_DOUBLING = 2  # makespan targets of the cost trade-off per doubling of the makespan (`Packer.tau_grid`)
# left-out pool sets `fastest_packings` tries (none, then one pool at a time, `drop_order`): each a
# packing to find and score; 2 (one pool left out) keeps us12 under 1.1 GB and allzones within its target
FASTEST_RUNS = 2

T = TypeVar("T")


def count_vectors(kinds: list[Kind], free: dict[Pool, int], limit: int) -> list[tuple[int, ...]] | None:
    """Every non-zero count vector over `kinds` that fits the free GPUs, or None as soon as there are
    more than `limit` of them (kind by kind, each partial vector extended by every count that fits;
    a step keeps, per partial vector, its parent and the count it added)."""
    pools = sorted(free)
    index = {p: j for j, p in enumerate(pools)}
    left = np.array([[free[p] for p in pools]], dtype=np.int64)  # (states, pools)
    steps: list[tuple[np.ndarray, np.ndarray]] = []               # per kind: (parent state, count)
    for kind in kinds:
        use = np.zeros(len(pools), dtype=np.int64)
        for p, g in kind.use:
            use[index[p]] = g
        need = use > 0
        reps = (left[:, need] // use[need]).min(axis=1) + 1         # counts 0..most per state
        if int(reps.sum()) > limit + 1:
            return None
        parent = np.repeat(np.arange(len(left)), reps)
        n = np.arange(len(parent)) - np.repeat(np.cumsum(reps) - reps, reps)
        left = left[parent] - n[:, None] * use[None, :]
        steps.append((parent, n))
    vecs = np.zeros((len(left), len(kinds)), dtype=np.int64)
    state = np.arange(len(left))
    for k in range(len(kinds) - 1, -1, -1):  # walk back from the last kind to the first
        parent, n = steps[k]
        vecs[:, k] = n[state]
        state = parent[state]
    return [tuple(int(x) for x in v) for v in vecs if v.any()]


def caps_at(fill: np.ndarray, two: np.ndarray, period: np.ndarray, tau: float | np.ndarray) -> np.ndarray:
    """`Curve.cap` of every kind at τ, vectorised (the same rounding): (kinds,) for a number τ, (T, kinds)
    for τ of shape (T, 1)."""
    eps = 1e-12 * np.maximum(1.0, np.abs(tau))
    steady = 2 + np.floor((tau - two) / period + 1e-9)
    return np.where(tau < fill - eps, 0, np.where(tau < two - eps, 1, steady)).astype(np.int64)


@dataclass
class PoolPacking:
    """Per pool, the packings tried at any τ: (main kind k, n_k = free // G_k, second kind j,
    n_j = (free - n_k·G_k) // G_j); `best` takes the best of them in every pool.

    Attributes: arrays over all (pool, k, j) triples, grouped by pool; `starts` the first triple of
    each pool (for np.maximum.reduceat), `owner` each triple's pool (its index in `pools`, sorted).
    The pools' packings are independent, so leaving pools out (`keep`, a bool per pool) drops their
    terms and nothing else. `capacity` needs only the best kind of each GPU count:
    n_k and the GPUs left depend on k through G_k alone, so the best (k, j) of a pool takes, for
    its (G_k, G_j), the kinds of most micro-batches among those of G_k GPUs and of G_j GPUs; the
    `by_size` arrays hold those (pool, G, G') rows (`order`, `groups`: the kinds in (pool, G) groups,
    and where each group starts; `first`, `n_first`, `then`, `n_then`: a row's two groups and
    counts; `row_starts`: each pool's first row)."""

    main: np.ndarray
    n_main: np.ndarray
    second: np.ndarray
    n_second: np.ndarray
    starts: np.ndarray
    owner: np.ndarray
    pools: list[Pool]
    kinds: list[int]  # the kinds of some row
    by_size: tuple[np.ndarray, ...]

    @classmethod
    def build(cls, single: list[tuple[int, Pool, int]], free: dict[Pool, int]) -> "PoolPacking | None":
        """`single`: (kind index, its pool, GPUs per pipeline) of kinds that use one pool."""
        by_pool: dict[Pool, list[tuple[int, int]]] = {}
        for k, p, g in single:
            if free.get(p, 0) >= g:
                by_pool.setdefault(p, []).append((k, g))
        if not by_pool:
            return None
        pools = sorted(by_pool)
        ks = np.array([k for p in pools for k, _ in by_pool[p]], dtype=np.int64)  # by pool, in kind order
        gs = np.array([g for p in pools for _, g in by_pool[p]], dtype=np.int64)
        owner = np.repeat(np.arange(len(pools)), [len(by_pool[p]) for p in pools])
        avail = np.array([free[p] for p in pools], dtype=np.int64)[owner]
        n = avail // gs
        first, second, starts = _pairs(np.bincount(owner, minlength=len(pools)))
        # the (pool, GPU count) groups: kinds sorted by pool, then GPUs (stable)
        order = np.lexsort((gs, owner))
        change = np.ones(len(order), dtype=bool)
        change[1:] = (owner[order][1:] != owner[order][:-1]) | (gs[order][1:] != gs[order][:-1])
        groups = np.nonzero(change)[0]
        size, room = gs[order][groups], avail[order][groups]
        g1, g2, row_starts = _pairs(np.bincount(owner[order][groups], minlength=len(pools)))
        by_size = (ks[order], groups, g1, (room // size)[g1], g2, (room - (room // size) * size)[g1] // size[g2],
                   row_starts)
        return cls(ks[first], n[first], ks[second], (avail - n * gs)[first] // gs[second], starts, owner[first],
                   pools, np.unique(ks).tolist(), by_size)

    def keep(self, without: frozenset[Pool]) -> np.ndarray | None:
        """A bool per pool, false for those of `without`; None when it leaves none out."""
        if not without:
            return None
        return np.array([p not in without for p in self.pools])

    def capacity(self, caps: np.ndarray, keep: np.ndarray | None = None) -> int | np.ndarray:
        """Most micro-batches the pools' packings (those `keep` keeps) finish at these per-kind
        capacities (the best row of each pool summed), from the best kind of each GPU count (class
        docstring); caps (kinds,) give a number, caps (T, kinds) one per row, (T,)."""
        order, groups, first, n_first, then, n_then, row_starts = self.by_size
        best = np.maximum.reduceat(caps[..., order], groups, axis=-1)   # per (pool, GPU count) group
        vals = n_first * best[..., first] + n_then * best[..., then]
        per_pool = np.maximum.reduceat(vals, row_starts, axis=-1)
        out = (per_pool if keep is None else per_pool * keep).sum(axis=-1)
        return int(out) if caps.ndim == 1 else out

    def counts(self, caps: np.ndarray, n_kinds: int, keep: np.ndarray | None = None) -> np.ndarray:
        """The counts of the best row of each pool (`keep` keeps; the first of equal rows) that
        finishes something, at these per-kind capacities (kinds,)."""
        vals = self.n_main * caps[self.main] + self.n_second * caps[self.second]
        best = np.maximum.reduceat(vals, self.starts)[self.owner]
        at = np.flatnonzero(vals == best)
        rows = at[np.unique(self.owner[at], return_index=True)[1]]  # each pool's first best row
        rows = rows[(vals[rows] > 0) & (True if keep is None else keep[self.owner[rows]])]
        out = np.bincount(self.main[rows], weights=self.n_main[rows], minlength=n_kinds)
        out += np.bincount(self.second[rows], weights=self.n_second[rows], minlength=n_kinds)
        return out.astype(np.int64)


def _pairs(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every ordered pair of items inside each group, for items numbered group by group (`sizes`
    items in each): (first item, second item) arrays, the first item outer and the second inner,
    group by group, and the first pair of each group."""
    begin = np.cumsum(sizes) - sizes
    owner = np.repeat(np.arange(len(sizes)), sizes)
    reps = sizes[owner]                                   # each item pairs with every item of its group
    first = np.repeat(np.arange(len(owner)), reps)
    row = np.cumsum(reps) - reps
    second = np.repeat(begin[owner], reps) + np.arange(len(first)) - np.repeat(row, reps)
    return first, second, np.cumsum(sizes * sizes) - sizes * sizes


def bisect(enough: Callable[[np.ndarray], np.ndarray], lo: float, hi: float, levels: int) -> tuple[float, float]:
    """(lo, hi) after the bisection `while hi - lo > 1e-9·hi: mid = (lo + hi) / 2; hi = mid if
    enough(mid) else lo = mid`, at most BISECTION_STEPS steps, `enough` vectorised ((T,) -> (T,) of
    bools). It is asked `levels` steps at a time, at every midpoint the next `levels` steps could
    reach (2^levels - 1 of them, found by the same arithmetic), so the result is the step-by-step
    bisection's, in fewer calls (a call over many τ costs about what one over a single τ does where
    the kinds are few)."""
    steps = 0
    while steps < BISECTION_STEPS and hi - lo > 1e-9 * hi:
        depth = min(levels, BISECTION_STEPS - steps)
        mids: list[float] = []
        level = [(lo, hi)]
        for _ in range(depth):  # the midpoints each path of `depth` steps may take, level by level
            nxt = []
            for a, b in level:
                if b - a > 1e-9 * b:
                    mid = 0.5 * (a + b)
                    mids.append(mid)
                    nxt += [(a, mid), (mid, b)]
            level = nxt
        ok = dict(zip(mids, enough(np.array(mids)).tolist()))
        for _ in range(depth):
            if hi - lo <= 1e-9 * hi:
                break
            mid = 0.5 * (lo + hi)
            if ok[mid]:
                hi = mid
            else:
                lo = mid
            steps += 1
    return lo, hi


class Packer:
    """Packings of `kinds` into the free GPUs for M micro-batches (see the module docstring).
    `sync`: (kind index, D) -> all-reduce seconds of D pipelines of that kind; breaks ties between
    kinds of equal $ per micro-batch in `cheapest` (the same GPUs in zones with different links)."""

    def __init__(self, kinds: list[Kind], free: dict[Pool, int], M: int,
                 sync: Callable[[int, int], float] | None = None) -> None:
        self.kinds, self.free, self.M = kinds, free, M
        self.sync = sync or (lambda i, D: 0.0)
        self.fill = np.array([k.fill_s for k in kinds])
        self.two = np.array([k.two_s for k in kinds])
        self.period = np.array([k.period_s for k in kinds])
        self.single = [(i, k.use[0][0], k.use[0][1]) for i, k in enumerate(kinds) if len(k.use) == 1]
        self.multi = [i for i, k in enumerate(kinds) if len(k.use) > 1]
        self._packs: dict[bytes, PoolPacking | None] = {}  # `_rest` per base

    def caps(self, tau: float) -> np.ndarray:
        return caps_at(self.fill, self.two, self.period, tau)

    def _outside(self, i: int, without: frozenset[Pool]) -> bool:
        """Kind i has no GPUs in a pool of `without`."""
        return not any(p in without for p, _ in self.kinds[i].use)

    def variants(self, without: frozenset[Pool] = frozenset()) -> Iterator[np.ndarray]:
        """Fixed bases of multi-pool kinds with no GPUs in a pool of `without`: none, and as many as
        fit greedily (kinds in order of micro-batches per GPU at their own single-pipeline time for M)."""
        yield np.zeros(len(self.kinds), dtype=np.int64)
        multi = [i for i in self.multi if self._outside(i, without)]
        if not multi:
            return
        base = np.zeros(len(self.kinds), dtype=np.int64)
        left = dict(self.free)
        order = sorted(multi, key=lambda i: self.kinds[i].period_s * self.kinds[i].gpus)
        for i in order:
            n = self.kinds[i].fits(left)
            if n:
                base[i] = n
                for p, g in self.kinds[i].use:
                    left[p] -= g * n
        yield base

    def _rest(self, base: np.ndarray) -> PoolPacking | None:
        """The pools' packing on the GPUs `base` leaves (memoised per base)."""
        key = base.tobytes()
        if key not in self._packs:
            left = dict(self.free)
            for i in np.nonzero(base)[0]:
                for p, g in self.kinds[i].use:
                    left[p] -= g * int(base[i])
            self._packs[key] = PoolPacking.build(self.single, left)
        return self._packs[key]

    def fastest(self, base: np.ndarray, without: frozenset[Pool] = frozenset()) -> tuple[float, np.ndarray] | None:
        """(τ, counts): the smallest τ (by bisection) at which `base` plus the pools' best packing
        finish M micro-batches, and those counts; None when no τ does. Kinds with GPUs in a (zone,
        GPU type) pool of `without` are left out (`fastest_packings`: the packing does not see the
        gradient sync, which a pool more in another zone can slow down); `base` has none of them."""
        pack = self._rest(base)
        keep = pack.keep(without) if pack else None
        fixed = np.nonzero(base)[0]

        def capacity(tau: float | np.ndarray) -> int | np.ndarray:  # a number, or (T, 1) -> (T,)
            caps = self.caps(tau)
            total = pack.capacity(caps, keep) if pack else 0
            return total + (base[fixed] * caps[..., fixed]).sum(axis=-1) if len(fixed) else total

        single = {i for i in pack.kinds if self._outside(i, without)} if pack else set()
        usable = sorted({int(i) for i in fixed} | single)
        if not usable:
            return None
        lo = float(self.fill[usable].min())
        hi = float(max(self.kinds[i].time_s(self.M) for i in usable))  # every usable kind alone finishes M
        if capacity(hi) < self.M:
            return None
        if capacity(lo) >= self.M:
            hi = lo
        levels = next((n for most, n in BATCH_LEVELS if len(self.kinds) <= most), 1)
        lo, hi = bisect(lambda taus: capacity(taus[:, None]) >= self.M, lo, hi, levels)
        caps = self.caps(hi)
        counts = base + (pack.counts(caps, len(self.kinds), keep) if pack else 0)
        return hi, trim(counts, caps, self.M, key=lambda i: caps[i])

    def max_capacity(self, base: np.ndarray, tau: float) -> np.ndarray:
        """Counts of the pools' best packing at τ on top of `base`, trimmed to what M needs."""
        pack = self._rest(base)
        caps = self.caps(tau)
        counts = base + (pack.counts(caps, len(self.kinds)) if pack else 0)
        return trim(counts, caps, self.M, key=lambda i: caps[i])

    def cheapest(self, tau: float, without: frozenset[Pool] = frozenset()) -> np.ndarray | None:
        """Fewest $/hour of pipelines that finish M micro-batches by τ: kinds in order of $/hour per
        micro-batch finished by τ, each as many as needed and fit; None if the GPUs cannot. Kinds
        with GPUs in a (zone, GPU type) pool of `without` are left out (`tradeoff.trade_off`: the
        greedy does not see egress, which a pool more in another zone can add, nor the schedules
        tried later)."""
        caps = self.caps(tau)
        left = dict(self.free)
        counts = np.zeros(len(self.kinds), dtype=np.int64)
        need = self.M
        tie = {i: self.sync(i, -(-self.M // int(caps[i]))) for i in range(len(self.kinds))
               if caps[i] > 0 and self._outside(i, without)}
        order = sorted(tie, key=lambda i: (self.kinds[i].usd_per_hour / caps[i], tie[i]))
        for i in order:
            if need <= 0:
                break
            n = min(self.kinds[i].fits(left), -(-need // int(caps[i])))
            if n:
                counts[i] = n
                need -= n * int(caps[i])
                for p, g in self.kinds[i].use:
                    left[p] -= g * n
        if need > 0:
            return None
        return trim(counts, caps, self.M, key=lambda i: (-self.kinds[i].usd_per_hour / caps[i], -tie[i]))

    def tau_grid(self, lo: float) -> list[float]:
        """Makespan targets from `lo` (s) up to the slowest kind running the whole batch alone: `lo`,
        the points 2^(j/GRID_PER_DOUBLING) s between (one lattice for every cluster and family), and
        that end. A cluster with more GPUs packs no slower (`lo`) and has every kind of the smaller
        one (the end), so its grid holds every lattice point of the smaller one's."""
        hi = float(max(k.time_s(self.M) for k in self.kinds))
        if hi <= lo:
            return [lo]
        first = math.floor(GRID_PER_DOUBLING * math.log2(lo)) + 1
        last = math.ceil(GRID_PER_DOUBLING * math.log2(hi)) - 1
        return [lo] + [2.0 ** (j / GRID_PER_DOUBLING) for j in range(first, last + 1)] + [hi]


def trim(counts: np.ndarray, caps: np.ndarray, M: int, key) -> np.ndarray:
    """Drop pipelines the batch does not need (the capacity stays >= M), least useful first by
    `key(kind index)` (smallest first). The result has at most M pipelines."""
    counts = counts.copy()
    total = int((counts * caps).sum())
    for i in sorted((i for i in np.nonzero(counts)[0] if caps[i] > 0), key=key):
        if total <= M:
            break
        drop = min(int(counts[i]), (total - M) // int(caps[i]))
        counts[i] -= drop
        total -= drop * int(caps[i])
    for i in np.nonzero(counts)[0]:  # a pipeline that finishes nothing by τ has no place in the plan
        if caps[i] == 0:
            counts[i] = 0
    return counts


def leave_pools_out(kinds: list[Kind], find: Callable[[frozenset[Pool]], Iterable[T]],
                    counts_of: Callable[[T], np.ndarray], runs: int,
                    expand: Callable[[T], bool] | None = None) -> list[tuple[frozenset[Pool], T]]:
    """(pools left out, item) for the items `find(without)` returns with no pool left out and,
    recursively, with `without` plus each (zone, GPU type) pool that the count vectors of its items
    (`counts_of(item)`, over `kinds`) use, where `expand(item)` (when given) is true: left-out sets
    with fewest pools first, then in `drop_order`, at most `runs` calls of `find`, the first item of
    each count vector kept.

    Why a cluster with a pool q more keeps the items of the cluster without it (within `runs`), when
    `find` over kinds with none in the pools of W ∪ {q} is the smaller cluster's `find(W)` and an
    item that uses no pool of q is the smaller cluster's item too (`Packer.cheapest`,
    `Packer.fastest`): each set the smaller cluster tries is tried by the larger one, as it is or
    with q, by induction over the pools left out."""
    out: list[tuple[frozenset[Pool], T]] = []
    seen: set[tuple[int, ...]] = set()
    tried: set[frozenset[Pool]] = set()
    todo: deque[frozenset[Pool]] = deque([frozenset()])
    while todo and len(tried) < runs:
        without = todo.popleft()
        if without in tried:
            continue
        tried.add(without)
        grown: list[tuple[int, ...]] = []  # the vectors whose pools are left out next
        for item in find(without):
            vec = tuple(int(x) for x in counts_of(item))
            if expand is None or expand(item):
                grown.append(vec)
            if vec not in seen:
                seen.add(vec)
                out.append((without, item))
        todo.extend(without | {p} for p in drop_order(kinds, grown))
    return out


def drop_order(kinds: list[Kind], vecs: list[tuple[int, ...]]) -> list[Pool]:
    """The (zone, GPU type) pools the count vectors `vecs` (over `kinds`) use, in the order
    `leave_pools_out` leaves them out: fewest of their pipelines in the pool's zone first (a zone
    that holds few of them adds a link to their gradient sync and little capacity), then fewest
    in the pool, then by name. Reads zones only through which pools share one, so alike regions
    (`packing_key`) get the same order."""
    in_pool: dict[Pool, int] = {}
    in_zone: dict[str, int] = {}
    for vec in vecs:
        for k, n in zip(kinds, vec):
            if n:
                for z in set(k.zones):
                    in_zone[z] = in_zone.get(z, 0) + n
                for p, _ in k.use:
                    in_pool[p] = in_pool.get(p, 0) + n
    return sorted(in_pool, key=lambda p: (in_zone[p[0]], in_pool[p], p))


class Packing(NamedTuple):
    """A fastest packing (`fastest_packings`)."""

    base: np.ndarray      # (kinds,) the fixed counts of multi-pool kinds (`Packer.variants`)
    tau: float            # its makespan target (s)
    counts: np.ndarray    # (kinds,) `Packer.fastest`'s counts
    whole: np.ndarray     # (kinds,) those on whole nodes (`round_to_nodes`)
    dropped: int          # (zone, GPU type) pools left out


def fastest_packings(packer: Packer, units: list[int], expand: Callable[[float], bool] | None = None) -> list[Packing]:
    """The fastest packings of `packer` (`Packer.fastest`, for each base of `Packer.variants` that
    has one) with no pool left out and, recursively, without each pool they use (`leave_pools_out`,
    at most FASTEST_RUNS left-out sets), each count vector once; on whole nodes with the kinds'
    `node_unit`s `units`. The packing does not see the gradient sync: a pool more (a zone, or a GPU
    type in a zone) can give a faster makespan whose sync is slower, and the packing without it is
    then the smaller cluster's, so a cluster with a pool more has the packings of the cluster
    without it among its own within FASTEST_RUNS; at FASTEST_RUNS 2, its fastest packing where the
    new pool is unused or the first that `drop_order` leaves out (a pool in the zone holding the
    fewest of the packing's pipelines).

    `expand(τ)`, when given, false: no packing of makespan τ or more is wanted, so the pools of a
    packing of makespan τ are not left out (a packing leaving out more pools is no faster)."""
    def find(without: frozenset[Pool]) -> Iterator[tuple[np.ndarray, float, np.ndarray]]:
        for base in packer.variants(without):
            got = packer.fastest(base, without)
            if got is not None:
                yield (base, *got)

    found = leave_pools_out(packer.kinds, find, lambda x: x[2], FASTEST_RUNS,
                            None if expand is None else lambda x: expand(x[1]))
    return [Packing(base, tau, counts, round_to_nodes(counts, units, packer.kinds, packer.free), len(without))
            for without, (base, tau, counts) in found]


def packing_key(kinds: list[Kind], free: dict[Pool, int], M: int) -> tuple:
    """All that `fastest_packings` reads of its packer (over `kinds`, `free`, M micro-batches, no
    sync) with each zone replaced by its rank among the zones of `free` by name: M, the free GPUs per
    pool and, per kind in order, its curve, GPUs and GPUs per pool. The packing reads numbers and the
    order of pools (sorted by name: by rank, then GPU type), never a zone's name, so two scopes of
    one key (e.g. regions whose zones offer the same GPUs with kinds of the same curves) have equal
    packings, as count vectors over their kind lists."""
    rank = {z: j for j, z in enumerate(sorted({z for z, _ in free}))}

    def pools(use) -> tuple:
        return tuple(((rank.get(z, z), g), n) for (z, g), n in use)

    return (M, pools(sorted(free.items())),
            tuple((k.fill_s, k.two_s, k.period_s, k.gpus, pools(k.use)) for k in kinds))


def node_unit(kind: Kind, node_size: Callable[[str], int]) -> int:
    """Fewest pipelines of `kind` whose GPUs fill whole nodes in every pool they use
    (`node_size(gpu)` GPUs per node): e.g. 2 for one-stage TP-2 pipelines on 4-GPU nodes."""
    unit = 1
    for (_, gpu), g in kind.use:
        s = node_size(gpu)
        unit = math.lcm(unit, s // math.gcd(s, g))
    return unit


def round_to_nodes(counts: np.ndarray, units: list[int], kinds: list[Kind], free: dict[Pool, int]) -> np.ndarray:
    """`counts` with each used kind's count rounded up to a multiple of its `node_unit`, where the
    free GPUs hold it (kinds in order): a trimmed packing can leave one node part-filled, and a
    hierarchical all-reduce over unequal node islands shards by the smallest island, so the plan
    with a few more pipelines on whole nodes can sync much faster."""
    out = counts.copy()
    left = dict(free)
    for k, kind in enumerate(kinds):
        for p, g in kind.use:
            left[p] = left.get(p, 0) - g * int(out[k])
    for k, kind in enumerate(kinds):
        extra = -int(out[k]) % units[k] if out[k] else 0
        if extra and all(left.get(p, 0) >= g * extra for p, g in kind.use):
            out[k] += extra
            for p, g in kind.use:
                left[p] -= g * extra
    return out
