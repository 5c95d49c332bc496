"""Scorer and agreement on hand-made outputs, and the JSONL reader's errors."""

from __future__ import annotations

import json

import pytest

from ov_kvcrush.eval.data import DataError, read_jsonl
from ov_kvcrush.eval.scoring import agreement, score_output


@pytest.mark.parametrize(
    ("output", "answers", "match", "expected"),
    [
        ("The pass key is 12345.", ["12345"], "any", 1.0),
        ("the PASS key is 1234", ["12345"], "any", 0.0),  # a prefix of the answer is not the answer
        ("It is PARIS, of course", ["paris", "Lyon"], "any", 1.0),  # case-insensitive, any of several
        ("", ["x"], "any", 0.0),
        ("ALPHA and gamma", ["alpha", "beta", "gamma", "delta"], "all", 0.5),
        ("alpha beta gamma delta", ["alpha", "beta", "gamma", "delta"], "all", 1.0),
        ("Straße", ["STRASSE"], "any", 1.0),  # casefold, not lower
    ],
)
def test_score_output_on_hand_made_outputs(output, answers, match, expected):
    assert score_output(output, answers, match) == expected


def test_score_output_refuses_bad_arguments():
    with pytest.raises(ValueError, match="match='some'"):
        score_output("x", ["x"], "some")
    with pytest.raises(ValueError, match="answers is empty"):
        score_output("x", [])


@pytest.mark.parametrize(
    ("tokens", "reference", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], 1.0),
        ([1, 9, 3], [1, 2, 3], 2 / 3),
        ([1, 2], [1, 2, 3, 4], 0.5),  # stopping early is disagreement
        ([1, 2, 3, 4], [1, 2], 0.5),  # running on too
        ([], [], 1.0),
        ([], [5], 0.0),
        ([2, 3, 4], [1, 2, 3], 0.0),  # position by position: a shifted copy does not agree
    ],
)
def test_agreement(tokens, reference, expected):
    assert agreement(tokens, reference) == pytest.approx(expected)


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_reads_valid_samples_and_skips_blank_lines(tmp_path):
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt": "Capital of France?", "answers": ["Paris"]}),
            "",
            json.dumps({"prompt": "2+2?", "answers": ["4", "four"], "id": "extra keys are fine"}),
        ],
    )
    samples = read_jsonl(path)
    assert [s.prompt for s in samples] == ["Capital of France?", "2+2?"]
    assert samples[1].answers == ("4", "four") and samples[1].meta["line"] == 3
    assert samples[0].score("It is paris.") == 1.0 and samples[1].score("five") == 0.0


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ('{"prompt": "x", "answers": ["y"]', "not valid JSON"),
        ('["x", "y"]', "expected a JSON object"),
        ('{"answers": ["y"]}', "'prompt' must be a non-empty string, got nothing"),
        ('{"prompt": "", "answers": ["y"]}', "'prompt' must be a non-empty string"),
        ('{"prompt": 3, "answers": ["y"]}', "'prompt' must be a non-empty string, got 3"),
        ('{"prompt": "x"}', "'answers' must be a non-empty list"),
        ('{"prompt": "x", "answers": "y"}', "'answers' must be a non-empty list"),
        ('{"prompt": "x", "answers": []}', "'answers' must be a non-empty list"),
        ('{"prompt": "x", "answers": ["ok", 5]}', r"'answers'\[1\] must be a non-empty string, got 5"),
    ],
)
def test_jsonl_rejects_bad_lines_with_the_line_number(tmp_path, bad, problem):
    good = json.dumps({"prompt": "fine", "answers": ["a"]})
    path = _write(tmp_path, [good, "", bad, good])
    with pytest.raises(DataError, match=rf"data\.jsonl:3: {problem}"):
        read_jsonl(path)


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no samples"):
        read_jsonl(_write(tmp_path, ["", "  "]))
