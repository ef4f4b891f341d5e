"""Availability traces: how many GPUs of each type each zone offers, over time.

Three file formats are read (detected from the content):

- CSV as in the public Sailor traces: a `Timestamp` column (Unix seconds) and one column per
  `<gpu>_<zone>` with the GPU count of each row's interval; an unnamed index column is ignored.
  Times are made relative to the first row.
- JSON events: `[{"time_s": 0, "zone": "local", "gpu": "cpu", "count": 4}, ...]`; `count` is the
  number of GPUs of that type in that zone from `time_s` on (seconds from the start of the run).
- The public `a100_trace.json` form `[{"Time": s, "GPUs": n}]`, which names no zone or GPU type:
  it is mapped onto the one (zone, GPU type) the cluster spec lists.

Every format becomes a `Trace`: a list of `Snapshot`s (time, full availability), one per point in
time where something changed. A (zone, GPU type) pair has 0 GPUs before the trace first mentions it.
Zones and GPU types are checked against the cluster's provider, the GPU catalog (aliases are
mapped to canonical names) and the prices: a (zone, GPU type) the trace offers (a count above 0)
needs one, from the cluster spec or the provider's list, and a zone the catalog does not know to
lack the type, or a price for it in that zone in the cluster spec (`ClusterSpec.check_catalog_offers`).
Every problem raises `SailorInputError` naming the file and the entry (a JSON item `[3]`, a CSV
cell `line 4.A100-40_us-central1-a`, or the field in it).

`Availability` is what a running `sailor run` may use now: the snapshot in force, minus GPUs (and,
with `--hosts`, machines) lost to crashes, capped by the machines listed.
"""

from __future__ import annotations

import csv
import io
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from sailor import catalog
from sailor.core.errors import SailorInputError, show
from sailor.core.fileio import parse_json, read_text
from sailor.core.limits import MAX_GPUS_PER_ZONE, MAX_TRACE_POINTS, MAX_TRACE_TIME_S
from sailor.specs.cluster import ClusterSpec

if TYPE_CHECKING:
    from sailor.elastic.remote import HostPool, Machine

Zones = dict[str, dict[str, int]]  # zone -> GPU type -> GPUs available


@dataclass(frozen=True)
class Snapshot:
    """Availability from `time_s` (seconds since the start of the trace) until the next snapshot."""

    time_s: float
    zones: Zones

    def total(self) -> int:
        """GPUs available in all zones together."""
        return sum(n for z in self.zones.values() for n in z.values())


@dataclass(frozen=True)
class Trace:
    """Availability over time: snapshots in increasing time order, the first at time 0 or later;
    `source` is the file it came from. `last_point_s + spacing_s` is where a replay ends by default."""

    snapshots: tuple[Snapshot, ...]
    source: str
    last_point_s: float
    """Time (s) of the trace's last point (a point that changes nothing makes no snapshot)."""
    spacing_s: float | None
    """Seconds between the trace's last two distinct points in time; None for a one-point trace."""

    def at(self, time_s: float) -> Snapshot:
        """The snapshot in force at `time_s` (seconds); before the first point nothing is available."""
        current = Snapshot(0.0, {})
        for s in self.snapshots:
            if s.time_s > time_s:
                break
            current = s
        return current

    def next_change_after(self, time_s: float) -> float | None:
        """Time (s) of the first snapshot strictly after `time_s`, or None when there is none."""
        return next((s.time_s for s in self.snapshots if s.time_s > time_s), None)

    def peak_zones(self) -> Zones:
        """The most GPUs of each (zone, GPU type) at any snapshot: what a run over this trace can be
        offered at most (e.g. the machine profile's TP degrees and load are set by it)."""
        peak: Zones = {}
        for s in self.snapshots:
            for zone, gpus in s.zones.items():
                for gpu, n in gpus.items():
                    peak.setdefault(zone, {})[gpu] = max(n, peak.get(zone, {}).get(gpu, 0))
        return peak



