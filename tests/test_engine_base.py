"""What every engine shares: the streaming helper, TTFT/TPOT arithmetic and the context check."""

from __future__ import annotations

import pytest

from ov_kvcrush.engines.base import TextStream, check_context, ttft_tpot_ms
from ov_kvcrush.errors import UserError


def test_text_stream_sends_only_new_complete_text():
    # byte-level tokens: "ö" is split over tokens 3 and 4, as BPE tokenizers do
    pieces = {1: b"Hel", 2: b"lo w", 3: b"\xc3", 4: b"\xb6rld"}

    def decode(tokens):  # a decoder holds back an incomplete trailing character
        return b"".join(pieces[t] for t in tokens).decode("utf-8", errors="ignore")

    sent: list[str] = []
    stream = TextStream(lambda s: sent.append(s), decode)
    for n in range(1, 5):
        assert stream.push([1, 2, 3, 4][:n]) is False
    assert sent == ["Hel", "lo w", "örld"]  # nothing sent for token 3 alone, no half character
    assert "".join(sent) == "Hello wörld"


def test_text_stream_stop_and_no_streamer():
    calls = []
    stream = TextStream(lambda s: calls.append(s) or len(calls) == 2, lambda t: "x" * len(t))
    assert [stream.push([0] * n) for n in (1, 2)] == [False, True]
    assert TextStream(None, lambda t: pytest.fail("no streamer: nothing decoded")).push([1]) is False


def test_ttft_tpot():
    assert ttft_tpot_ms([]) == (0.0, 0.0)
    assert ttft_tpot_ms([0.5]) == (500.0, 0.0)
    ttft, tpot = ttft_tpot_ms([0.5, 0.6, 0.8])
    assert ttft == 500.0 and tpot == pytest.approx(150.0)


def test_check_context():
    check_context(100, 28, 128)
    check_context(10**6, 1, None)  # unknown limit: no check
    with pytest.raises(
        UserError, match=r"prompt \(100 tokens\) \+ max_new_tokens \(29\) exceeds the model's context of 128"
    ):
        check_context(100, 29, 128)
