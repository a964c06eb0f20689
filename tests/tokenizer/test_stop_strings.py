"""Stop strings in streamed text: what may be shown is compared with a brute-force reference, and
a stream cut at any point never shows text that the final answer will not contain."""

from __future__ import annotations

import random

import pytest

from ssdlib.tokenizer.stop_strings import StopStrings


def _reference_undecided(text: str, stops: list[str]) -> int:
    """The longest end of ``text`` that some stop string starts with (and is not whole)."""
    return max((k for s in stops for k in range(1, len(s)) if len(text) >= k
                and text[len(text) - k:] == s[:k]), default=0)


def _reference_find(text: str, stops: list[str]) -> int | None:
    hits = [i for i in range(len(text)) for s in stops if s and text.startswith(s, i)]
    return min(hits) if hits else None


def test_undecided_and_find_match_a_brute_force_reference():
    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 12)))
        matcher = StopStrings(stops)
        assert matcher.undecided(text) == _reference_undecided(text, stops), (text, stops)
        assert matcher.safe_end(text) == len(text) - _reference_undecided(text, stops)
        assert matcher.find(text) == _reference_find(text, stops), (text, stops)


def test_incremental_find_sees_matches_across_appends():
    rng = random.Random(1)
    for _ in range(500):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(2)]
        matcher, text, searched, found = StopStrings(stops), "", 0, None
        while found is None and len(text) < 20:
            text += "".join(rng.choices("ab", k=rng.randint(1, 3)))
            found = matcher.find(text, searched)
            searched = len(text)
        assert found == _reference_find(text, stops), (text, stops)


@pytest.mark.parametrize("stops, text, shown", [
    (["ow ca"], "Hello! How", "Hello! H"),       # "ow" may start "ow ca": held back
    (["ow ca"], "Hello! How are", "Hello! How are"),
    (["\n\n", "User:"], "Sure.\n", "Sure."),
    (["abc"], "xxab", "xx"),
    ([], "Hello", "Hello"),
])
def test_the_safe_prefix(stops, text, shown):
    matcher = StopStrings(stops)
    assert text[:matcher.safe_end(text)] == shown
