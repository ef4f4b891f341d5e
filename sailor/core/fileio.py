"""Reading input files so that every reader is total, and writing any file atomically.

The rule for every reader (job, cluster, plans, traces, hosts, profiles, network files, validation
folders, and any reader added later): it returns a valid object or raises `SailorInputError` naming
the file, the field and the problem. Nothing else escapes. The helpers here make that the easy path:

Parsing (text -> plain data):
- `read_text(path)`: a regular file of at most `limits.MAX_FILE_BYTES`, decoded as UTF-8 (a BOM is
  allowed). Missing, a folder, a device or FIFO (which would block or never end), too large, or not
  UTF-8 are one-line errors.
- `load_json(path)` / `parse_json(text, source)`: JSON where a key given twice in one object, `NaN`
  / `Infinity`, a number that overflows a float, an integer of more than `MAX_INT_DIGITS` digits
  and nesting deeper than `MAX_DEPTH` are errors (Python's json accepts the first four silently and
  raises RecursionError on the last).
- `load_mapping(path)` / `parse_yaml(text, source)`: JSON or YAML with a mapping at the top (YAML
  text of any shape). YAML gets the same rules, plus: keys
  are plain strings (a complex key `? [a, b]`, or an unquoted `1:` / `yes:` that YAML reads as a
  number or a boolean, is an error saying to quote it), `.nan` / `.inf` are errors naming their
  field (as are the other values these rules refuse), and alias
  expansion is bounded (`check_tree`). YAML is read by libyaml's C parser where PyYAML has it (the
  same rules, `_Rules`), and a YAML file over `limits.MAX_YAML_BYTES` is refused before it is read.
- `check_tree(data, source)`: nesting depth <= `MAX_DEPTH` and at most `MAX_NODES` values, counting
  a YAML alias each time it is used (so "billion laughs" files and self-referencing aliases end in
  one line, not in minutes of validation).

Checking values (plain data -> typed values), for readers written by hand:
- `Checks(source)`: `mapping`, `known_keys` (no misspelt key ignored), `sequence`, `name`, `number`
  (finite, in range, never a bool), `whole` (an int, never a truncated float or a bool), `whole_key`
  (a JSON key like "16"); each raises a SailorInputError naming `source` and the dotted field.
  Our own formats refuse unknown keys; foreign ones (Sailor's) may carry fields we do not read.
- `show(value)`: a short, one-line repr for messages (huge numbers and long strings cut).

Checking values for pydantic models (specs, plans, hosts):
- `SPEC_CONFIG`: frozen, unknown fields forbidden, NaN and infinities refused.
- `Whole(lo, hi)` / `Real(lo, hi)`: strict annotated int / finite float fields (`true` is not 1,
  `4.7` is not 4, `"3"` is not 3).
- `parse_model(cls, data, source)`: validation errors as one-line SailorInputErrors (the first
  problem, with its field).

Writing: `open_atomic` (a context manager), `write_atomic` and `write_json` write a temporary file in
the same folder, fsync and rename, so a crash never leaves a half-written file; `check_output_path` refuses an output path before any
work starts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import yaml

from sailor.core.errors import SailorInputError, show
from sailor.core.limits import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_INT_DIGITS,
    MAX_NODES,
    MAX_YAML_BYTES,
)


# ---- reading -----------------------------------------------------------------------------------
def check_input_file(path: str | Path, *, folder: str = "is a folder, expected a file",
                     fix: str | None = None) -> os.stat_result:
    """The stat of `path`, an existing regular file an input is read from.

    Raises:
        SailorInputError: missing, unreadable, a folder (`folder` says what was expected), or not a
            regular file (device, FIFO, socket); each with `fix`.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise SailorInputError("no such file", source=str(p), fix=fix) from None
    except OSError as e:
        raise SailorInputError(f"cannot read: {e.strerror}", source=str(p), fix=fix) from None
    if stat.S_ISDIR(st.st_mode):
        raise SailorInputError(folder, source=str(p), fix=fix)
    if not stat.S_ISREG(st.st_mode):
        raise SailorInputError("is not a regular file (a device, FIFO or socket)", source=str(p), fix=fix)
    return st


