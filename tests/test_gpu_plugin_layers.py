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

from ov_kvcrush.gpu.layout import PoolShape, page_heads, stored

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 16
TOKENS = (29, 45)  # each KV head's tokens before the steps: a partial last block each
CONFIGS = [("f32", 16), ("f16", 16), ("u8", 16), ("u8", 8)]


def _layer_or_skip() -> None:
    from ov_kvcrush.gpu import emulation, runtime

    if runtime.runtime_library() is None:
        pytest.skip(f"Intel's OpenCL CPU runtime is not installed ({runtime.INSTALL_HINT})")
    try:
        emulation.build()
    except runtime.GPUPathError as e:
        pytest.skip(str(e))


def _steps_on_the_plugin(folder: str, precision: str, sub_group: int, pool: np.ndarray, steps: list[dict]) -> list:
    """In the emulation worker: compile the decode-step model on the plugin's GPU, hold ``pool``
    in a remote tensor, run ``steps``; each step's (attention, probabilities)."""
    from pathlib import Path

    import openvino as ov

    from ov_kvcrush.gpu import plugin_layers
    from ov_kvcrush.op import plugin

    attributes = plugin_layers.LayerAttributes(PoolShape(precision, BLOCK, HEAD_DIM, Q_HEADS // KV_HEADS), sub_group,
                                               HEAD_DIM**-0.5)  # fmt: skip
    core = plugin.shared_core()
    core.set_property("GPU", {"CONFIG_FILE": str(plugin_layers.write_config(Path(folder), attributes))})
    model = plugin_layers.decode_step_model(attributes, Q_HEADS, KV_HEADS)
    request = core.compile_model(model, "GPU", {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()
    remote = core.get_default_context("GPU").create_tensor(ov.Type.u8, ov.Shape([pool.size]), {})
    remote.copy_from(ov.Tensor(pool))
    request.set_tensor("pool", remote)
    results = []
    for feeds in steps:
        for name, array in feeds.items():
            request.set_tensor(name, ov.Tensor(np.ascontiguousarray(array)))
        request.infer()
        results.append((request.get_output_tensor(0).data.copy(), request.get_output_tensor(1).data.copy()))
    return results


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
    from ov_kvcrush.gpu import emulation

    with emulation.worker() as worker:
        yield worker


@pytest.mark.parametrize(("precision", "sub_group"), CONFIGS, ids=[f"{p}-sg{s}" for p, s in CONFIGS])
def test_the_plugin_runs_our_decode_step_over_a_pool_it_holds(plugin_worker, tmp_path, precision, sub_group):
    rng = np.random.default_rng(7)
    shape = PoolShape(precision, BLOCK, HEAD_DIM, Q_HEADS // KV_HEADS)
    keys = [rng.standard_normal((n, HEAD_DIM)).astype(np.float32) for n in TOKENS]
    values = [rng.standard_normal((n, HEAD_DIM)).astype(np.float32) for n in TOKENS]
    heads = page_heads(shape, keys, values, rng)
    steps, expected = [], []
    for _ in range(2):
        q = rng.standard_normal((Q_HEADS, HEAD_DIM)).astype(np.float32)
        k = rng.standard_normal((KV_HEADS, 1, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((KV_HEADS, 1, HEAD_DIM)).astype(np.float32)
        first = np.array([len(x) for x in keys], np.int32)
        keys = [np.concatenate([keys[i], k[i]]) for i in range(KV_HEADS)]
        values = [np.concatenate([values[i], v[i]]) for i in range(KV_HEADS)]
        width = np.array([heads.tables.shape[1]], np.int32)
        step = {"q": q, "k": k, "v": v, "tables": heads.tables, "first": first, "lengths": first + 1}
        steps.append({**step, "step": width})
        expected.append(_reference(shape, q, keys, values))
    got = plugin_worker.submit(_steps_on_the_plugin, str(tmp_path), precision, sub_group, heads.pool, steps).result(600)
    for (out, probs), (ref_out, ref_probs) in zip(got, expected, strict=True):
        np.testing.assert_allclose(out, ref_out, atol=1e-5)
        for h, p in enumerate(ref_probs):
            np.testing.assert_allclose(probs[h, : len(p)], p, atol=1e-6)
