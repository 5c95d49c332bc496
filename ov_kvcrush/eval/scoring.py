"""Scoring without a model: answer matching and agreement with the full cache's tokens."""

from __future__ import annotations

from collections.abc import Sequence

MATCH_MODES = ("any", "all")


def score_output(output: str, answers: Sequence[str], match: str = "any") -> float:
    """Score generated text against known answers, case-insensitively.

    ``any``: 1.0 when the output contains any answer, else 0.0 (passkey, needles, custom data).
    ``all``: the fraction of answers the output contains (RULER's variable tracking).
    """
    if match not in MATCH_MODES:
        raise ValueError(f"match={match!r} is invalid: allowed " + ", ".join(MATCH_MODES))
    if not answers:
        raise ValueError("answers is empty: allowed a non-empty list of strings")
    text = output.casefold()
    found = [a.casefold() in text for a in answers]
    if match == "any":
        return float(any(found))
    return sum(found) / len(found)


def agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Token match rate of a greedy continuation against the full cache's (position by position).

    Positions are compared up to the longer of the two, so stopping early or running on counts
    as disagreement; two empty continuations agree fully.
    """
    n = max(len(tokens), len(reference))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(tokens, reference, strict=False)) / n
