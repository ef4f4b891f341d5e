"""The one exception type for bad user input, and the one warning type for input taken with a change.

Two kinds of failure (STYLE.md §2.14): a user's mistake raises `SailorInputError` (a `ValueError`),
which the CLI prints as one line and exit status 2; a broken invariant is an `assert`. Input that is
accepted but not taken literally (e.g. a Sailor plan whose batch does not split evenly over its
pipelines) is said with `note(...)`: a `SailorWarning` the CLI prints as one `warning:` line on stderr.
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Iterable
from typing import Any


class SailorInputError(ValueError):
    """Bad user input: a file, a field in it, and what is wrong.

    Args:
        message: what is wrong, with numbers where they help.
        source: the file (or command-line option) the input came from, if any.
        field: dotted path of the offending field inside that file, if any.
        fix: a short hint on how to fix it, if there is one.
    """

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None,
                 fix: str | None = None, via: str | None = None) -> None:
        self.message = message
        self.source = source
        self.field = field
        self.fix = fix
        self.via = via
        super().__init__(self.one_line())

    def one_line(self) -> str:
        """The error as one line: `source: field: message (fix) [named by: via]`; characters that
        would break the line (newlines, other control or separator characters) are shown escaped."""
        parts = [p for p in (self.source, self.field) if p]
        text = ": ".join(parts + [self.message])
        text = f"{text} ({self.fix})" if self.fix else text
        return one_line(f"{text} [named by {self.via}]" if self.via else text)

    def located(self, *, source: str | None = None, field_prefix: str | None = None) -> "SailorInputError":
        """A copy that also names the file and/or a parent field (keeps what is already known). An
        error that already names another file (say a config.json a job's `model:` points to) keeps
        its file and field, and records which field of which file named it (`via`: "job.yaml field
        model")."""
        if self.source and source and field_prefix and source != self.source:
            where = f"{source} field {field_prefix}"
            return SailorInputError(self.message, source=self.source, field=self.field, fix=self.fix,
                                    via=f"{where}, {self.via}" if self.via else where)
        field = self.field
        if field_prefix:
            field = f"{field_prefix}.{field}" if field else field_prefix
        return SailorInputError(self.message, source=self.source or source, field=field, fix=self.fix, via=self.via)


def one_line(text: str) -> str:
    """`text` with every non-printable character (newline, tab, U+2028, ...) escaped, so that it is
    exactly one line however a terminal or `str.splitlines` reads it."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class SailorWarning(UserWarning):
    """Input taken, but not literally (the CLI prints it as one `warning:` line on stderr)."""


def note(message: str, *, source: str | None = None, field: str | None = None) -> None:
    """Tell the user how their input was taken (a `SailorWarning` naming the file and field)."""
    warnings.warn(SailorWarning(SailorInputError(message, source=source, field=field).one_line()), stacklevel=2)


class InfeasibleError(SailorInputError):
    """No plan satisfies the job, cluster and constraints; the message names the binding reason."""


def did_you_mean(name: str, choices: Iterable[str]) -> str | None:
    """A 'did you mean X?' hint for a misspelt name (letter case aside: 'US-WEST1-B' finds
    'us-west1-b'), or None when nothing is close."""
    by_lower: dict[str, str] = {}
    for c in choices:
        by_lower.setdefault(c.lower(), c)
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"did you mean {by_lower[close[0]]!r}?" if close else None


def unknown_name(kind: str, name: str, choices: Iterable[str], *, known: str | None = None,
                 **where: str | None) -> SailorInputError:
    """An error for an unknown GPU type, zone, model... naming the closest known one, else listing
    them all, or saying `known` instead where they are too many for one line (140 zones)."""
    choices = sorted(choices)
    known = known or f"known: {', '.join(choices)}"
    if not isinstance(name, str):
        return SailorInputError(f"expected a {kind} name, got {type(name).__name__} {str(name)[:40]!r}",
                                fix=known, **where)
    return SailorInputError(f"unknown {kind} {name[:80]!r}", fix=did_you_mean(name, choices) or known, **where)


# ---- messages ----------------------------------------------------------------------------------
def show(value: Any, limit: int = 60) -> str:
    """A value read from an input file as its author wrote it, cut to about `limit` characters, for
    one-line messages: `repr(value)`, except that null, true and false are spelt as in JSON and
    YAML, also inside lists and mappings (Python's None and True are no file's words). An int too
    large to print, or a megabyte-long string, would otherwise fill the screen or raise."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"a number of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    try:
        text = _spelt(value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."


def _spelt(value: Any) -> str:
    """`repr(value)` with None, True and False spelt null, true and false (in lists and mappings too)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_spelt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_spelt(k)}: {_spelt(v)}" for k, v in value.items()) + "}"
    return repr(value)


def counted(n: int, one: str, many: str | None = None) -> str:
    """`n` and the noun in the number it takes: counted(1, "rank") is "1 rank", counted(2, "rank")
    "2 ranks", counted(3, "switch", "switches") "3 switches" (`many`: the plural, default `one` + "s")."""
    return f"{n} {one if n == 1 else (many or one + 's')}"
