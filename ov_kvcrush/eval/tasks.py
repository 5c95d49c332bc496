"""Long-context tasks generated locally from a seed: the answer is known, so scoring needs no model.

* ``passkey`` (Mohtashami & Jaggi): a 5-digit key hidden at a depth inside repetitive filler.
* ``niah_single`` (RULER ``niah_single_2``): one "special magic number" for a key hidden in
  real prose (Paul Graham's essays); the model must return the number.
* ``niah_multikey`` (RULER ``niah_multikey_1``): the same with three distractor needles for
  other keys at random depths; only the asked key's number counts.
* ``vt`` (RULER variable tracking): ``VAR A = 12345`` then ``VAR B = VAR A`` ... hops spread
  through filler; the model must list every variable holding the value (score: the fraction
  of them named). Variable names are nouns from ``wonderwords``.
* ``ppl``: perplexity of held-out essay text, teacher-forced through the compressed cache one
  token at a time after a long context (see
  :meth:`~ov_kvcrush.engines.torch_engine.TorchEngine.score_continuation_each`).

Every generator is deterministic in ``(seed, task, length, index)``; sample ``index`` of ``n``
puts its needle at depth ``(index + 0.5) / n`` so a run covers the context evenly. Lengths are
measured with the model's own tokenizer (``count_tokens``), on the user message before the chat
template; a prompt never exceeds its target length.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ov_kvcrush import corpus
from ov_kvcrush.eval.scoring import score_output

CountTokens = Callable[[str], int]
Tokenize = Callable[[str], list[int]]

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
QUESTION = "\nWhat is the pass key?"

NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}. "
NIAH_QUESTION = "\nWhat is the special magic number for {key} mentioned in the provided text? Answer with the number."
NIAH_ANSWER = "Answer: The special magic number for {key} mentioned in the provided text is"
PASSKEY_ANSWER = "Answer: The pass key is"
MULTIKEY_DISTRACTORS = 3

VT_INTRO = "Memorize and track the chain of variable assignments hidden in the following text.\n"
VT_QUESTION = (
    "\nQuestion: Find all variables that are assigned the value {value} in the text above. "
    "Answer: the variables assigned the value {value} are:"
)
VT_HOPS = 4


@dataclass(frozen=True)
class Sample:
    """A generation prompt with its known answers.

    Attributes:
        task: task name.
        prompt: the user message (engines apply the chat template).
        answers: strings the output is checked for (case-insensitive).
        match: ``any`` (1 when any answer appears, else 0) or ``all`` (the fraction that appear).
        depth: where the (asked) needle sits, as a fraction of the context; ``None`` if not placed.
        meta: generator details (keys, distractors, filler size ...), for reports.
        question: the text ``prompt`` ends with that asks the question ("" when not known): with
            ``--question-after`` the context before it is compressed first, then it is asked.
        answer_prefix: the start of the answer, fed after the prompt in the ``completion``
            prompt format (a pretrained model without chat tuning continues it; RULER does the
            same for base models). "" when the question already ends in one.
    """

    task: str
    prompt: str
    answers: tuple[str, ...]
    match: str = "any"
    depth: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    question: str = ""
    answer_prefix: str = ""

    def score(self, output: str) -> float:
        return score_output(output, self.answers, self.match)


@dataclass(frozen=True)
class PerplexitySample:
    """A long context and the held-out text that follows it, as token ids."""

    task: str
    context: list[int]
    continuation: list[int]
    meta: dict[str, Any] = field(default_factory=dict)


def sample_depth(index: int, samples: int) -> float:
    """Depth of sample ``index`` of ``samples``: evenly spread, never at the very edges."""
    if not 0 <= index < samples:
        raise ValueError(f"index={index} is invalid: allowed 0 <= index < samples={samples}")
    return (index + 0.5) / samples


def _rng(seed: int, task: str, length: int, index: int) -> random.Random:
    # a string seed is hashed with SHA-512 by random.seed: stable across runs and processes
    return random.Random(f"{seed}:{task}:{length}:{index}")


def _fit(
    target_tokens: int,
    count_tokens: CountTokens,
    build: Callable[[int], str],
    per_unit: float,
    what: str,
    field_name: str = "length",
) -> int:
    """The largest number of filler units whose prompt fits ``target_tokens`` (estimate, then exact steps)."""
    fixed = count_tokens(build(0))
    if target_tokens < fixed:
        raise ValueError(
            f"{field_name}={target_tokens} is invalid for {what}: allowed >= {fixed} (the prompt without filler)"
        )
    units = max(0, int((target_tokens - fixed) / max(per_unit, 1e-9)))
    while units > 0:  # step down by about half the overshoot, each candidate tokenized once
        over = count_tokens(build(units)) - target_tokens
        if over <= 0:
            break
        units = max(0, units - max(1, over // max(1, int(per_unit)) // 2))
    while count_tokens(build(units + 1)) <= target_tokens:
        units += 1
    return units


def _insert(pieces: Sequence[str], needles: Sequence[tuple[float, str]]) -> str:
    """Join ``pieces`` with each ``(depth, text)`` needle inserted at that fraction of them."""
    slots: dict[int, list[str]] = {}
    for depth, text in needles:
        slots.setdefault(round(len(pieces) * depth), []).append(text)
    out: list[str] = []
    for i in range(len(pieces) + 1):
        out.extend(slots.get(i, ()))
        if i < len(pieces):
            out.append(pieces[i])
    return "".join(out)


# --------------------------------------------------------------------------------------------
# passkey


@dataclass(frozen=True)
class PasskeySample(Sample):
    """A passkey prompt; ``filler_units`` is how many filler blocks it holds."""

    filler_units: int = 0

    @property
    def answer(self) -> str:
        return self.answers[0]


def passkey_prompt(
    target_tokens: int,
    count_tokens: CountTokens,
    seed: int = 0,
    depth: float = 0.5,
) -> PasskeySample:
    """Build a passkey prompt of about ``target_tokens`` tokens (never more).

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

    per_unit = max(1, count_tokens(FILLER * 8) // 8)
    units = _fit(target_tokens, count_tokens, build, per_unit, "passkey", "target_tokens")
    return PasskeySample(
        task="passkey",
        prompt=build(units),
        answers=(key,),
        depth=depth,
        filler_units=units,
        meta={"key": key},
        question=QUESTION,
        answer_prefix=PASSKEY_ANSWER,
    )


def passkey_task(length: int, count_tokens: CountTokens, seed: int, index: int, samples: int) -> Sample:
    """Passkey sample ``index`` of ``samples`` at ``length`` tokens."""
    key_seed = _rng(seed, "passkey", length, index).randrange(1 << 30)
    return passkey_prompt(length, count_tokens, seed=key_seed, depth=sample_depth(index, samples))


# --------------------------------------------------------------------------------------------
# needle in a haystack on real prose


def _haystack_sentences(rng: random.Random, count_tokens: CountTokens, length: int) -> tuple[list[str], float]:
    """Sentences from the haystack essays (seeded essay order), enough for ``length`` tokens.

    Returns them with a trailing space each, and their mean token count.
    """
    essays = list(corpus.haystack_essays())
    rng.shuffle(essays)
    out: list[str] = []
    chars = 0
    for path in essays:
        for s in corpus.sentences(corpus.essay_text(path)):
            out.append(s + " ")
            chars += len(s) + 1
        if chars > 6 * length:  # ~4 characters per token here: 1.5x headroom
            break
    if not out:
        raise ValueError("the haystack essays are empty")
    probe = "".join(out[:200])
    per_sentence = count_tokens(probe) / min(200, len(out))
    if chars < 4 * length:
        raise ValueError(f"length={length} is invalid: the haystack essays hold about {chars // 4} tokens")
    return out, per_sentence


def _keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct ``adjective-noun`` keys (RULER uses words as needle keys)."""
    adjectives, nouns = corpus.word_list("adjective"), corpus.word_list("noun")
    keys: list[str] = []
    while len(keys) < n:
        key = f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
        if key not in keys:
            keys.append(key)
    return keys


def _numbers(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct 7-digit numbers, none a substring of another."""
    out: list[str] = []
    while len(out) < n:
        v = str(rng.randint(1_000_000, 9_999_999))
        if v not in out:
            out.append(v)
    return out


def _niah(task: str, length: int, count_tokens: CountTokens, seed: int, index: int, samples: int) -> Sample:
    rng = _rng(seed, task, length, index)
    distractors = MULTIKEY_DISTRACTORS if task == "niah_multikey" else 0
    keys = _keys(rng, 1 + distractors)
    values = _numbers(rng, 1 + distractors)
    depth = sample_depth(index, samples)
    # distractor depths are drawn apart from the asked needle's slot
    needles = [(depth, NIAH_NEEDLE.format(key=keys[0], value=values[0]))]
    needles += [(rng.random(), NIAH_NEEDLE.format(key=k, value=v)) for k, v in zip(keys[1:], values[1:], strict=True)]
    pieces, per_sentence = _haystack_sentences(rng, count_tokens, length)
    question = NIAH_QUESTION.format(key=keys[0])

    def build(units: int) -> str:
        return NIAH_INTRO + _insert(pieces[:units], needles) + question

    units = _fit(length, count_tokens, build, per_sentence, task)
    if units >= len(pieces):
        raise ValueError(f"length={length} is invalid for {task}: the haystack ran out of sentences")
    return Sample(
        task=task,
        prompt=build(units),
        answers=(values[0],),
        depth=depth,
        meta={"key": keys[0], "distractors": dict(zip(keys[1:], values[1:], strict=True)), "sentences": units},
        question=question,
        answer_prefix=NIAH_ANSWER.format(key=keys[0]),
    )


def niah_single_task(length: int, count_tokens: CountTokens, seed: int, index: int, samples: int) -> Sample:
    """One needle (key, 7-digit number) in essay prose."""
    return _niah("niah_single", length, count_tokens, seed, index, samples)


def niah_multikey_task(length: int, count_tokens: CountTokens, seed: int, index: int, samples: int) -> Sample:
    """The asked needle plus three distractor needles with other keys."""
    return _niah("niah_multikey", length, count_tokens, seed, index, samples)


# --------------------------------------------------------------------------------------------
# variable tracking


def _variable_names(rng: random.Random, n: int, avoid: str) -> list[str]:
    """``n`` upper-case nouns (5-8 letters): none inside another, nor inside the prompt's fixed text."""
    nouns = [w for w in corpus.word_list("noun") if 5 <= len(w) <= 8]
    avoid = avoid.lower()
    names: list[str] = []
    while len(names) < n:
        w = rng.choice(nouns)
        if w in avoid or any(w in other or other in w for other in names):
            continue
        names.append(w)
    return [w.upper() for w in names]


def vt_task(length: int, count_tokens: CountTokens, seed: int, index: int, samples: int) -> Sample:
    """RULER variable tracking: one chain of ``VT_HOPS`` hops; every variable of the chain is an answer."""
    rng = _rng(seed, "vt", length, index)
    value = str(rng.randint(10000, 99999))
    fixed_text = VT_INTRO + FILLER + VT_QUESTION.format(value=value)
    names = _variable_names(rng, VT_HOPS + 1, fixed_text)
    lines = [f"VAR {names[0]} = {value}. "] + [f"VAR {names[i]} = VAR {names[i - 1]}. " for i in range(1, len(names))]
    # the chain starts at this sample's depth and its hops are spread over the rest of the context
    start = sample_depth(index, samples) * 0.5
    depths = [start + (1 - start) * i / (len(lines) + 1) for i in range(len(lines))]
    question = VT_QUESTION.format(value=value)

    def build(units: int) -> str:
        return VT_INTRO + _insert([FILLER] * units, list(zip(depths, lines, strict=True))) + question

    per_unit = max(1, count_tokens(FILLER * 8) // 8)
    units = _fit(length, count_tokens, build, per_unit, "vt")
    return Sample(
        task="vt",
        prompt=build(units),
        answers=tuple(names),
        match="all",
        depth=start,
        meta={"value": value},
        question=question,
    )


# --------------------------------------------------------------------------------------------
# perplexity


def ppl_task(
    length: int, tokenize: Tokenize, seed: int, index: int, continuation: int, bos: int | None = None
) -> PerplexitySample:
    """``length`` tokens of held-out essays (``bos`` first, if the model uses one).

    ``tokenize`` gives ids without special tokens. The first ``length - continuation`` tokens are
    the context, the rest is scored. A seeded offset makes samples read different text.
    """
    if not 0 < continuation < length:
        raise ValueError(f"ppl_tokens={continuation} is invalid: allowed 1 .. length-1 = {length - 1}")
    rng = _rng(seed, "ppl", length, index)
    essays = list(corpus.held_out_essays())
    rng.shuffle(essays)
    ids = tokenize(" ".join(corpus.essay_text(p) for p in essays))
    head = [] if bos is None else [bos]
    body = length - len(head)
    if len(ids) < body:
        raise ValueError(f"length={length} is invalid for ppl: the held-out essays hold {len(ids)} tokens")
    offset = rng.randrange(0, len(ids) - body + 1)
    window = head + ids[offset : offset + body]
    return PerplexitySample(
        task="ppl",
        context=window[: length - continuation],
        continuation=window[length - continuation :],
        meta={"essays": [p.stem for p in essays], "offset": offset},
    )


#: Generation tasks by name: ``(length, count_tokens, seed, index, samples) -> Sample``.
GENERATION_TASKS: dict[str, Callable[..., Sample]] = {
    "passkey": passkey_task,
    "niah_single": niah_single_task,
    "niah_multikey": niah_multikey_task,
    "vt": vt_task,
}
#: Every built-in task (``ppl`` needs token-level access: the torch engine).
TASKS: tuple[str, ...] = (*GENERATION_TASKS, "ppl")
