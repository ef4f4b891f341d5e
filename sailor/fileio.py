"""Reading spec files (YAML or JSON) and writing any file atomically.

Every reader turns a parse failure into a one-line `SailorInputError` naming the file; every writer
writes to a temporary name in the same folder, fsyncs and renames, so a crash never leaves a
half-written file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from sailor.errors import SailorInputError

T = TypeVar("T", bound=BaseModel)


def read_text(path: str | Path) -> str:
    """The file's text; raises SailorInputError if it is missing or unreadable."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SailorInputError("no such file", source=str(p)) from None
    except IsADirectoryError:
        raise SailorInputError("is a folder, expected a file", source=str(p)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SailorInputError(f"cannot read: {e}", source=str(p)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that rejects a key given twice in one mapping (PyYAML keeps the last one
    silently, which would drop, say, a zone's first GPU list)."""

    def construct_mapping(self, node, deep=False):  # noqa: D102 - PyYAML hook
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook that rejects a key given twice (json keeps the last one silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise SailorInputError(f"key {k!r} appears twice in one object")
        out[k] = v
    return out


def _parse_json(text: str, src: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise SailorInputError(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}", source=src) from None
    except SailorInputError as e:
        raise e.located(source=src) from None


def load_json(path: str | Path) -> Any:
    """Parse a JSON file of any shape; raises SailorInputError (missing file, syntax error with line
    and column, a key given twice in one object)."""
    return _parse_json(read_text(path), str(path))


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Parse a JSON or YAML file whose top level is a mapping.

    Raises:
        SailorInputError: missing or empty file, syntax error (with line), a key given twice, or a
            top level that is not a mapping.
    """
    text = read_text(path)
    src = str(path)
    if not text.strip():
        raise SailorInputError("the file is empty", source=src)
    if src.endswith(".json"):
        data = _parse_json(text, src)
    else:
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise SailorInputError(f"invalid YAML{where}: {getattr(e, 'problem', None) or e}", source=src) from None
    if not isinstance(data, dict):
        raise SailorInputError(f"expected a mapping at the top level, got {type(data).__name__}", source=src)
    return data


def validation_error(err: ValidationError, source: str | None) -> SailorInputError:
    """The first problem of a pydantic ValidationError as one SailorInputError line."""
    first = err.errors()[0]
    field = ".".join(str(p) for p in first.get("loc", ())) or None
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if first.get("type") != "value_error" and "input" in first and not isinstance(first["input"], (dict, list)):
        msg = f"{msg} (got {first['input']!r})"
    return SailorInputError(msg, source=source, field=field)


def parse_model(cls: type[T], data: Any, source: str | None) -> T:
    """Validate `data` into the pydantic model `cls`, turning errors into one-line SailorInputErrors."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, source) from None
    except SailorInputError as e:
        raise e.located(source=source) from None


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically (`open_atomic`).

    Raises:
        SailorInputError: `path` is a folder, or its folder cannot be created or written.
    """
    with open_atomic(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def open_atomic(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """A file (`mode` "w" for text in UTF-8, "wb" for bytes) that becomes `path` atomically: it is a
    temporary file in the same folder, fsynced and renamed onto `path` when the block ends, removed
    when it raises. The file gets the usual permissions (0666 less the umask), not mkstemp's 0600.

    Raises:
        SailorInputError: `path` is a folder, or its folder cannot be created or written.
    """
    p = Path(path)
    if p.is_dir():
        raise SailorInputError("is a folder, expected a file name", source=str(p))
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as e:
        raise SailorInputError(f"cannot write: {e.strerror}", source=str(p)) from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj: Any) -> None:
    """Write `obj` as indented JSON, atomically."""
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


def check_output_path(path: str | Path | None, option: str, *, folder: bool = False,
                      suffixes: tuple[str, ...] = ()) -> None:
    """Refuse an output path before any work starts: a file where a folder is wanted or the reverse,
    a parent that is not a folder, or (for files) a suffix outside `suffixes`.

    Raises:
        SailorInputError: naming the option and the path.
    """
    if path is None:
        return
    p = Path(path)
    if folder and p.exists() and not p.is_dir():
        raise SailorInputError(f"{p} exists and is not a folder", source=option)
    if not folder and p.is_dir():
        raise SailorInputError(f"{p} is a folder, expected a file name", source=option)
    parent = next((q for q in [p.parent, *p.parent.parents] if q.exists()), None)
    if parent is not None and not parent.is_dir():
        raise SailorInputError(f"{parent} is not a folder", source=option)
    if suffixes and p.suffix.lower() not in suffixes:
        raise SailorInputError(f"{p.name}: expected a file ending in {' or '.join(suffixes)}", source=option)
