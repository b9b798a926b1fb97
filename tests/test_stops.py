"""Stop strings never leak, even split across deltas; text that cannot start one is not held."""

import pytest

from router.stops import StopChecker


def run(deltas, stops, include=False):
    s = StopChecker(stops, include)
    out = []
    for d in deltas:
        out.append(s.push(d))
        if s.stopped_by is not None:
            break
    else:
        out.append(s.flush())
    return "".join(out), out, s


def test_no_stops_passes_through():
    text, out, s = run(["a", "b"], [])
    assert text == "ab" and out == ["a", "b", ""] and s.stopped_by is None


def test_stop_in_one_delta():
    text, _, s = run(["hello STOP there"], ["STOP"])
    assert text == "hello " and s.stopped_by == "STOP" and s.text == "hello "


@pytest.mark.parametrize(
    "deltas",
    [["hel", "lo S", "TO", "P x"], ["hello ", "S", "T", "O", "P"], ["hello STO", "P"], ["h", "ello STOPx"]],
)
def test_stop_across_deltas_never_leaks(deltas):
    text, out, s = run(deltas, ["STOP"])
    assert text == "hello "
    assert all("S" not in o for o in out)
    assert s.stopped_by == "STOP"


def test_partial_match_is_released_when_it_turns_out_not_to_be_a_stop():
    text, out, s = run(["hello ST", "ART"], ["STOP"])
    assert out[0] == "hello "  # "ST" held back
    assert text == "hello START"
    assert s.stopped_by is None


def test_text_that_cannot_begin_a_stop_is_not_held():
    _, out, _ = run(["abc", "def"], ["xyz"])
    assert out[:2] == ["abc", "def"]


def test_overlapping_stops_earliest_wins():
    text, _, s = run(["one two three"], ["three", "two"])
    assert text == "one " and s.stopped_by == "two"


def test_overlapping_stop_prefixes():
    # "aab" contains the start of "ab"; the checker must find "ab" at index 1.
    text, _, s = run(["a", "a", "b"], ["ab"])
    assert text == "a" and s.stopped_by == "ab"


def test_same_start_shorter_stop_cuts_first():
    text, _, s = run(["xx END"], ["END", "ENDING"])
    assert text == "xx " and s.stopped_by == "END"


def test_include_stop_str_in_output():
    text, _, s = run(["hello ST", "OP and more"], ["STOP"], include=True)
    assert text == "hello STOP" and s.text == "hello STOP"


def test_nothing_after_stop():
    s = StopChecker(["X"])
    assert s.push("aXb") == "a"
    assert s.push("more") == ""
    assert s.flush() == ""


def test_flush_releases_held_text():
    s = StopChecker(["STOP"])
    assert s.push("end ST") == "end "
    assert s.flush() == "ST"
    assert s.text == "end ST"


def test_unicode_stop():
    text, _, s = run(["日本", "語です"], ["語"])
    assert text == "日本" and s.stopped_by == "語"


def test_stop_at_very_start():
    text, _, s = run(["STOP now"], ["STOP"])
    assert text == "" and s.stopped_by == "STOP"


def test_newline_stop_split():
    text, _, _ = run(["line one\n", "\nline two"], ["\n\n"])
    assert text == "line one"
