"""Every reader is total (issue 13): on mutated inputs (types, signs, NaN/inf, huge values, missing
and extra keys, nesting, odd keys, encodings, truncation) it returns a valid object or raises one
SailorInputError line naming the file; nothing else escapes. The mutations and readers are in
`tests/mutate.py`; the number tried per reader is printed at the end of the session."""

import tempfile
import warnings
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mutate import READERS, HypothesisChooser, check_reader, dump, mutant, write_files

from sailor.core.errors import SailorWarning

EXAMPLES = 120  # per reader: the whole set stays well under a minute on the build machines


@pytest.mark.parametrize("reader", READERS, ids=[r.name for r in READERS])
def test_seeds_are_accepted(reader, tmp_path):
    # The rule could hold by refusing everything: every unmutated seed must load.
    for k, seed in enumerate(reader.seeds):
        folder = tmp_path / str(k)
        write_files(folder, {name: dump(doc, fmt) for name, (doc, fmt) in seed.items()})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SailorWarning)
            assert check_reader(reader, folder) == "accepted"


@pytest.mark.parametrize("reader", READERS, ids=[r.name for r in READERS])
def test_reader_is_total_on_mutated_inputs(reader):
    outcomes: Counter = Counter()
    with tempfile.TemporaryDirectory(prefix="sailor-mutants-") as tmp:

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(st.data())
        def run(data):
            folder = Path(tempfile.mkdtemp(dir=tmp))
            write_files(folder, mutant(reader, HypothesisChooser(data)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SailorWarning)
                outcomes[check_reader(reader, folder)] += 1

        run()
    assert outcomes["refused"] > 0, outcomes  # the mutations do reach the reader's checks
