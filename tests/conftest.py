"""Shared fixtures: where the public Sailor reference data lives (../shared next to the repo root)."""

from pathlib import Path

import pytest

SAILOR_REF = Path(__file__).resolve().parents[2] / "shared" / "reference" / "sailor"


@pytest.fixture
def sailor_ref() -> Path:
    """The Sailor reference folder; skips the test with the reason when ../shared is absent."""
    if not SAILOR_REF.is_dir():
        pytest.skip(f"public Sailor reference data not found at {SAILOR_REF} (../shared is absent)")
    return SAILOR_REF
