"""Our decode step as OpenVINO GPU plugin layers (issue 49): the four SimpleGPU layers
(``ov_kvcrush.gpu.plugin_layers``) compiled and run by the plugin itself, on Intel's OpenCL CPU
runtime under the emulation layer. The pool is a remote tensor of the plugin's context, laid out
as the CPU op's (shuffled blocks, garbage between them, each KV head its own token count); two
decode steps each store a token per KV head in place and attend; the attention and each head's
probabilities equal the reference over the stored tokens (``layout.stored``), and the second step
sees the first step's token, kept in the pool between inferences."""

from __future__ import annotations

import numpy as np
import pytest

from ov_kvcrush.gpu import emulation, plugin_layers
from ov_kvcrush.gpu.layout import PoolShape, stored

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 16
TOKENS = (29, 45)  # each KV head's tokens before the steps: a partial last block each
CONFIGS = [("f32", 16), ("f16", 16), ("u8", 16), ("u8", 8)]


def _layer_or_skip() -> None:
    reason = emulation.unavailable()
    if reason:
        pytest.skip(reason)


def _run_in_worker(folder: str, scenario) -> list:
    """In the emulation worker: the scenario's steps run by the plugin."""
    from pathlib import Path

    from ov_kvcrush.gpu import plugin_layers
    from ov_kvcrush.op import plugin

    return plugin_layers.run_on_plugin(plugin.shared_core(), Path(folder), scenario)


def _reference(shape: PoolShape, q: np.ndarray, keys: list, values: list) -> tuple[np.ndarray, list]:
    out, probs = np.zeros((Q_HEADS, HEAD_DIM)), []
    for h in range(Q_HEADS):
        kv = h // shape.group
        k, v = stored(shape, keys[kv]).astype(np.float64), stored(shape, values[kv]).astype(np.float64)
        logits = k @ q[h].astype(np.float64) * HEAD_DIM**-0.5
        p = np.exp(logits - logits.max())
        p /= p.sum()
        out[h] = p @ v
        probs.append(p)
    return out, probs


@pytest.fixture(scope="module")
def plugin_worker():
    _layer_or_skip()
    with emulation.worker() as worker:
        yield worker


@pytest.mark.parametrize(("precision", "sub_group"), CONFIGS, ids=[f"{p}-sg{s}" for p, s in CONFIGS])
def test_the_plugin_runs_our_decode_step_over_a_pool_it_holds(plugin_worker, tmp_path, precision, sub_group):
    shape = PoolShape(precision, BLOCK, HEAD_DIM, Q_HEADS // KV_HEADS)
    attributes = plugin_layers.LayerAttributes(shape, sub_group, HEAD_DIM**-0.5)
    scenario = plugin_layers.random_scenario(attributes, "decode", TOKENS, (1, 1), np.random.default_rng(7))
    steps = zip(scenario.steps, scenario.keys, scenario.values, strict=True)
    expected = [_reference(shape, step["q"], keys, values) for step, keys, values in steps]
    got = plugin_worker.submit(_run_in_worker, str(tmp_path), scenario).result(600)
    for (out, probs), (ref_out, ref_probs) in zip(got, expected, strict=True):
        np.testing.assert_allclose(out, ref_out, atol=1e-5)
        for h, p in enumerate(ref_probs):
            np.testing.assert_allclose(probs[h, : len(p)], p, atol=1e-6)


def _causal_reference(shape: PoolShape, q: np.ndarray, first_position: int, keys: list, values: list,
                      positions: list) -> np.ndarray:  # fmt: skip
    """Each query head's rows (at first_position + r) over its KV head's stored tokens at or before them."""
    rows = q.shape[1]
    out = np.zeros(q.shape)
    for h in range(q.shape[0]):
        kv = h // shape.group
        k, v = stored(shape, keys[kv]).astype(np.float64), stored(shape, values[kv]).astype(np.float64)
        for r in range(rows):
            seen = positions[kv] <= first_position + r
            logits = k[seen] @ q[h, r].astype(np.float64) * HEAD_DIM**-0.5
            p = np.exp(logits - logits.max())
            out[h, r] = (p / p.sum()) @ v[seen]
    return out


@pytest.mark.parametrize(("precision", "sub_group"), [("f16", 16), ("u8", 8)], ids=["f16-sg16", "u8-sg8"])
def test_the_plugin_runs_our_prompt_steps_over_heads_with_gaps(plugin_worker, tmp_path, precision, sub_group):
    """Two prompt chunks then a step of one row, over KV heads whose earlier tokens sit at
    positions with gaps (as after eviction): each row attends exactly the slots at or before it."""
    shape = PoolShape(precision, BLOCK, HEAD_DIM, Q_HEADS // KV_HEADS)
    attributes = plugin_layers.LayerAttributes(shape, sub_group, HEAD_DIM**-0.5)
    scenario = plugin_layers.random_scenario(attributes, "prefill", TOKENS, (20, 17, 1), np.random.default_rng(8))
    got = plugin_worker.submit(_run_in_worker, str(tmp_path), scenario).result(600)
    for (out,), step, keys, values, positions in zip(
        got, scenario.steps, scenario.keys, scenario.values, scenario.positions, strict=True
    ):
        first_position = int(step["step"][2])
        np.testing.assert_allclose(out, _causal_reference(shape, step["q"], first_position, keys, values, positions),
                                   atol=1e-5)  # fmt: skip