def load_trace(path: str | Path, cluster: ClusterSpec) -> Trace:
    """Read an availability trace in any of the three formats (module docstring).

    Args:
        path: the trace file (.csv, or .json in either JSON form).
        cluster: gives the provider whose zones are valid, and the (zone, GPU type) an
            `[{"Time", "GPUs"}]` trace refers to.
    Returns:
        The trace, with canonical GPU names and times in seconds from its start.
    Raises:
        SailorInputError: unreadable file, a syntax error, a key given twice, missing or unknown
            columns or fields, two CSV columns for one (zone, GPU type), an unknown zone or GPU type,
            a (zone, GPU type) offered without a price, a negative, fractional or too large count,
            two counts for one (zone, GPU type) at one time, a time that is not finite or goes
            backwards, more than MAX_TRACE_POINTS points, or an empty trace.
    """
    src = str(path)
    text = read_text(path)
    stripped = text.lstrip()
    if src.lower().endswith(".json") or stripped.startswith(("[", "{")):
        return _from_json(parse_json(text, src), cluster, src)  # a .json file is JSON, never read as CSV
    return _from_csv(text, cluster, src)


def _from_json(data: Any, cluster: ClusterSpec, src: str) -> Trace:
    if not isinstance(data, list) or not data:
        raise SailorInputError("expected a non-empty list of events", source=src,
                               fix='e.g. [{"time_s": 0, "zone": "local", "gpu": "cpu", "count": 4}]')
    _check_points(len(data), src)
    if all(isinstance(e, dict) and set(e) == {"Time", "GPUs"} for e in data):
        pair = _single_pair(cluster, src)
        return _build([_Event(_time(e["Time"], src, f"[{i}].Time"), *pair, _count(e["GPUs"], src, f"[{i}].GPUs"),
                              f"[{i}]", f"[{i}].Time") for i, e in enumerate(data)], src, cluster)
    events = []
    for i, e in enumerate(data):
        if not isinstance(e, dict):
            raise SailorInputError(f"expected an object, got {type(e).__name__}", source=src, field=f"[{i}]")
        want = {"time_s", "zone", "gpu", "count"}
        if set(e) != want:
            missing, extra = sorted(want - set(e)), sorted(set(e) - want)
            what = "; ".join(x for x in (f"missing {', '.join(missing)}" if missing else "",
                                         f"unknown {', '.join(extra)}" if extra else "") if x)
            raise SailorInputError(f"{what} (an event has time_s, zone, gpu, count)", source=src, field=f"[{i}]")
        zone = _zone(e["zone"], cluster, src, f"[{i}].zone")
        gpu = _gpu(e["gpu"], src, f"[{i}].gpu")
        t = _time(e["time_s"], src, f"[{i}].time_s")
        events.append(_Event(t, zone, gpu, _count(e["count"], src, f"[{i}].count"), f"[{i}]", f"[{i}].time_s"))
    return _build(events, src, cluster)


def _check_points(n: int, src: str) -> None:
    if n > MAX_TRACE_POINTS:
        raise SailorInputError(f"{n} points, more than {MAX_TRACE_POINTS} (sailor.core.limits.MAX_TRACE_POINTS)", source=src,
                               fix="keep the points where availability changes, or cut the trace")


def _from_csv(text: str, cluster: ClusterSpec, src: str) -> Trace:
    reader = csv.reader(io.StringIO(text))
    rows, lines = [], []  # non-blank rows, and the file line each starts on
    try:
        for row in reader:
            if any(c.strip() for c in row):
                rows.append(row)
                lines.append(reader.line_num)
    except csv.Error as e:
        raise SailorInputError(f"invalid CSV: {e}", source=src, field=f"line {reader.line_num}") from None
    if not rows:
        raise SailorInputError("empty trace", source=src)
    header = [h.strip() for h in rows[0]]
    if "Timestamp" not in header:
        raise SailorInputError("no Timestamp column", source=src, field="header",
                               fix="a CSV trace has a Timestamp column and <gpu>_<zone> count columns")
    t_col = header.index("Timestamp")
    columns: list[tuple[int, str, str]] = []  # (column index, zone, gpu)
    for k, name in enumerate(header):
        if k == t_col or (k == 0 and name == ""):
            continue  # the unnamed pandas index column (any other column must name its GPU type and zone)
        zone, gpu = _split_column(name, cluster, src)
        twin = next((j for j, z, g in columns if (z, g) == (zone, gpu)), None)
        if twin is not None:  # e.g. A100_us-central1-a beside A100-40_us-central1-a
            raise SailorInputError(f"a second column for {gpu} in {zone} (the first: column {twin + 1},"
                                   f" {header[twin]!r})", source=src, field=f"header.{name}",
                                   fix="keep one column per GPU type and zone")
        columns.append((k, zone, gpu))
    if not columns:
        raise SailorInputError("no <gpu>_<zone> column", source=src, field="header")
    if len(rows) < 2:
        raise SailorInputError("no data row", source=src)
    _check_points(len(rows) - 1, src)
    events, t0 = [], None
    for line, row in zip(lines[1:], rows[1:]):
        if len(row) != len(header):
            raise SailorInputError(f"{len(row)} fields, the header has {len(header)}", source=src, field=f"line {line}")
        t = _time(_number(row[t_col], src, f"line {line}.Timestamp"), src, f"line {line}.Timestamp", relative=True)
        t0 = t if t0 is None else t0
        for k, zone, gpu in columns:
            cell = f"line {line}.{header[k]}"
            events.append(_Event(t - t0, zone, gpu, _count(_number(row[k], src, cell), src, cell), cell,
                                 f"line {line}.Timestamp"))
    return _build(events, src, cluster)


