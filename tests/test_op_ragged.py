"""One inference of several sequences' steps of different lengths (per-token handles).

Continuous batching runs a prompt chunk of one sequence and the decode tokens of every other in
one inference, as native ``PagedAttention`` does: the op gets a one-row batch whose tokens carry
one handle each, and adjacent tokens of one handle are that sequence's step. The oracle is the
same steps run one sequence at a time on a twin pool: every output row and every held position,
key, value and score must be equal, under a method that scores and evicts (SnapKV, with a
chunked prompt so its selection runs mid-batch).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import HKV, HQ, D, infer, op_model

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.op import kvcache
from ov_kvcrush.op.method_spec import method_spec

LAYERS = 1
BLOCK = 32


def _pool(precision: str) -> kvcache.KVPool:
    cfg = CompressionConfig("snapkv", budget=96, options={"window": 8}).method_config()
    return kvcache.KVPool(
        LAYERS, HQ, HKV, D, block_size=BLOCK, precision=precision, method=method_spec(cfg, LAYERS, HQ, BLOCK)
    )


def _step(req, seqs, steps):
    """One inference: ``steps`` are (sequence index, q, k, v) with [1, H, n, D] tensors, side by side."""
    q = np.concatenate([s[1] for s in steps], 2)
    k = np.concatenate([s[2] for s in steps], 2)
    v = np.concatenate([s[3] for s in steps], 2)
    handles = np.concatenate([np.full(s[1].shape[2], seqs[s[0]].handle, dtype=np.int64) for s in steps])
    return np.array(req.infer({"q": q, "k": k, "v": v, "kvc_sequence": handles})[0])


@pytest.mark.parametrize("precision", ["f32", "u8"])
def test_ragged_steps_equal_one_sequence_at_a_time(ov_core, precision):
    rng = np.random.default_rng(7)
    req = op_model(ov_core, HQ, HKV, D)
    ragged_pool, alone_pool = _pool(precision), _pool(precision)
    ragged = [ragged_pool.new_sequence() for _ in range(3)]
    alone = [alone_pool.new_sequence() for _ in range(3)]
    prompts = [150, 40, 70]  # sequence 0's prompt comes in chunks beside the others' decode steps
    for seqs in (ragged, alone):
        seqs[0].set_prompt(prompts[0])

    def draw(n):
        return (
            rng.standard_normal((1, HQ, n, D), dtype=np.float32),
            rng.standard_normal((1, HKV, n, D), dtype=np.float32),
            rng.standard_normal((1, HKV, n, D), dtype=np.float32),
        )

    # the schedule: each inference lists (sequence, tokens); lengths differ within every step
    schedule = [
        [(1, 40), (2, 70)],  # two prompts side by side
        [(0, 64), (1, 1), (2, 1)],  # a prompt chunk beside two decode tokens
        [(1, 1), (0, 64), (2, 1)],  # the chunk in the middle
        [(2, 1), (1, 1), (0, 22)],  # the last chunk: SnapKV selects over the whole prompt
        [(0, 1), (1, 1), (2, 1)],  # decode of all three (equal lengths, one handle per token)
        [(2, 1), (0, 1)],
    ]
    for plan in schedule:
        steps = [(i, *draw(n)) for i, n in plan]
        got = _step(req, ragged, steps)
        a = 0
        for i, q, k, v in steps:
            n = q.shape[2]
            want = np.array(req.infer({"q": q, "k": k, "v": v, "kvc_sequence": np.array([alone[i].handle])})[0])
            np.testing.assert_array_equal(got[:, :, a : a + n], want, err_msg=f"sequence {i} in {plan}")
            a += n
    assert (ragged[0].head_tokens() <= 96 + BLOCK).all()  # the selection ran
    for r, s in zip(ragged, alone, strict=True):
        assert r.stats().tokens_seen == s.stats().tokens_seen
        for g in range(HKV):
            for x, y in zip(r.read_head(0, g), s.read_head(0, g), strict=True):
                np.testing.assert_array_equal(x, y)


def test_a_step_refuses_two_runs_or_rows_of_one_sequence(ov_core):
    req = op_model(ov_core, HQ, HKV, D)
    pool = _pool("f32")
    a, b = pool.new_sequence(), pool.new_sequence()
    x = np.zeros((1, HQ, 3, D), dtype=np.float32)
    kv = np.zeros((1, HKV, 3, D), dtype=np.float32)
    with pytest.raises(RuntimeError, match="two separate runs"):
        infer(req, {"q": x, "k": kv, "v": kv, "kvc_sequence": np.array([a.handle, b.handle, a.handle])})
    with pytest.raises(RuntimeError, match="two batch rows"):  # rows of one step run side by side
        rows_q, rows_kv = np.zeros((2, HQ, 1, D), dtype=np.float32), np.zeros((2, HKV, 1, D), dtype=np.float32)
        infer(req, {"q": rows_q, "k": rows_kv, "v": rows_kv, "kvc_sequence": np.array([a.handle, a.handle])})
    with pytest.raises(RuntimeError, match="one per token"):
        infer(req, {"q": x, "k": kv, "v": kv, "kvc_sequence": np.array([a.handle, b.handle])})
