"""Small, seeded prompt generators used by the demo and tests (the evaluation issue extends them).

Passkey retrieval (Mohtashami & Jaggi): a random 5-digit key hidden at a chosen depth inside
repetitive filler; the model must repeat it. The answer is known, so scoring needs no model.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
QUESTION = "\nWhat is the pass key?"


@dataclass(frozen=True)
class PasskeySample:
    """A passkey prompt, its answer and where the answer sits (fraction of the filler)."""

    prompt: str
    answer: str
    depth: float
    filler_units: int

    def score(self, output: str) -> float:
        """1.0 when the generated text contains the key, else 0.0."""
        return float(self.answer in output)


def passkey_prompt(
    target_tokens: int,
    count_tokens: Callable[[str], int],
    seed: int = 0,
    depth: float = 0.5,
) -> PasskeySample:
    """Build a passkey prompt of about ``target_tokens`` tokens (never more).

    ``count_tokens`` measures text with the model's tokenizer, so the length holds for any model.
    ``depth`` in [0, 1] places the key: 0 right after the intro, 1 right before the question.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth!r} is invalid: allowed a number in [0, 1]")
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "

    def build(units: int) -> str:
        before = round(units * depth)
        return INTRO + FILLER * before + needle + FILLER * (units - before) + QUESTION

    fixed = count_tokens(build(0))
    if target_tokens < fixed:
        raise ValueError(f"target_tokens={target_tokens} is invalid: allowed >= {fixed} (the prompt without filler)")
    per_unit = max(1, count_tokens(FILLER * 8) // 8)
    units = max(0, (target_tokens - fixed) // per_unit)
    while units > 0 and count_tokens(build(units)) > target_tokens:
        units -= 1
    while count_tokens(build(units + 1)) <= target_tokens:
        units += 1
    return PasskeySample(prompt=build(units), answer=key, depth=depth, filler_units=units)