class _Event(NamedTuple):
    """One count read from a trace file: `count` GPUs of type `gpu` in `zone` from `time_s` (seconds
    from the trace's start) on; `entry` names it in the file (a JSON item "[3]", a CSV cell
    "line 4.A100-40_us-central1-a") and `time_field` where its time came from, for messages."""

    time_s: float
    zone: str
    gpu: str
    count: int
    entry: str
    time_field: str


def _build(events: list[_Event], src: str, cluster: ClusterSpec) -> Trace:
    """Snapshots from `events` given in file order.

    Raises:
        SailorInputError: naming the entry: a time earlier than the one before, two counts for one
            (zone, GPU type) at one time, a (zone, GPU type) offered (count > 0) without a price.
    """
    for prev, e in zip(events, events[1:]):
        if e.time_s < prev.time_s:
            raise SailorInputError(f"time goes backwards: {e.time_s:g} s after {prev.time_s:g} s ({prev.time_field})",
                                   source=src, field=e.time_field, fix="list events in time order")
    seen: dict[tuple[float, str, str], _Event] = {}
    priced: set[tuple[str, str]] = set()
    for e in events:
        first = seen.setdefault((e.time_s, e.zone, e.gpu), e)
        if first.count != e.count:
            raise SailorInputError(f"a second count for {e.gpu} in {e.zone} at {e.time_s:g} s: {e.count} here,"
                                   f" {first.count} at {first.entry}", source=src, field=e.entry,
                                   fix="give one count per zone and GPU type at each time")
        if e.count > 0 and (e.zone, e.gpu) not in priced:
            try:
                cluster.price(e.zone, e.gpu)
                cluster.check_catalog_offers(e.zone, e.gpu)
            except SailorInputError as err:
                raise SailorInputError(f"offered at {e.time_s:g} s, but {err.message}",
                                       source=src, field=e.entry, fix=err.fix) from None
            priced.add((e.zone, e.gpu))
    snapshots: list[Snapshot] = []
    state: Zones = {}
    for k, e in enumerate(events):
        state.setdefault(e.zone, {})[e.gpu] = e.count
        last_at_t = k + 1 == len(events) or events[k + 1].time_s != e.time_s
        if last_at_t:
            zones = {zone: dict(gpus) for zone, gpus in state.items()}
            if not snapshots or snapshots[-1].zones != zones:
                snapshots.append(Snapshot(e.time_s, zones))
    times = sorted({e.time_s for e in events})
    return Trace(tuple(snapshots), src, times[-1], times[-1] - times[-2] if len(times) > 1 else None)


def _single_pair(cluster: ClusterSpec, src: str) -> tuple[str, str]:
    pairs = [(z, g) for z, gpus in cluster.zones.items() for g in gpus]
    if len(pairs) != 1:
        listed = ", ".join(f"{g} in {z}" for z, g in pairs) or "none"
        raise SailorInputError(f"a [{{Time, GPUs}}] trace names no zone or GPU type, and the cluster spec lists"
                               f" {len(pairs)} ({listed})", source=src,
                               fix="give a cluster spec with exactly one zone and GPU type")
    return pairs[0]


def _split_column(name: str, cluster: ClusterSpec, src: str) -> tuple[str, str]:
    """`<gpu>_<zone>` -> (zone, canonical gpu); tries every underscore, since either part may hold one."""
    parts = name.split("_")
    for k in range(1, len(parts)):
        gpu, zone = "_".join(parts[:k]), "_".join(parts[k:])
        try:
            return _zone(zone, cluster, src, name), _gpu(gpu, src, name)
        except SailorInputError:
            continue
    if len(parts) < 2:
        raise SailorInputError(f"column {name!r} is not <gpu>_<zone>", source=src, field="header")
    # Name the part that is wrong, splitting at the first underscore.
    _gpu(parts[0], src, f"header.{name}")
    _zone("_".join(parts[1:]), cluster, src, f"header.{name}")
    raise AssertionError("unreachable: one of the two parts must have failed")