def read_text(path: str | Path) -> str:
    """The text of a regular file of at most MAX_FILE_BYTES, as UTF-8 (BOM allowed).

    Raises:
        SailorInputError: missing, a folder, not a regular file (device, FIFO), unreadable, too
            large, or not UTF-8.
    """
    p = Path(path)
    check_input_file(p)
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise SailorInputError(f"cannot read: {e.strerror}", source=str(p)) from None
    if len(data) > MAX_FILE_BYTES:
        raise SailorInputError(f"larger than {MAX_FILE_BYTES >> 20} MiB, more than any input file needs", source=str(p))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SailorInputError(f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})", source=str(p),
                               fix="save it as UTF-8") from None


def check_tree(data: Any, source: str | None) -> None:
    """Raise SailorInputError if `data` nests deeper than MAX_DEPTH or holds more than MAX_NODES
    values (a YAML alias counts each time it is used; a self-referencing alias is too deep)."""
    stack = [(data, 0)]
    count = 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise SailorInputError(f"holds more than {MAX_NODES:,} values (YAML aliases counted each time used)",
                                   source=source)
        if isinstance(node, (dict, list, tuple, set, frozenset)):
            if depth >= MAX_DEPTH:
                raise SailorInputError(f"nested deeper than {MAX_DEPTH} levels", source=source)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((c, depth + 1) for c in children)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook that rejects a key given twice (json keeps the last one silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise SailorInputError(f"key {show(k)} appears twice in one object")
        out[k] = v
    return out


def _json_constant(name: str) -> float:
    raise SailorInputError(f"{name} is not a number JSON allows (NaN and infinities are refused)")


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise SailorInputError(f"number {show(text, 30)} is too large for a float")
    return value


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise SailorInputError(f"an integer of {len(text.lstrip('-'))} digits (more than {MAX_INT_DIGITS})")
    return int(text)


def parse_json(text: str, source: str | None) -> Any:
    """Parse JSON text by the rules of the module docstring; raises SailorInputError naming `source`."""
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_json_constant,
                          parse_float=_json_float, parse_int=_json_int)
    except json.JSONDecodeError as e:
        raise SailorInputError(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}", source=source) from None
    except SailorInputError as e:
        raise e.located(source=source) from None
    except RecursionError:
        raise SailorInputError(f"nested deeper than {MAX_DEPTH} levels", source=source) from None
    check_tree(data, source)
    return data


def load_json(path: str | Path) -> Any:
    """Parse a JSON file of any shape (rules in the module docstring); raises SailorInputError."""
    return parse_json(read_text(path), str(path))


