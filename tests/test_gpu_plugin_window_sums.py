"""The methods' window sums from the model's own attention on ``device="GPU"`` (issue 71, item 5:
no scoring method reads the keys a second time): the plugin's ``OvkcRows`` layer, after
the prompt layer, writes the rows the methods score and sums each slot's probability over each
sequence's score rows (or takes the largest, KVzip's) from the rows' log-sum-exp the prompt
layer wrote. Oracle: the softmax of each
score row in float64 over its sequence's slots, the earlier ones as the u8 blocks hold them, a
chunk's own tokens as the model gave them (the CPU op's prompt attention, whose probabilities
its methods score); the same sums over the blocks' rounded copies are far from it, so a layer
that read the store for a chunk's own keys fails."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ov_kvcrush.gpu import layer_inputs, plugin_layers, plugin_step_models
from ov_kvcrush.gpu.layout import PoolShape, page_heads, stored

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 16
SHAPE = PoolShape("u8", BLOCK, HEAD_DIM, Q_HEADS // KV_HEADS)
ATTRIBUTES = plugin_layers.LayerAttributes(SHAPE, 8, HEAD_DIM**-0.5)
#: each sequence's slots per KV head before the step (the second's heads apart, as KVzip's), its
#: tokens in the step, and its score rows (its last): a chunk after earlier ones and its window,
#: a decode token (it reads the store), a whole prompt every row of which scores (H2O's)
HELD = [[29, 29], [45, 40], [7, 7]]
COUNTS = [37, 1, 20]
SCORED = [8, 1, 20]


def _step(rng: np.random.Generator, largest: bool) -> dict:
    """The step's feeds and what each row (sequence, KV head) holds after it: the keys as the
    model gave them and whether the sequence attends its own tokens exactly."""
    d, t = HEAD_DIM, sum(COUNTS)
    starts = np.cumsum([0, *COUNTS])
    held = [n for per_seq in HELD for n in per_seq]
    adds = [c for c in COUNTS for _ in range(KV_HEADS)]
    old_k = [rng.standard_normal((n, d)).astype(np.float32) for n in held]
    old_v = [rng.standard_normal((n, d)).astype(np.float32) for n in held]
    q = rng.standard_normal((Q_HEADS, t, d)).astype(np.float32)
    k = rng.standard_normal((KV_HEADS, t, d)).astype(np.float32)
    v = rng.standard_normal((KV_HEADS, t, d)).astype(np.float32)
    heads = page_heads(SHAPE, [np.pad(x, ((0, c), (0, 0))) for x, c in zip(old_k, adds, strict=True)],
                       [np.pad(x, ((0, c), (0, 0))) for x, c in zip(old_v, adds, strict=True)], rng)  # fmt: skip
    spans = [slice(starts[row // KV_HEADS], starts[row // KV_HEADS + 1]) for row in range(len(held))]
    keys = [np.concatenate([old_k[row], k[row % KV_HEADS, span]]) for row, span in enumerate(spans)]
    values = [np.concatenate([old_v[row], v[row % KV_HEADS, span]]) for row, span in enumerate(spans)]
    lengths = np.array(held, np.int32) + np.array(adds, np.int32)
    score_rows = [i for s, n in enumerate(SCORED) for i in range(starts[s + 1] - n, starts[s + 1])]
    sums = layer_inputs.WindowSums(len(COUNTS), Q_HEADS, int(lengths.max()), largest)
    own = [c > 1 for c in COUNTS]
    feeds = {
        "q": q, "k": k, "v": v, "tables": heads.tables, "first": np.array(held, np.int32), "lengths": lengths,
        "tokens": layer_inputs.token_tensor(COUNTS, own), "score_rows": np.array(score_rows, np.int64),
        "step": layer_inputs.step_tensor(heads.tables.shape[1], t, score_rows=len(score_rows), sums=sums),
    }  # fmt: skip
    return {"pool": heads.pool, "feeds": feeds, "keys": keys, "values": values, "sums": sums, "own": own}


def _run_in_worker(folder: str, steps: list[dict]) -> list[tuple[np.ndarray, ...]]:
    """In the emulation worker: each step through the scored step's model; its attention and what
    it wrote into ``logits`` and ``rows`` (as floats)."""
    import openvino as ov

    from ov_kvcrush.op import plugin

    core = plugin.shared_core()
    model = plugin_step_models.prefill_step_model(ATTRIBUTES, KV_HEADS)
    compiled = plugin_step_models.compile_step_model(core, Path(folder), ATTRIBUTES, model)
    request, context = compiled.create_infer_request(), core.get_default_context("GPU")
    results = []
    for step in steps:
        logits = np.zeros(step["sums"].nbytes(sum(COUNTS)), np.uint8)
        rows = plugin_step_models.rows_input(Q_HEADS, HEAD_DIM, sum(SCORED))
        tensors = {}
        for name, array in (("pool", step["pool"]), ("logits", logits), ("rows", rows)):
            tensors[name] = context.create_tensor(ov.Type.u8, ov.Shape([array.size]), {})
            tensors[name].copy_from(ov.Tensor(array))
            request.set_tensor(name, tensors[name])
        for name, array in step["feeds"].items():
            request.set_tensor(name, ov.Tensor(np.ascontiguousarray(array)))
        request.infer()
        written = {name: ov.Tensor(ov.Type.u8, ov.Shape([a.size])) for name, a in (("logits", logits), ("rows", rows))}
        for name, host in written.items():
            tensors[name].copy_to(host)
        results.append((request.get_output_tensor(0).data.copy(), *(written[n].data.view(np.float32).copy()
                                                                     for n in ("logits", "rows"))))  # fmt: skip
    return results


def _expected(step: dict, exact_own: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference's sums ``[sequences, Hq, stride]``, each row's log-sum-exp ``[Hq, T]`` (the
    score rows' alone set) and attention ``[Hq, T, D]``, in float64; ``exact_own`` False: a
    chunk's own keys read from the blocks too (what a layer that read the store would give)."""
    feeds, sums = step["feeds"], step["sums"]
    starts = np.cumsum([0, *COUNTS])
    total = np.zeros((len(COUNTS), Q_HEADS, sums.stride))
    lse = np.full((Q_HEADS, sum(COUNTS)), np.nan)
    out = np.zeros((Q_HEADS, sum(COUNTS), HEAD_DIM))
    for s, per_seq in enumerate(HELD):
        for h in range(Q_HEADS):
            row = s * KV_HEADS + h // SHAPE.group
            keys = stored(SHAPE, step["keys"][row]).astype(np.float64)
            values = stored(SHAPE, step["values"][row]).astype(np.float64)
            own = slice(per_seq[h // SHAPE.group], None)
            if step["own"][s]:
                values[own] = step["values"][row][own]
                if exact_own:
                    keys[own] = step["keys"][row][own]
            for i in range(COUNTS[s]):
                seen = per_seq[h // SHAPE.group] + i + 1
                logits = keys[:seen] @ feeds["q"][h, starts[s] + i].astype(np.float64) * HEAD_DIM**-0.5
                m = logits.max()
                p = np.exp(logits - m) / np.exp(logits - m).sum()
                out[h, starts[s] + i] = p @ values[:seen]
                if i >= COUNTS[s] - SCORED[s]:
                    lse[h, starts[s] + i] = m + np.log(np.exp(logits - m).sum())
                    total[s, h, :seen] = np.maximum(total[s, h, :seen], p) if sums.largest else total[s, h, :seen] + p
    return total, lse, out


@pytest.mark.parametrize("largest", [False, True], ids=["summed", "largest"])
def test_the_model_sums_each_sequences_score_rows_as_its_exact_attention_gave_them(emulation_worker, tmp_path, largest):
    step = _step(np.random.default_rng(11), largest)
    [(out, written, rows)] = emulation_worker.submit(_run_in_worker, str(tmp_path), [step]).result(600)
    index = step["feeds"]["score_rows"]
    np.testing.assert_array_equal(rows.reshape(Q_HEADS, len(index), HEAD_DIM), step["feeds"]["q"][:, index])
    want, want_lse, want_out = _expected(step)
    np.testing.assert_allclose(out, want_out, atol=1e-5)  # the prompt layer's attention, passed on
    sums = step["sums"]
    got = written[: sums.lse_at].reshape(len(COUNTS), Q_HEADS, sums.stride)
    got_lse = written[sums.lse_at :].reshape(Q_HEADS, sum(COUNTS))
    scored = ~np.isnan(want_lse)
    np.testing.assert_allclose(got_lse[scored], want_lse[scored], atol=1e-5)
    np.testing.assert_allclose(got, want, atol=1e-5)  # zeros past each head's slots too
    # the blocks' rounded copies of a chunk's own keys give other sums: the oracle tells them apart
    rounded, _, _ = _expected(step, exact_own=False)
    assert np.abs(rounded - want).max() > 1e-3
