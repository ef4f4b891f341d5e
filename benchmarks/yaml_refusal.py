"""How long a large YAML job takes to be refused (issue 31; target: a 4 MiB job in under 5 s), and
what libyaml's C parser buys on the largest YAML input that is still read (1 MiB, the cap).

Three timings, each the median of `--repeats` runs in this process:
- `refuse 4 MiB`: `sailor plan --job big.yaml` through `sailor.cli.main` (in-process; the command's
  own imports are warm), on a 4 MiB job of small values (the slowest kind of YAML to read);
- `read 1 MiB (C)` / `read 1 MiB (Python)`: `sailor.core.fileio.parse_yaml` of a 1 MiB file of the
  same kind with the C-backed loader and with the pure-Python one (the same rules).
Prints one line per figure, then one JSON line.

    python benchmarks/yaml_refusal.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 5.0


def _job_text(size: int) -> str:
    """A job of `size` bytes: a valid job plus a list of small mappings under an unknown key."""
    head = "model: tiny\nglobal_batch_size: 8\nnotes:\n"
    rows, n, i = [], len(head), 0
    while n < size - 80:
        row = f"  - {{name: item{i}, value: {i}}}\n"
        rows.append(row)
        n += len(row)
        i += 1
    text = head + "".join(rows)
    return text + "#" + "x" * (size - len(text) - 2) + "\n"


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _refuse(folder: Path) -> None:
    from sailor.cli import main
    argv = sys.argv
    sys.argv = ["sailor", "plan", "--job", str(folder / "big.yaml"), "--cluster", str(folder / "local.yaml")]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
            main()
    finally:
        sys.argv = argv
    assert "a YAML file of 4.0 MiB" in err.getvalue(), err.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from sailor.core import fileio
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "big.yaml").write_text(_job_text(4 * 2**20))
        (folder / "local.yaml").write_text("provider: local\nzones: {local: {cpu: 4}}\n")
        small = _job_text(2**20 - 1)
        fig = {"refuse_4mib_s": _median(lambda: _refuse(folder), args.repeats),
               "read_1mib_c_s": _median(lambda: fileio.parse_yaml(small, "x.yaml", fileio._Loader), args.repeats),
               "read_1mib_python_s": _median(lambda: fileio.parse_yaml(small, "x.yaml", fileio._PyLoader),
                                             args.repeats)}
    print(f"refuse a 4 MiB job:    {fig['refuse_4mib_s']:.3f} s (target < {TARGET_S:g} s)")
    print(f"read 1 MiB, C parser:  {fig['read_1mib_c_s']:.3f} s ({fileio._Loader.__mro__[2].__name__})")
    print(f"read 1 MiB, Python:    {fig['read_1mib_python_s']:.3f} s")
    print(json.dumps(fig | {"target_s": TARGET_S, "met": fig["refuse_4mib_s"] < TARGET_S}))


if __name__ == "__main__":
    main()
