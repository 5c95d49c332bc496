"""A prompt prefilled in chunks (continuous batching's chunked prefill) against the same prompt in one step.

The op's method hooks wait for the last chunk and then see the whole prompt, so every method must
keep the same tokens and give the same attention output as with the prompt in one step (the
one-step run is the oracle: it is what the method tests compare with the torch references).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import HKV, HQ, D, infer, op_model

from ov_kvcrush.methods import method_config, methods_for
from ov_kvcrush.methods.vectors import layer_vectors
from ov_kvcrush.op import kvcache, plugin
from ov_kvcrush.op.method_spec import method_spec
from ov_kvcrush.op.plugin import PluginError

PROMPT, DECODE = 300, 24
#: a method with a scoring pass (KVzip) selects after one step of this many tokens scores the prompt
SCORING = 40
#: chunk sizes of the prompt: uneven, the last one shorter than SnapKV's 64-token window below
CHUNKS = [100, 7, 150, 43]

CASES = {name: dict(budget=128) for name in methods_for("openvino") if name != "full"}
CASES["full"] = {}
CASES["snapkv-window-across-chunks"] = dict(method="snapkv", budget=128, window=64)
CASES["kvcrush-blocks"] = dict(method="kvcrush", budget=128, sink_tokens=16, recent_tokens=32, block_size=16)
CASES["snapkv-quant"] = dict(method="snapkv", budget=128, quant=True)


def run(core, cfg, chunks: list[int], compute: str = "f32") -> tuple[np.ndarray, list[np.ndarray]]:
    """Attention outputs of every prompt and decode token, and the positions each head holds at the end
    (a method with a scoring pass runs it between the prompt and the decode steps)."""
    lv = layer_vectors(0, kv_heads=HKV, q_heads=HQ, tokens=PROMPT + DECODE + SCORING, head_dim=D)
    block_size = getattr(cfg, "block_size", None) or 32
    pool = kvcache.KVPool(1, HQ, HKV, D, block_size=block_size, method=method_spec(cfg, 1, HQ, block_size))
    seq = pool.new_sequence()
    if len(chunks) > 1:
        seq.set_prompt(PROMPT)
    req = op_model(core, HQ, HKV, D, compute=compute)
    outs, a = [], 0

    def step(lo: int, n: int) -> np.ndarray:
        q, k, v = (x[:, :, lo : lo + n].numpy() for x in (lv.queries, lv.keys, lv.values))
        return np.array(req.infer({"q": q, "k": k, "v": v, "kvc_sequence": np.array([seq.handle])})[0])

    for i, n in enumerate([*chunks, *[1] * DECODE]):
        if i == len(chunks) and cfg.scoring_pass:
            seq.score_positions(0, PROMPT)
            step(PROMPT + DECODE, SCORING)
            seq.end_scoring_pass()
        outs.append(step(a, n))
        a += n
    held = [seq.read_head(0, g)[0] for g in range(HKV)]
    pool.close()
    return np.concatenate([o.reshape(HQ, -1, D) for o in outs], axis=1), held


def make(case: str):
    fields = dict(CASES[case])
    return method_config(fields.pop("method", case), **fields)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_chunked_prompt_keeps_what_the_whole_prompt_keeps(ov_core, case):
    cfg = make(case)
    whole_out, whole_held = run(ov_core, cfg, [PROMPT])
    chunk_out, chunk_held = run(ov_core, cfg, CHUNKS)
    _check_same(case, whole_out, whole_held, chunk_out, chunk_held)


@pytest.mark.skipif("bf16" not in plugin.kernel_isa(), reason="no AVX512-BF16 on this machine")
@pytest.mark.parametrize("case", ["full", "h2o", "snapkv-window-across-chunks"])
def test_a_chunked_bf16_prompt_matches_the_whole_prompt(ov_core, bf16_products, case):
    """compute=bf16 (AMX tiles where the CPU has them): a prompt in chunks gives the whole prompt's result."""
    cfg = make(case)
    whole_out, whole_held = run(ov_core, cfg, [PROMPT], "bf16")
    chunk_out, chunk_held = run(ov_core, cfg, CHUNKS, "bf16")
    _check_same(case, whole_out, whole_held, chunk_out, chunk_held)


def _check_same(case, whole_out, whole_held, chunk_out, chunk_held) -> None:
    for g, (w, c) in enumerate(zip(whole_held, chunk_held, strict=True)):
        np.testing.assert_array_equal(c, w, err_msg=f"{case}: KV head {g} holds other tokens")
    if case not in ("full", "clusterkv"):  # ClusterKV keeps every token and recalls (the outputs compare it)
        assert len(whole_held[0]) < PROMPT + DECODE  # the method did evict: the comparison means something
    np.testing.assert_allclose(chunk_out, whole_out, rtol=1e-5, atol=1e-6)


def test_a_step_past_the_chunked_prompt_is_refused(ov_core):
    pool = kvcache.KVPool(1, HQ, HKV, D)
    seq = pool.new_sequence()
    seq.set_prompt(8)
    req = op_model(ov_core, HQ, HKV, D)
    x = np.zeros((1, HQ, 12, D), np.float32)
    kv = np.zeros((1, HKV, 12, D), np.float32)
    with pytest.raises(RuntimeError, match="runs past the chunked prompt's 8 tokens"):
        infer(req, {"q": x, "k": kv, "v": kv, "kvc_sequence": np.array([seq.handle])})
    seq.reset()
    infer(req, {"q": x[:, :, :4], "k": kv[:, :, :4], "v": kv[:, :, :4], "kvc_sequence": np.array([seq.handle])})
    with pytest.raises(PluginError, match="must start an empty sequence"):
        seq.set_prompt(8)
    with pytest.raises(Exception, match="tokens"):
        seq.set_prompt(-1)
    pool.close()
