"""Stop strings on the host (`mindrlhf.generation.stopping`): the window of a response's tail that is decoded finds
a string at the same token as decoding the whole response would, with byte-level tokens that split characters."""
import numpy as np
import pytest

from mindrlhf.generation.stopping import StopStrings

# byte-level pieces: "é" is b"\xc3\xa9", split over two tokens (3, 4) or whole (5); 6 decodes to nothing
PIECES = [b"a", b"b", b"ab", b"\xc3", b"\xa9", "é".encode(), b"", b"\n", b"ba", b" "]


def detokenize(ids) -> str:
    return b"".join(PIECES[int(i)] for i in ids).decode("utf-8", errors="replace")


def first_stop(strings, tokens, ends) -> int | None:
    """The first prefix length whose check says the response ended (`ends(prefix)`), or None."""
    return next((k for k in range(1, len(tokens) + 1) if ends(tokens[:k])), None)


@pytest.mark.parametrize("strings", [["abba"], ["é\n"], ["b é", "aaaa"], ["\n\n"], ["bé"]])
def test_the_window_finds_a_string_where_the_whole_text_does(strings):
    stop = StopStrings(strings, detokenize)
    rng = np.random.default_rng(len(strings[0]))
    found = 0
    for _ in range(300):
        tokens = rng.integers(0, len(PIECES), 40)
        expected = first_stop(strings, tokens, lambda p: any(s in detokenize(p) for s in strings))
        assert first_stop(strings, tokens, stop.ends) == expected, tokens.tolist()
        found += expected is not None
    assert 20 < found < 300  # the case has responses that stop and responses that do not


def test_each_sample_is_checked_at_its_own_newest_token():
    strings = ["ab"]
    stop = StopStrings(strings, detokenize)
    response = np.array([[0, 1, 7, 7], [0, 0, 0, 1], [2, 7, 7, 7]])
    # sample 0 at token 1 ("ab"), sample 1 at token 2 ("aaa": not yet), sample 2 at token 0 ("ab" in one token)
    assert [stop.ends(response[s, :t + 1]) for s, t in ((0, 1), (1, 2), (2, 0))] == [True, False, True]


def test_a_string_split_between_tokens_and_a_character_split_in_bytes():
    stop = StopStrings(["é"], detokenize)
    assert not stop.ends(np.array([0, 3]))  # the first byte only
    assert stop.ends(np.array([0, 3, 4]))  # its second byte completes "é"
    assert stop.ends(np.array([5]))


@pytest.mark.parametrize("strings", [[], [""], ["a", 3]])
def test_bad_stop_strings_are_refused(strings):
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(strings, detokenize)
