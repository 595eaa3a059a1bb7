"""Stop strings: one pattern for all of them gives what matching them one by one gives."""

from __future__ import annotations

import random

from cenote.sampling.stop_strings import StopMatch, StopStrings, stop_strings


def find(text: str, delta: int, stop: list[str], include: bool = False) -> StopMatch | None:
    return StopStrings(tuple(stop)).find(text, delta, include)


def reference_find(text: str, delta: int, stop: list[str], include: bool) -> StopMatch | None:
    """The contract, string by string: the earliest stop string ending in the new text."""
    best, best_index = None, len(text) + 1
    for s in (s for s in stop if s):
        index = text.find(s, max(len(text) - delta - len(s) + 1, 0))
        if delta > 0 and index != -1 and index < best_index:
            best_index = index
            best = StopMatch(s, index + len(s) if include else index)
    return best


def reference_holdback(text: str, stop: list[str]) -> int:
    return max(
        (n for s in stop for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
        default=0,
    )


def test_stop_string_in_new_delta() -> None:
    match = find("Hello world###tail", 9, ["###"])
    assert match is not None
    assert match.stop_str == "###" and match.truncate_to == len("Hello world")
    assert find("Hello world###tail", 9, ["###"], True) == ("###", len("Hello world###"))


def test_stop_string_spanning_old_and_new_text() -> None:
    # "##" was already there; the new delta "#x" completes "###".
    match = find("ab##" + "#x", 2, ["###"])
    assert match is not None and match.truncate_to == 2


def test_stop_string_only_in_old_text_is_ignored() -> None:
    assert find("###abc" + "de", 2, ["###"]) is None
    assert find("abc", 0, ["abc"]) is None
    assert find("abc", 3, []) is None
    # a short string wholly in the old text does not hide a longer one ending in the new text
    assert find("xab" + "cd", 2, ["ab", "abcd"]) == ("abcd", 1)


def test_earliest_stop_string_wins_then_the_first_listed() -> None:
    match = find("say STOP now END", 16, ["END", "STOP"])
    assert match is not None and match.stop_str == "STOP" and match.truncate_to == 4
    assert find("xabcd", 5, ["abc", "ab"]) == ("abc", 1)
    assert find("xabcd", 5, ["ab", "abc"]) == ("ab", 1)


def test_regex_characters_are_literal() -> None:
    assert find("a.b(c)*", 7, [".b(", "c)*"]) == (".b(", 1)
    assert find("axb", 3, [".", "a.b"]) is None


def test_holdback() -> None:
    holdback = StopStrings(("###", "#!")).holdback
    assert holdback("Hello #") == 1
    assert holdback("Hello ##") == 2
    assert StopStrings(("###",)).holdback("Hello") == 0
    assert StopStrings(("###",)).holdback("") == 0
    assert StopStrings(()).holdback("abc") == 0


def test_random_texts_match_the_string_by_string_contract() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("abc.") for _ in range(rng.randint(0, 14)))
        stop = ["".join(rng.choice("abc.") for _ in range(rng.randint(0, 4))) for _ in range(4)]
        delta = rng.randint(0, len(text))
        include = rng.random() < 0.5
        matcher = StopStrings(tuple(stop))
        assert matcher.find(text, delta, include) == reference_find(text, delta, stop, include)
        assert matcher.holdback(text) == reference_holdback(text, stop), (text, stop)


def test_matchers_are_shared() -> None:
    assert stop_strings(("a", "b")) is stop_strings(("a", "b"))
