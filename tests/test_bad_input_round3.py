"""Bad input, round 3 (issue 31): each case the issue lists ends in exit status 2 and one line naming
the file and field, or (for legitimate input) succeeds. Commands run in-process through
`sailor.cli.main` (helpers from tests/test_cli_bad_input.py)."""

import json
import tomllib
import warnings
from pathlib import Path

import pytest
from test_cli_bad_input import _base, _main, _refused  # noqa: F401 - shared command helpers

from sailor.core.errors import SailorInputError

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


# ---- profiles: all-zero times, per-layer counts, an unknown schema ------------------------------
def _profile(tmp_path: Path, name: str, edit) -> str:
    import mutate
    doc = json.loads(json.dumps(mutate.PROFILE))
    edit(doc)
    (tmp_path / name).write_text(json.dumps(doc))
    return name


def _all_zero(doc) -> None:
    for row in doc["layers"]:
        row["forward_s"], row["backward_s"] = [0] * 6, [0] * 6


@pytest.mark.parametrize("edit, words", [
    (_all_zero, "p.json: layers.0: every forward and backward time is 0 s"),
    (lambda d: d["layers"][0].update(forward_s=[1e-3] * 25),
     "p.json: layers.0.forward_s: expected 6 values (one per layer; tiny has 6), got 25"),
    (lambda d: d.update(model="mine") or d["layers"][0].update(forward_s=[1e-3] * 25),
     "p.json: layers.0: forward_s has 25 values and backward_s 6; both give one per layer"),
    (lambda d: d.update(schema="sailor.profiles/9"),
     "p.json: schema: unknown schema 'sailor.profiles/9' (this Sailor reads 'sailor.profiles/1')"),
])
def test_plan_refuses_a_profile_naming_the_field(tmp_path, monkeypatch, capsys, edit, words):
    _base(tmp_path)
    _profile(tmp_path, "p.json", edit)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no numpy warning on the way
        line = _refused(["plan", "--job", "job.yaml", "--cluster", "gcp.yaml", "--profiles", "p.json"],
                        tmp_path, monkeypatch, capsys)
    assert words in line, line


def test_a_sailor_profile_whose_times_are_all_zero_is_refused(tmp_path):
    import mutate

    from sailor.perf.profiles import load_profiles
    from sailor.specs.job import JobSpec
    doc = json.loads(json.dumps(mutate.SAILOR_PROFILES))
    doc["tiny"]["A100-40"]["4"]["1"] = {str(i): [0, 0, 1e-4] for i in range(6)}
    (tmp_path / "profiles_tmp.json").write_text(json.dumps(doc))
    with pytest.raises(SailorInputError, match=r"profiles_tmp.json: tiny.A100-40.4.1: every forward and backward"):
        load_profiles(tmp_path, JobSpec(model="tiny", global_batch_size=8))
