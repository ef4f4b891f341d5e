"""Checking values of input files: `Checks` for readers written by hand, and the pydantic helpers
every spec uses (`SPEC_CONFIG`, `Whole`, `Real`, `parse_model`); each raises a `SailorInputError`
naming the file and the dotted field (see `sailor.core.fileio` for the reading rules)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sailor.core.errors import SailorInputError, did_you_mean, show
from sailor.core.limits import MAX_INT_DIGITS

T = TypeVar("T", bound=BaseModel)



# ---- checking plain data -------------------------------------------------------------------------
@dataclass(frozen=True)
class Checks:
    """Type and range checks for the values of one file, each naming `source` and the field.

    Fields are dotted paths ("layers.3.forward_s"). Numbers are never bools (JSON `true` is not 1).
    """

    source: str | None

    def error(self, message: str, field: str | None, fix: str | None = None) -> SailorInputError:
        return SailorInputError(message, source=self.source, field=field or None, fix=fix)

    def mapping(self, value: Any, field: str, what: str = "") -> dict[str, Any]:
        """`value` if it is a mapping with string keys; `what` describes the expected content."""
        if not isinstance(value, dict):
            raise self.error(f"expected a mapping{' of ' + what if what else ''}, got {_kind(value)}", field)
        for k in value:
            if not isinstance(k, str):
                raise self.error(f"key {show(k)} is not a name", field)
        return value

    def known_keys(self, value: dict[str, Any], field: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        """`value` if it has no key outside `allowed` (a misspelt optional key would otherwise be
        ignored without a word)."""
        for k in value:
            if k not in allowed:
                fix = did_you_mean(str(k), allowed) or f"known: {', '.join(allowed)}"
                raise self.error(f"unknown field {show(k)}", f"{field}.{k}" if field else str(k), fix=fix)
        return value

    def sequence(self, value: Any, field: str, what: str = "", *, min_len: int = 0,
                 max_len: int | None = None) -> list[Any]:
        """`value` if it is a list (or tuple) of `min_len`..`max_len` items."""
        if not isinstance(value, (list, tuple)):
            raise self.error(f"expected a list{' of ' + what if what else ''}, got {_kind(value)}", field)
        if len(value) < min_len or (max_len is not None and len(value) > max_len):
            want = f"{min_len}" if max_len == min_len else f"{min_len} to {max_len}" if max_len else f"at least {min_len}"
            raise self.error(f"expected {want} item(s){' (' + what + ')' if what else ''}, got {len(value)}", field)
        return list(value)

    def name(self, value: Any, field: str, what: str = "a name") -> str:
        """`value` if it is a non-empty string."""
        if not isinstance(value, str) or not value:
            raise self.error(f"expected {what}, got {show(value)}", field)
        return value

    def number(self, value: Any, field: str, *, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False, unit: str = "") -> float:
        """`value` as a float if it is a finite real number in [lo, hi] ((lo, hi] with `lo_open`)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(f"expected a number{unit and ' of ' + unit}, got {show(value)}", field)
        if isinstance(value, int) and abs(value) > 1e300:
            raise self.error(f"expected a number{unit and ' of ' + unit} below 1e300, got {show(value)}", field)
        x = float(value)
        if not math.isfinite(x):
            raise self.error(f"expected a finite number, got {show(value)}", field)
        if lo is not None and (x <= lo if lo_open else x < lo):
            raise self.error(f"must be {'>' if lo_open else '>='} {lo:g}, got {show(value)}", field)
        if hi is not None and x > hi:
            raise self.error(f"must be <= {hi:g}, got {show(value)}", field)
        return x

    def whole(self, value: Any, field: str, *, lo: int = 0, hi: int | None = None) -> int:
        """`value` if it is an int in [lo, hi] (a float such as 4.7 or 4.0, or a bool, is refused:
        nothing is truncated)."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"expected a whole number, got {show(value)}", field)
        if value < lo or (hi is not None and value > hi):
            rng = f">= {lo}" if hi is None else f"from {lo} to {hi}"
            raise self.error(f"must be a whole number {rng}, got {show(value)}", field)
        return value

    def whole_key(self, key: Any, field: str, *, lo: int = 0, hi: int | None = None) -> int:
        """A mapping key that holds a whole number ("16" in a JSON object), as an int."""
        text = key if isinstance(key, str) else ""
        if not (text.isascii() and text.isdigit()) or len(text) > MAX_INT_DIGITS:
            raise self.error(f"key {show(key)} is not a whole number", field)
        return self.whole(int(text), field, lo=lo, hi=hi)



def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", tuple: "a list", str: f"the string {show(value)}",
            type(None): "null", bool: show(value)}.get(type(value), f"{type(value).__name__} {show(value)}")



# ---- checking for pydantic models ------------------------------------------------------------------
SPEC_CONFIG = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
"""The model config of every spec: frozen, unknown fields forbidden, NaN and infinities refused."""



def Whole(lo: int | None = None, hi: int | None = None):  # noqa: N802 - a type factory
    """A strict int field type in [lo, hi]: `true`, `4.0`, `4.7` and `"4"` are refused."""
    if lo == 1:  # "greater than 0" reads better than "greater than or equal to 1"
        return Annotated[int, Field(strict=True, gt=0, le=hi)]
    return Annotated[int, Field(strict=True, ge=lo, le=hi)]



def Real(lo: float | None = None, hi: float | None = None):  # noqa: N802 - a type factory
    """A strict, finite float field type in [lo, hi]: ints are taken, bools and strings are not."""
    return Annotated[float, Field(strict=True, ge=lo, le=hi, allow_inf_nan=False)]



# Parts of a pydantic error location that name a validator of a union member, not a field.
_PYDANTIC_TAG = re.compile(r"^(constrained-)?(float|int|str|bool|none|dict|list|tuple|set)(\[.*\])?$"
                           r"|^(function|lax-or-strict|json-or-python|literal|nullable|union|chain|tagged-union)[-\[]")



def _field(error: dict) -> str | None:
    """The dotted field a pydantic error is at, without the names of union members' validators."""
    return ".".join(str(p) for p in error.get("loc", ()) if not _PYDANTIC_TAG.match(str(p))) or None



