"""bench/traffic.py's templates: at least 30, at least a third of them kept out of the reader's own tests
(tests/test_views.py), so the session measures the reader on phrasings it was not written against."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests")]

from test_views import LISTS, SUMS  # noqa: E402 (after the path it needs)
from traffic import FAMILIES  # noqa: E402

from rsi.mol.views import _core  # noqa: E402

PROBES = {"addition": ({"a": 12, "b": 34}, SUMS), "sorting": ({"items": [3, 1, 4, 1, 5, 9, 2]}, LISTS)}


def test_a_third_of_the_sessions_templates_are_phrasings_the_reader_was_not_tested_on() -> None:
    templates = [(family, t) for family, ts in FAMILIES.items() for t in ts]
    assert len(templates) >= 30
    assert 3 * sum(t.held_out for _, t in templates) >= len(templates)
    for family, t in templates:
        payload, tested = PROBES[family]
        asked = t.ask(payload)
        if t.held_out:  # not the same words, not even up to case, spacing and courtesies
            assert _core(asked) not in {_core(x) for x in tested}, (family, t.text)
        else:
            assert asked in tested, (family, t.text)
