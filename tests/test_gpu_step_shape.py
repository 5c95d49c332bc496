"""The sizes a step is shown to OpenVINO's GPU plugin at (``ov_kvcrush/gpu/step_shape.py``): few,
each the least of its kind at or above what the step holds, and the padding laid out as a
sequence of its own. Oracles: brute force over the sizes' definition, and the unpadded layout."""

from __future__ import annotations

import numpy as np

from ov_kvcrush.gpu.layer_inputs import token_tensor
from ov_kvcrush.gpu.step_shape import EXACT, MIN_TABLE_WIDTH, StepPadding, step_size, table_width


def _sizes(limit: int) -> list[int]:
    """Every size up to ``limit``, by the definition: 1 to EXACT, then m * 2**k for m in [8, 16)."""
    sizes = set(range(1, EXACT + 1))
    for k in range(limit.bit_length() + 1):
        sizes |= {m << k for m in range(8, 16)}
    return sorted(s for s in sizes if s <= 2 * limit)


def test_a_count_is_shown_at_the_least_size_at_or_above_it_at_most_an_eighth_over():
    sizes = _sizes(5000)
    for n in range(1, 5000):
        assert step_size(n) == next(s for s in sizes if s >= n), n
        assert step_size(n) <= max(n + n // 8, EXACT), n
    assert len({step_size(n) for n in range(1, 8193)}) == EXACT + 8 * 10  # eight sizes a doubling past 8


def test_a_table_width_is_the_least_power_of_two_that_holds_the_blocks():
    for blocks in range(0, 3000):
        width = table_width(blocks)
        assert width >= max(blocks, MIN_TABLE_WIDTH) and width & (width - 1) == 0, blocks
        assert width == MIN_TABLE_WIDTH or width // 2 < blocks, blocks


def test_the_padding_is_a_sequence_after_the_steps_own_in_its_one_block():
    counts = [3, 1, 150]
    shown = StepPadding.of(counts)
    assert (shown.tokens, shown.sequences, shown.padding) == (160, 4, 6)
    rows = shown.token_rows(block_size=4, own=[True, False, True])
    assert np.array_equal(rows[:154], token_tensor(counts, [True, False, True]))  # the step's tokens as they were
    assert rows[:154, 2].tolist() == [1] * 3 + [0] + [1] * 150  # each token's own flag its sequence's
    assert rows[154:].tolist() == [[3, i % 4, 0] for i in range(6)]  # then the pad sequence's, in one block, reading it
    assert shown.pad_slots(4) == 4 and shown.pad_slots(16) == 6
    decode = StepPadding.of([1] * 5)  # a few decode rows: shown as they are
    assert (decode.tokens, decode.sequences, decode.padding) == (5, 8, 0)  # its rows: a power of two


def test_the_rows_added_hold_the_fill_and_the_model_tokens_zeros_after_the_steps():
    shown = StepPadding.of([20, 1])  # 21 tokens: 22 shown, 4 sequences
    kv = 2
    lengths = np.arange(2 * 2 * kv, dtype=np.int32).reshape(2, 2 * kv)
    padded = shown.rows(lengths, kv, 0)
    assert padded.shape == (2, 4 * kv) and np.array_equal(padded[:, : 2 * kv], lengths)
    assert not padded[:, 2 * kv :].any()
    recall = shown.rows(np.ones((2, 2 * kv, 3), np.int32), kv, np.array([-1, 0, 0], np.int32))
    assert recall[:, 2 * kv :].tolist() == [[[-1, 0, 0]] * 2 * kv] * 2
    feed = {"input_ids": np.arange(1, 22)[None], "position_ids": np.arange(21)[None], "beam_idx": np.zeros(1)}
    out = shown.model_tokens(feed)
    assert out["input_ids"].tolist() == [[*range(1, 22), 0]] and out["position_ids"].shape == (1, 22)
    assert out["beam_idx"] is feed["beam_idx"]
