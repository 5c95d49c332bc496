"""Passkey generator: deterministic under a seed, answer where it claims, never over length."""

from __future__ import annotations

import pytest

from ov_kvcrush.eval.tasks import FILLER, INTRO, passkey_prompt


def count_words(text: str) -> int:
    return len(text.split())


def test_seeded_determinism_and_different_seeds():
    a = passkey_prompt(500, count_words, seed=3)
    assert a == passkey_prompt(500, count_words, seed=3)
    keys = {passkey_prompt(500, count_words, seed=s).answer for s in range(8)}
    assert len(keys) > 1


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_answer_at_claimed_depth_and_length(depth):
    s = passkey_prompt(800, count_words, seed=1, depth=depth)
    assert count_words(s.prompt) <= 800 and count_words(s.prompt) > 800 - count_words(FILLER) - 1
    body = s.prompt[len(INTRO) :]
    before = body[: body.index("The pass key is")].count(FILLER)
    assert before == round(s.filler_units * depth)
    assert s.prompt.count(s.answer) == 2
    assert s.score(f"The pass key is {s.answer}.") == 1.0 and s.score("no idea") == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(500, count_words, depth=1.5)
    with pytest.raises(ValueError, match="target_tokens"):
        passkey_prompt(3, count_words)
