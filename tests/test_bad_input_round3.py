"""Bad input, round 3 (issue 31): each case the issue lists ends in exit status 2 and one line naming
the file and field, or (for legitimate input) succeeds. Commands run in-process through
`sailor.cli.main` (helpers from tests/test_cli_bad_input.py)."""

import tomllib
from pathlib import Path

from test_cli_bad_input import _base, _main, _refused  # noqa: F401 - shared command helpers

ROOT = Path(__file__).resolve().parents[1]


# ---- profiles record Sailor's version ------------------------------------------------------------
def test_profiles_and_the_cache_key_record_sailors_version():
    from sailor.core import __version__
    from sailor.runtime.machine import cache_key
    from sailor.runtime.profiler import versions
    from sailor.specs.job import JobSpec

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "sailor-train" and "version" in project["dynamic"]
    assert versions()["sailor"] == __version__ != "unknown"
    assert cache_key(JobSpec(model="tiny", global_batch_size=8))["sailor"] == __version__
