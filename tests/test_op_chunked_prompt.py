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
from ov_kvcrush.op.snapshot import read_snapshot, write_snapshot

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


def make_pool(cfg) -> kvcache.KVPool:
    block_size = getattr(cfg, "block_size", None) or 32
    return kvcache.KVPool(1, HQ, HKV, D, block_size=block_size, method=method_spec(cfg, 1, HQ, block_size))


def run(core, cfg, chunks: list[int], compute: str = "f32", held_from: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """Attention outputs of every prompt and decode token, and the positions each head holds at the end
    (a method with a scoring pass runs it between the prompt and the decode steps).

    ``held_from``: the first chunk is the start of a shorter prompt of that many tokens (an
    earlier turn's), copied (a held prompt, serving/kept.py) into a new sequence that goes on
    as this prompt."""
    lv = layer_vectors(0, kv_heads=HKV, q_heads=HQ, tokens=PROMPT + DECODE + SCORING, head_dim=D)
    pool = make_pool(cfg)
    seq = pool.new_sequence()
    if len(chunks) > 1:
        seq.set_prompt(held_from or PROMPT)
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
        if i == 1 and held_from:  # the earlier turn's copy goes on as this prompt
            snap = read_snapshot(seq)
            seq.free()
            seq = pool.new_sequence()
            write_snapshot(seq, snap)
            seq.set_prompt(PROMPT)
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


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_held_prompt_goes_on_as_a_longer_prompt_sent_cold(ov_core, case):
    """A conversation's next turn from a held prompt (serving/kept.py): the start of turn one's
    prompt, copied before the method's selection, continued as turn two's longer prompt, computes
    exactly what turn two's prompt sent cold in chunks cut at the same place does: the same
    outputs, the same tokens kept. The cut is the pool's: past it, a scoring window's rows would
    count for turn one's prompt and not for turn two's (a cut one token later fails SnapKV's)."""
    cfg = make(case)
    first = 200  # turn one's prompt
    cut = make_pool(cfg).held_prompt_tokens(first)
    assert 0 < cut < first
    cold_out, cold_held = run(ov_core, cfg, [cut, PROMPT - cut])
    held_out, held_held = run(ov_core, cfg, [cut, PROMPT - cut], held_from=first)
    for g, (w, c) in enumerate(zip(cold_held, held_held, strict=True)):
        np.testing.assert_array_equal(c, w, err_msg=f"{case}: KV head {g} holds other tokens")
    np.testing.assert_array_equal(held_out, cold_out)
    if case == "snapkv-window-across-chunks":  # its 64 window rows are turn one's last
        assert cut == first - 64
        _, late_held = run(ov_core, cfg, [cut + 1, PROMPT - cut - 1], held_from=first)
        assert any(not np.array_equal(a, b) for a, b in zip(late_held, cold_held, strict=True))


def test_a_held_prompt_is_what_a_prompt_holds_before_its_selection(ov_core):
    """set_prompt continues a sequence only while it holds every token it has seen; a prompt
    shorter than SnapKV's window has no start to hold (every row of it is a window row)."""
    cfg = make("snapkv-window-across-chunks")
    pool = make_pool(cfg)
    assert pool.held_prompt_tokens(60) == 0 and pool.held_prompt_tokens(0) == 0
    seq = pool.new_sequence()
    req = op_model(ov_core, HQ, HKV, D)
    x = np.random.default_rng(0).standard_normal((1, HQ, 160, D)).astype(np.float32)
    kv = x[:, :HKV]
    infer(req, {"q": x, "k": kv, "v": kv, "kvc_sequence": np.array([seq.handle])})  # a prompt: selected to 128
    with pytest.raises(PluginError, match="this one's method has selected"):
        seq.set_prompt(200)
    pool.close()


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
    with pytest.raises(PluginError, match="allowed > the 4 tokens"):
        seq.set_prompt(4)
    seq.set_prompt(8)  # the full cache holds every token: it may go on as a longer prompt
    with pytest.raises(Exception, match="tokens"):
        seq.set_prompt(-1)
    pool.close()