class _Rules:
    """The rules of a safe YAML loader for spec files (keys are plain, unique strings; numbers are
    finite; no YAML 1.1 base-60 or octal numbers), on top of either of PyYAML's safe loaders: the
    pure-Python one, or libyaml's C parser (`yaml.CSafeLoader`, about 10x faster on a large file),
    which composes the same nodes and calls the same resolver and constructors."""

    def construct_mapping(self, node, deep=False):  # noqa: D102 - PyYAML hook
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` merges another mapping (whose keys are checked there)
                if not isinstance(key_node, yaml.ScalarNode):
                    raise yaml.constructor.ConstructorError(None, None, "a key must be a name, not a list or mapping",
                                                            key_node.start_mark)
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, str):
                    kind = {bool: "a boolean", type(None): "null", int: "a number", float: "a number"}.get(
                        type(key), "a date" if hasattr(key, "isoformat") else f"a {type(key).__name__}")
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {show(key_node.value)} is read as {kind}, not a name (quote it)",
                        key_node.start_mark)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {show(key)} appears twice",
                                                            key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def _yaml11_only(self, node, value) -> None:
        """Refuse the number forms only YAML 1.1 has, which read as something else than they look:
        base 60 (`1:30` is 90) and a leading zero (`010` is octal 8)."""
        raw = str(node.value).replace("_", "").lstrip("+-")
        kind = "base-60" if ":" in raw else "octal" if len(raw) > 1 and raw[0] == "0" and raw.isdigit() else None
        if kind:
            raise yaml.constructor.ConstructorError(None, None, f"{node.value} reads as {value:g} (a YAML 1.1 {kind}"
                                                    f" number); write the number you mean, or quote it", node.start_mark)

    def construct_yaml_float(self, node):  # noqa: D102 - PyYAML hook
        value = super().construct_yaml_float(node)
        self._yaml11_only(node, value)
        if not math.isfinite(value):
            raise yaml.constructor.ConstructorError(None, None, f"must be a finite number, got {node.value}",
                                                    node.start_mark)
        return value

    def construct_yaml_int(self, node):  # noqa: D102 - PyYAML hook
        digits = sum(c.isdigit() for c in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(None, None, f"an integer of {digits} digits (more than"
                                                    f" {MAX_INT_DIGITS})", node.start_mark)
        value = super().construct_yaml_int(node)
        self._yaml11_only(node, value)
        return value


class _PyLoader(_Rules, yaml.SafeLoader):
    """The rules on PyYAML's pure-Python parser."""


# libyaml's parser where PyYAML was built with it (the wheels on PyPI are), else the Python one.
_Loader: type = type("_Loader", (_Rules, yaml.CSafeLoader), {}) if getattr(yaml, "__with_libyaml__", False) \
    else _PyLoader

for _loader in {_PyLoader, _Loader}:
    _loader.add_constructor("tag:yaml.org,2002:float", _Rules.construct_yaml_float)
    # YAML 1.1, which PyYAML reads, makes `5.0e9` and `1e9` strings (its floats need a dot and a signed
    # exponent); YAML 1.2 and JSON read them as numbers, as the catalog and README write bandwidths.
    _loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                  re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
                                  list("-+0123456789."))
    _loader.add_constructor("tag:yaml.org,2002:int", _Rules.construct_yaml_int)


def parse_yaml(text: str, src: str, loader: type | None = None) -> Any:
    """The YAML document in `text` read by the rules of the module docstring, with `loader`
    (default: the C-backed one where present); raises SailorInputError naming `src`."""
    loader = loader or _Loader
    try:
        data = yaml.load(text, Loader=loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or e
        field = _value_field(text, loader, mark) if isinstance(e, yaml.constructor.ConstructorError) else None
        if field is not None:  # a value the rules refuse (`.nan`, `010`): its field says what it is
            raise SailorInputError(f"{problem} (line {mark.line + 1})", source=src, field=field) from None
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SailorInputError(f"invalid YAML{where}: {problem}", source=src) from None
    except RecursionError:
        raise SailorInputError(f"nested deeper than {MAX_DEPTH} levels", source=src) from None
    except (ValueError, OverflowError, TypeError) as e:  # e.g. a timestamp PyYAML cannot build
        raise SailorInputError(f"invalid YAML: {e}", source=src) from None
    check_tree(data, src)
    return data


def _value_field(text: str, loader: type, mark: Any) -> str | None:
    """The dotted field (`prices.A100-40`, `nodes.0.zone`) of the scalar value at `mark` in the YAML
    document `text`, found in its node tree (composing builds no value, so the refused one is not
    built again); None when `mark` is no such value (a key, the top level) or the text does not
    compose."""
    if mark is None:
        return None
    try:
        root = yaml.compose(text, Loader=loader)
    except yaml.YAMLError:
        return None
    stack: list[tuple[Any, tuple[str, ...]]] = [(root, ())]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if node is None or id(node) in seen:  # an alias is the node it names: walked once
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            if path and (node.start_mark.line, node.start_mark.column) == (mark.line, mark.column):
                return ".".join(path)
        elif isinstance(node, yaml.MappingNode):
            # reversed: popped in document order, so an aliased value is named where it is first written
            stack.extend((v, (*path, str(k.value))) for k, v in reversed(node.value) if isinstance(k, yaml.ScalarNode))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, (*path, str(i))) for i, v in reversed(list(enumerate(node.value))))
    return None


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Parse a JSON (`.json`) or YAML file whose top level is a mapping (rules in the module docstring).

    Raises:
        SailorInputError: missing, empty or comments-only file, a YAML file over MAX_YAML_BYTES,
            syntax error (with line), a key given twice, a key that is not a string, a non-finite
            number, too deep, or a top level that is not a mapping.
    """
    src = str(path)
    is_json = src.endswith(".json")
    if not is_json:
        size = check_input_file(path).st_size
        if size > MAX_YAML_BYTES:
            raise SailorInputError(f"a YAML file of {size / 2**20:.1f} MiB, more than the {MAX_YAML_BYTES >> 20} MiB"
                                   " any YAML input (job, cluster, hosts, testbed) needs", source=src,
                                   fix="check that it is the file you meant")
    text = read_text(path)
    if not text.strip():
        raise SailorInputError("the file is empty", source=src)
    data = parse_json(text, src) if is_json else parse_yaml(text, src)
    if data is None:
        raise SailorInputError("the file holds no data, only comments or blank lines", source=src)
    if not isinstance(data, dict):
        raise SailorInputError(f"expected a mapping (`key: value` lines) at the top level, got {kind_of(data)}",
                               source=src)
    return data


def kind_of(value: Any) -> str:
    """What `value` is, in words for a message: "a list", "a string", "a number", "null"..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    words = {str: "a string", list: "a list", dict: "a mapping", bytes: "bytes"}
    return words.get(type(value), "a date" if hasattr(value, "isoformat") else f"a {type(value).__name__}")


def mapping_from(source: str | Path | dict[str, Any], what: str) -> tuple[dict[str, Any], str | None]:
    """(mapping, file name or None) of a loader's `source`: a YAML/JSON path read with `load_mapping`,
    or a dict taken as it is. Raises SailorInputError for anything else (`what` names the object
    the loader also takes, e.g. "JobSpec")."""
    if isinstance(source, dict):
        return source, None
    if isinstance(source, (str, Path)):
        return load_mapping(source), str(source)
    raise SailorInputError(f"expected a path, a dict or a {what}, got {type(source).__name__}")


# ---- writing -----------------------------------------------------------------------------------
def write_atomic(path: str | Path, content: str | bytes) -> None:
    """Write `content` (text as UTF-8, or bytes) to `path` atomically (`open_atomic`).

    Raises:
        SailorInputError: `path` is a folder, a parent is a file, or the folder cannot be created or written.
    """
    with open_atomic(path, "wb") as f:
        f.write(content.encode("utf-8") if isinstance(content, str) else content)


@contextlib.contextmanager
def open_atomic(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """A file (`mode` "w" for text in UTF-8, "wb" for bytes) that becomes `path` atomically: it is a
    temporary file in the same folder, fsynced and renamed onto `path` when the block ends, removed
    when it raises. The file gets the usual permissions (0666 less the umask), not mkstemp's 0600.

    Raises:
        SailorInputError: `path` is a folder, a parent is a file, or the folder cannot be created or written.
    """
    p = _output_file(Path(path), str(path))
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except (FileExistsError, NotADirectoryError):
        raise SailorInputError("cannot write: a folder above it is a file", source=str(p)) from None
    except OSError as e:
        raise SailorInputError(f"cannot write: {e.strerror}", source=str(p)) from None
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    """This process's umask (read by setting it and putting it back: the only portable way), for
    giving a file or folder made by mkstemp/mkdtemp (0600/0700) the usual permissions."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _output_file(p: Path, source: str) -> Path:
    """The file an atomic write of `p` replaces: `p`, or the file a symbolic link `p` points to (the
    link stays). Raises SailorInputError for a folder, or a device, FIFO or socket, which a rename
    would replace (as root, `--out /dev/full` would swap the device for a file)."""
    if p.is_symlink():
        p = Path(os.path.realpath(p))
    if p.is_dir():
        raise SailorInputError("is a folder, expected a file name", source=source)
    if p.exists() and not p.is_file():
        raise SailorInputError("is not a regular file (a device, FIFO or socket); name a file to write", source=source)
    return p


def write_json(path: str | Path, obj: Any) -> None:
    """Write `obj` as indented JSON, atomically."""
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


def same_path(a: str | Path, b: str | Path) -> bool:
    """Whether paths `a` and `b` name the same file or folder: `os.path.samefile` when both exist (it
    sees hard links and symbolic links), else the resolved absolute paths are equal."""
    a, b = Path(a), Path(b)
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


InputPaths = dict[str, "str | Path | list[str | Path] | None"]


def check_not_an_input(path: str | Path, option: str, inputs: InputPaths) -> None:
    """Refuse an output `path` that is one of the command's inputs (`inputs`: option or argument
    name -> its path, or list of paths, or None for one not given): writing it would replace the input.

    Raises:
        SailorInputError: "<path> is the <name> input", with source `option`.
    """
    for name, given in inputs.items():
        for one in given if isinstance(given, list) else [given]:
            if one is not None and same_path(path, one):
                raise SailorInputError(f"{path} is the {name} input", source=option)


def check_distinct_outputs(outputs: dict[str, str | Path | None]) -> None:
    """Refuse two of a command's output options (option name -> path, None for one not given) that
    name the same file or folder (`same_path`): each would overwrite, or append into, the other's.

    Raises:
        SailorInputError: "<path> is also the <earlier option> output", with source the later option.
    """
    given = [(option, path) for option, path in outputs.items() if path is not None]
    for i, (option, path) in enumerate(given):
        for earlier, other in given[:i]:
            if same_path(path, other):
                raise SailorInputError(f"{path} is also the {earlier} output", source=option,
                                       fix="name a different file for each")


def check_output_path(path: str | Path | None, option: str, *, folder: bool = False,
                      suffixes: tuple[str, ...] = (), inputs: InputPaths | None = None) -> None:
    """Refuse an output path before any work starts: one of the command's `inputs` (option or
    argument name -> path; see `check_not_an_input`), a file where a folder is wanted or the reverse,
    a parent that is a file, a folder this user cannot write (tried: a file is created and removed in
    the nearest existing folder; missing folders below it are created when the output is written),
    or (for files) a suffix outside `suffixes`.

    Raises:
        SailorInputError: naming the option and the path.
    """
    if path is None:
        return
    p = Path(path)
    check_not_an_input(p, option, inputs or {})
    if folder and p.exists() and not p.is_dir():
        raise SailorInputError(f"{p} exists and is not a folder", source=option)
    if not folder and p.is_dir():
        raise SailorInputError(f"{p} is a folder, expected a file name", source=option)
    if not folder and p.exists() and not p.is_file():
        raise SailorInputError(f"{p} is not a regular file (a device, FIFO or socket); name a file to write", source=option)
    if suffixes and p.suffix.lower() not in suffixes:
        raise SailorInputError(f"{p.name}: expected a file ending in {' or '.join(suffixes)}", source=option)
    start = p if folder else p.parent
    existing = next((q for q in [start, *start.parents] if q.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise SailorInputError(f"{existing} is a file, so {p} cannot be created under it", source=option)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SailorInputError(f"cannot write in {existing} (permission denied)", source=option)
    try:  # the permission bits do not tell everything (root, /proc, read-only or immutable folders)
        fd, probe = tempfile.mkstemp(prefix=".sailor-write-test.", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SailorInputError(f"cannot write in {existing} ({e.strerror})", source=option) from None
