"""What the converted model takes for one inference (``transformations.convert_model``'s IR).

Two shapes of step, one model:

* **rows** (:func:`step_inputs`): ``input_ids [B, n]``, one sequence handle per row. A lone
  sequence's prompt or decode token, or a decode step of ``B`` sequences.
* **ragged** (:func:`ragged_step_inputs`): ``input_ids [1, T]`` with one handle per token; the
  adjacent tokens of one handle are that sequence's step. A prompt chunk and every other
  sequence's decode token go through the model's matmuls together, as native continuous
  batching runs them, instead of one inference for the chunk and one for the decode tokens.

Either way ``kvc_logits_at`` names the positions whose logits the model computes (each
sequence's last token), and positions are each sequence's own.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from ov_kvcrush.errors import UserError

#: Name of the input the converted model adds (``transformations.convert_model``): one cache
#: sequence handle per batch row (or, in a one-row batch, per token: a ragged step of several
#: sequences).
SEQUENCE_INPUT = "kvc_sequence"
#: With ``last_token_logits``: the positions (along the token axis) whose logits the model returns.
LOGITS_INPUT = "kvc_logits_at"

#: OpenVINO's CPU plugin runs a step whose token count is a multiple of this 20-40 % faster per
#: token than counts just off it (its weight-compressed AMX matmuls; SmolLM2 here: 512 tokens
#: 150 ms, 544 tokens 222 ms, 640 tokens 185 ms; a 3089-token prompt 1.53 s whole, 1.34 s as
#: 3072 + 17), so a long prompt goes in as a multiple of it and the rest.
FAST_STEP_TOKENS = 128


def fast_prompt_cut(n: int) -> int:
    """How many of an ``n``-token prompt's tokens the first step feeds: the largest multiple of
    :data:`FAST_STEP_TOKENS` (``n`` itself when that is 0 or ``n``)."""
    head = n - n % FAST_STEP_TOKENS
    return head if 0 < head < n else n


def step_inputs(
    names: Collection[str], ids: Sequence[Sequence[int]], handles: Sequence[int], past: Sequence[int]
) -> dict[str, np.ndarray]:
    """Row ``b`` feeds ``ids[b]`` (equal counts) to sequence ``handles[b]`` after its ``past[b]``
    tokens; the logits come back as ``[rows, 1, vocab]`` (each row's last position)."""
    n = len(ids[0])
    if any(len(x) != n for x in ids):
        raise UserError("a step of batch rows needs the same token count in every row (use a ragged step)")
    feed: dict[str, np.ndarray] = {
        "input_ids": np.asarray(ids, dtype=np.int64),
        SEQUENCE_INPUT: np.asarray(handles, dtype=np.int64),
    }
    if "position_ids" in names:
        feed["position_ids"] = np.asarray([np.arange(p, p + n) for p in past], dtype=np.int64)
    return _other_inputs(names, feed, len(ids), max(past) + n, np.asarray([n - 1], dtype=np.int64))


def ragged_step_inputs(
    names: Collection[str], ids: Sequence[Sequence[int]], handles: Sequence[int], past: Sequence[int]
) -> dict[str, np.ndarray]:
    """Sequence ``handles[i]`` gets ``ids[i]`` (any count ≥ 1) after its ``past[i]`` tokens, all in
    one row; the logits come back as ``[1, sequences, vocab]``, each sequence's last token in order."""
    lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
    if not len(lengths) or (lengths < 1).any():
        raise UserError("a ragged step needs at least one token for every sequence in it")
    if len(set(handles)) != len(handles):
        raise UserError("a ragged step takes each sequence once")
    feed: dict[str, np.ndarray] = {
        "input_ids": np.asarray([[t for x in ids for t in x]], dtype=np.int64),
        SEQUENCE_INPUT: np.repeat(np.asarray(handles, dtype=np.int64), lengths),
    }
    if "position_ids" in names:
        feed["position_ids"] = np.concatenate([np.arange(p, p + n) for p, n in zip(past, lengths, strict=True)])[None]
    return _other_inputs(names, feed, 1, int(max(past) + lengths.max()), np.cumsum(lengths) - 1)


def _other_inputs(
    names: Collection[str], feed: dict[str, np.ndarray], rows: int, mask: int, logits_at: np.ndarray
) -> dict[str, np.ndarray]:
    """The inputs besides tokens, positions and handles that a converted model may still have."""
    if LOGITS_INPUT in names:
        feed[LOGITS_INPUT] = logits_at
    if "attention_mask" in names:  # not read by the converted attention: only its shape matters
        feed["attention_mask"] = np.ones((rows, mask), dtype=np.int64)
    if "beam_idx" in names:
        feed["beam_idx"] = np.zeros(rows, dtype=np.int32)
    return feed