def _zone(zone: Any, cluster: ClusterSpec, src: str, field: str) -> str:
    if not isinstance(zone, str):
        raise SailorInputError(f"expected a zone name, got {show(zone)}", source=src, field=field)
    try:
        cluster.prov.region(zone)
    except SailorInputError as e:
        raise e.located(source=src, field_prefix=field) from None
    return zone


def _gpu(gpu: Any, src: str, field: str) -> str:
    if not isinstance(gpu, str):
        raise SailorInputError(f"expected a GPU type, got {show(gpu)}", source=src, field=field)
    try:
        return catalog.canonical_gpu(gpu)
    except SailorInputError as e:
        raise e.located(source=src, field_prefix=field) from None


def _number(text: str, src: str, field: str) -> float:
    try:
        return float(text)  # "nan", "inf" and overflowing values are refused by _time and _count
    except ValueError:
        raise SailorInputError(f"expected a number, got {show(text)}", source=src, field=field) from None


def _time(value: Any, src: str, field: str, *, relative: bool = False) -> float:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= MAX_TRACE_TIME_S
          and math.isfinite(value))
    if not ok or (value < 0 and not relative):
        raise SailorInputError(f"expected a time >= 0 and <= {MAX_TRACE_TIME_S:g} in seconds, got {show(value)}",
                               source=src, field=field)
    return float(value)


def _count(value: Any, src: str, field: str) -> int:
    """A GPU count: a whole number in [0, MAX_GPUS_PER_ZONE] (a CSV's "8.0" counts, "8.5" does not)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_GPUS_PER_ZONE
            or value != int(value)):
        raise SailorInputError(f"GPU count must be a whole number >= 0 and <= {MAX_GPUS_PER_ZONE}, got {show(value)}",
                               source=src, field=field)
    return int(value)


@dataclass
class Availability:
    """The trace's availability now, minus GPUs lost to crashes, and with `--hosts` at most what the
    usable machines hold. A crash deduction for a (zone, GPU) (a GPU, a machine) lasts until the trace
    reports a different count for that pair (a fresh observation)."""

    trace: Trace
    pool: HostPool | None = None
    index: int = -1  # snapshot in force (-1: before the first)
    lost: Counter = field(default_factory=Counter)
    lost_machines: set[Machine] = field(default_factory=set)

    def advance(self, trace_time_s: float) -> bool:
        """Move to the snapshot in force at `trace_time_s`; True when it changed."""
        k = max((i for i, s in enumerate(self.trace.snapshots) if s.time_s <= trace_time_s), default=-1)
        if k == self.index:
            return False
        old = self.trace.snapshots[self.index].zones if self.index >= 0 else {}
        new = self.trace.snapshots[k].zones
        fresh = {(z, g) for z in {*old, *new} for g in {*old.get(z, {}), *new.get(z, {})}
                 if old.get(z, {}).get(g) != new.get(z, {}).get(g)}
        for pair in fresh & set(self.lost):
            del self.lost[pair]
        # in place: a live in-place run holds this very set (`InPlaceRun(lost=...)`) and reads it at
        # each switch, so a machine back in the trace must leave it there too
        self.lost_machines.difference_update([m for m in self.lost_machines if m[:2] in fresh])
        self.index = k
        return True

    def zones(self) -> Zones:
        """Effective availability: zone -> GPU type -> GPUs."""
        base = self.trace.snapshots[self.index].zones if self.index >= 0 else {}
        zones = {z: {g: max(n - self.lost[(z, g)], 0) for g, n in gpus.items()} for z, gpus in base.items()}
        if self.pool is not None:
            zones = {z: {g: min(n, self.pool.capacity(z, g, self.lost_machines)) for g, n in gpus.items()}
                     for z, gpus in zones.items()}
        return zones

    def next_change_s(self) -> float | None:
        """Trace time (s) of the next snapshot, or None when the trace has no more."""
        t = self.trace.snapshots[self.index].time_s if self.index >= 0 else -1.0
        return self.trace.next_change_after(t)
