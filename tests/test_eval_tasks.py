"""Task generators: deterministic under a seed, answers where they claim, never over length."""

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


# --------------------------------------------------------------------------------------------
# RULER-style tasks on real prose and word lists

from ov_kvcrush import corpus  # noqa: E402
from ov_kvcrush.eval import tasks as T  # noqa: E402

GEN_TASKS = sorted(T.GENERATION_TASKS)


def _context(prompt: str, intro: str, question_start: str) -> str:
    assert prompt.startswith(intro)
    return prompt[len(intro) : prompt.rindex(question_start)]


@pytest.mark.parametrize("task", GEN_TASKS)
def test_generators_are_deterministic_and_seeded(task):
    make = T.GENERATION_TASKS[task]
    a = make(600, count_words, 7, 0, 2)
    assert a == make(600, count_words, 7, 0, 2)
    others = {make(600, count_words, seed, 0, 2).prompt for seed in range(4)}
    assert len(others) == 4  # every seed gives another prompt
    assert make(600, count_words, 7, 1, 2).prompt != a.prompt  # and every index


@pytest.mark.parametrize("task", GEN_TASKS)
@pytest.mark.parametrize("length", [300, 900])
def test_prompts_fit_their_length_closely(task, length):
    for index in range(3):
        s = T.GENERATION_TASKS[task](length, count_words, 0, index, 3)
        n = count_words(s.prompt)
        assert length - 40 < n <= length, (task, n)
        assert s.task == task and s.answers


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey"])
def test_needle_sits_at_its_claimed_depth(task):
    samples = 4
    for index in range(samples):
        s = T.GENERATION_TASKS[task](1200, count_words, 3, index, samples)
        assert s.depth == pytest.approx((index + 0.5) / samples)
        body = _context(s.prompt, T.NIAH_INTRO, "\nWhat is the special magic number")
        needle = T.NIAH_NEEDLE.format(key=s.meta["key"], value=s.answers[0])
        assert body.count(needle) == 1 and s.prompt.count(s.answers[0]) == 1
        # the needle is inserted between sentences, at the claimed fraction of the haystack's sentences
        before = body[: body.index(needle)]
        hay = body.replace(needle, "")
        for k, v in s.meta["distractors"].items():
            hay = hay.replace(T.NIAH_NEEDLE.format(key=k, value=v), "")
        assert len(before) / len(hay) == pytest.approx(s.depth, abs=0.06)
        assert s.score(f"The number is {s.answers[0]}.") == 1.0
        assert s.score("I do not know.") == 0.0


def test_multikey_has_three_distractors_that_do_not_score():
    s = T.niah_multikey_task(1500, count_words, 5, 0, 1)
    assert len(s.meta["distractors"]) == T.MULTIKEY_DISTRACTORS
    assert s.meta["key"] not in s.meta["distractors"]
    assert f"for {s.meta['key']} mentioned" in s.prompt  # the question asks the target key
    for k, v in s.meta["distractors"].items():
        assert T.NIAH_NEEDLE.format(key=k, value=v) in s.prompt
        assert v != s.answers[0] and s.score(f"The number is {v}.") == 0.0
    single = T.niah_single_task(1500, count_words, 5, 0, 1)
    assert not single.meta["distractors"]
    # the completion format's answer prefix names the asked key, never a distractor's
    assert s.answer_prefix.endswith(f"for {s.meta['key']} mentioned in the provided text is")
    assert all(k not in s.answer_prefix for k in s.meta["distractors"])


def test_haystack_is_real_essay_prose():
    s = T.niah_single_task(800, count_words, 1, 0, 1)
    body = _context(s.prompt, T.NIAH_INTRO, "\nWhat is the special")
    first = body.split(". ")[0]
    assert any(first in corpus.essay_text(p) for p in corpus.haystack_essays())


def test_variable_tracking_chain_and_partial_credit():
    s = T.vt_task(900, count_words, 2, 1, 3)
    value = s.meta["value"]
    names = s.answers
    assert s.match == "all" and len(names) == T.VT_HOPS + 1 and len(set(names)) == len(names)
    lines = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))]
    positions = [s.prompt.index(line) for line in lines]
    assert positions == sorted(positions)  # the chain reads in order
    assert s.prompt.count(value) == 3  # its first assignment and twice in the question
    for name in names:  # names are whole words of the chain, never inside the fixed text
        assert name.lower() not in (T.VT_INTRO + T.FILLER + T.VT_QUESTION).lower()
    assert s.score(" ".join(names)) == 1.0
    assert s.score(f"{names[0].lower()} and {names[2]}") == pytest.approx(2 / len(names))
    assert s.score("none") == 0.0


def _fake_tokenize(text: str) -> list[int]:
    return [hash(w) % 1000 + 10 for w in text.split()]


def test_perplexity_sample_is_a_contiguous_window_of_held_out_text():
    ps = T.ppl_task(500, _fake_tokenize, 0, 0, 64, bos=1)
    assert ps.context[0] == 1 and len(ps.context) == 500 - 64 and len(ps.continuation) == 64
    held = {p.stem for p in corpus.held_out_essays()}
    assert set(ps.meta["essays"]) == held
    assert held.isdisjoint(p.stem for p in corpus.haystack_essays())
    text = " ".join(
        corpus.essay_text(p) for p in sorted(corpus.held_out_essays(), key=lambda p: ps.meta["essays"].index(p.stem))
    )
    ids = _fake_tokenize(text)
    window = ps.context[1:] + ps.continuation
    assert ids[ps.meta["offset"] : ps.meta["offset"] + len(window)] == window
    assert ps == T.ppl_task(500, _fake_tokenize, 0, 0, 64, bos=1)
    assert ps.meta["offset"] != T.ppl_task(500, _fake_tokenize, 0, 1, 64, bos=1).meta["offset"]
    with pytest.raises(ValueError, match="ppl_tokens"):
        T.ppl_task(500, _fake_tokenize, 0, 0, 500)


def test_too_short_lengths_are_refused_with_the_field_name():
    for task in GEN_TASKS:
        with pytest.raises(ValueError, match="=10 is invalid"):
            T.GENERATION_TASKS[task](10, count_words, 0, 0, 1)
    with pytest.raises(ValueError, match="index"):
        T.sample_depth(3, 3)