def validation_error(err: ValidationError, source: str | None) -> SailorInputError:
    """The first problem of a pydantic ValidationError as one SailorInputError line (a SailorInputError
    raised inside a validator keeps its own message and field, under the field pydantic was at).

    A union field reports one error per member; of those at the first error's field, the one that
    got deepest names the problem (`prices: {zone: {gpu: -1}}`: the mapping member's
    `prices.zone.gpu`, not the number member's "should be a valid number")."""
    errors = err.errors()
    field = _field(errors[0])
    if field:
        members = [e for e in errors if _field(e) == field or (_field(e) or "").startswith(field + ".")]
        first = max(members, key=lambda e: _field(e).count("."))  # the earliest of the deepest
        field = _field(first)
    else:
        first = errors[0]
    inner = (first.get("ctx") or {}).get("error")
    if isinstance(inner, SailorInputError):
        return inner.located(source=source, field_prefix=field)
    msg = first.get("msg", "invalid value")
    ctx = first.get("ctx") or {}
    if first.get("type") in ("too_short", "too_long"):  # pydantic's "Tuple should have at least 1 item after validation"
        most = first["type"] == "too_long"
        n = ctx["max_length" if most else "min_length"]
        got = ctx.get("actual_length")
        msg = (f"must list at {'most' if most else 'least'} {n} {'entry' if n == 1 else 'entries'}, got"
               f" {got if got else 'none'}" if got is not None else msg)
        return SailorInputError(msg, source=source, field=field)
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if first.get("type") != "value_error" and "input" in first and not isinstance(first["input"], (dict, list)):
        msg = f"{msg} (got {show(first['input'])})"
    return SailorInputError(msg, source=source, field=field)



def parse_model(cls: type[T], data: Any, source: str | None) -> T:
    """Validate `data` into the pydantic model `cls`, turning errors into one-line SailorInputErrors."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, source) from None
    except SailorInputError as e:
        raise e.located(source=source) from None
