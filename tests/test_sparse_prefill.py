"""The op's sparse prompt attention (XAttention's antidiagonal block estimate, issue 72 item 3).

The reference (:mod:`ov_kvcrush.methods.sparse_prefill`) is held to brute force (the antidiagonal
sums, the selection's threshold); the op to the reference: the same kept blocks, the same
output, in f32 and bf16; every later step, and the rows a method scores by, as dense. The engine
takes it from an ``openvino_genai.SchedulerConfig``, as native does.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import infer, op_model

from ov_kvcrush.config import GenerationSettings, SparsePrefill
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.methods import method_config
from ov_kvcrush.methods import sparse_prefill as ref
from ov_kvcrush.methods.vectors import layer_vectors
from ov_kvcrush.op import kvcache
from ov_kvcrush.op.method_spec import method_spec

HQ, HKV, D, T = 6, 2, 64, 512
SPARSE = SparsePrefill(block_size=32, stride=4, threshold=0.8, last_dense_tokens=32, dense_layers=0)


def test_a_strided_product_is_the_sum_of_its_sub_blocks_antidiagonal():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 13, 8, generator=g), torch.randn(2, 13, 8, generator=g)
    s = 4
    got = ref.strided_queries(q, s) @ ref.strided_keys(k, s).transpose(1, 2)
    full = q @ k.transpose(1, 2)
    for a in range(got.shape[1]):
        for b in range(got.shape[2]):
            # the antidiagonal of sub-block (a, b): query a*s + s-1-i with key b*s + i
            pairs = [(a * s + s - 1 - i, b * s + i) for i in range(s)]
            want = sum((full[:, r, c] for r, c in pairs if r < 13 and c < 13), torch.zeros(2))
            torch.testing.assert_close(got[:, a, b], want, atol=1e-5, rtol=1e-5)


def test_the_selection_keeps_the_first_and_diagonal_blocks_then_the_heaviest_until_the_threshold():
    mass = torch.rand(3, 12, 12, generator=torch.Generator().manual_seed(1))
    for threshold in (0.3, 0.8, 1.0):
        keep = ref.select_blocks(mass, threshold)
        for h in range(3):
            for i in range(12):
                row, k = mass[h, i, : i + 1].double(), keep[h, i, : i + 1]
                assert k[0] and k[i] and not keep[h, i, i + 1 :].any()
                assert row[k].sum() >= threshold * row.sum() - 1e-9  # enough mass
                chosen = [j for j in range(1, i) if k[j]]
                if chosen:  # and no more than needed: without the lightest chosen block it falls short
                    lightest = min(chosen, key=lambda j: row[j])
                    assert row[k].sum() - row[lightest] < threshold * row.sum()
                    others = [j for j in range(1, i) if not k[j]]
                    assert all(row[j] <= row[lightest] for j in others)  # the heaviest were chosen


def _step(req, seq, q, k, v) -> np.ndarray:
    """One step of the op: its output ``[Hq, L, D]``."""
    return infer(req, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kvc_sequence": np.array([seq.handle])})[0][0]


def _prompt(core, compute: str, sparse: SparsePrefill | None, method=None, seed: int = 1, tokens: int = T):
    """The first T tokens of a layer's vectors as one whole prompt through the op:
    (output ``[Hq, T, D]``, its sequence, the request, the vectors)."""
    v = layer_vectors(seed, kv_heads=HKV, q_heads=HQ, tokens=tokens, head_dim=D)
    req = op_model(core, HQ, HKV, D, compute=compute)
    spec = None if method is None else method_spec(method, 1, HQ, 16)
    pool = kvcache.KVPool(1, HQ, HKV, D, block_size=16, precision="f32", method=spec, sparse_prefill=sparse)
    seq = pool.new_sequence()
    out = _step(req, seq, v.queries[:, :, :T], v.keys[:, :, :T], v.values[:, :, :T])
    return out, seq, req, v


@pytest.mark.parametrize("compute", ["f32", "bf16"])
def test_the_op_attends_the_references_blocks(ov_core, compute):
    """The op keeps exactly the reference's blocks (a third of them skipped here; on the bf16 path
    estimated from bf16 products, as the reference's ``bf16``) and its output is the reference's
    sparse attention, not the dense one."""
    out, seq, _, v = _prompt(ov_core, compute, SPARSE)
    q, k, vals = v.queries[0], v.keys[0], v.values[0]
    keep = ref.prefill_block_mask(
        q, k, block_size=32, stride=4, threshold=0.8, last_dense_tokens=32, scale=1 / math.sqrt(D),
        first_scored_row=T, bf16=compute == "bf16",
    )  # fmt: skip
    st = seq.stats()
    assert st.prefill_blocks_attended == int(keep.sum()) and st.prefill_blocks_dense == HQ * 16 * 17 // 2
    assert 0.5 < st.prefill_density < 0.8 and st.sparse_estimate_ns > 0
    want = ref.attend_blocks(q, k, vals, keep, 32).numpy()
    dense = ref.attend_blocks(q, k, vals, torch.ones_like(keep), 32).numpy()
    atol = 2e-5 if compute == "f32" else 0.06  # bf16 products, as the dense bf16 path's
    np.testing.assert_allclose(out, want, atol=atol, rtol=0)
    assert np.abs(out - dense).max() > 10 * atol  # the skipped blocks mattered
    np.testing.assert_allclose(out[:, T - 32 :], dense[:, T - 32 :], atol=atol, rtol=0)  # the last rows: dense


def test_a_prompt_in_chunks_is_estimated_over_every_key_before_each_chunks_end(ov_core):
    """A chunked prompt (the loop's steps): each chunk's blocks are the reference's over the keys
    of every earlier position, its output the reference's sparse attention."""
    v = layer_vectors(3, kv_heads=HKV, q_heads=HQ, tokens=T, head_dim=D)
    req = op_model(ov_core, HQ, HKV, D)
    pool = kvcache.KVPool(1, HQ, HKV, D, block_size=16, precision="f32", sparse_prefill=SPARSE)
    seq = pool.new_sequence()
    seq.set_prompt(T)
    kept = 0
    for a, b in ((0, 200), (200, T)):  # the second chunk starts inside a block
        q, k, vals = v.queries[0, :, a:b], v.keys[0, :, :b], v.values[0, :, :b]
        out = _step(req, seq, v.queries[:, :, a:b], v.keys[:, :, a:b], v.values[:, :, a:b])
        keep = ref.prefill_block_mask(
            q, k, block_size=32, stride=4, threshold=0.8, last_dense_tokens=32, scale=1 / math.sqrt(D),
            first_scored_row=b - a, past=a, prompt_tokens=T,
        )  # fmt: skip
        kept += int(sum(keep[:, i, : i + 1].sum() for i in range(a // 32, -(-b // 32))))
        want = ref.attend_blocks(q, k, vals, keep, 32, past=a).numpy()
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=0, err_msg=f"chunk {a}..{b}")
    assert seq.stats().prefill_blocks_attended == kept < seq.stats().prefill_blocks_dense


def test_the_first_layers_attend_densely(ov_core):
    """``dense_layers``: the first global layers' prompts are dense, the next one's sparse."""
    v = layer_vectors(1, kv_heads=HKV, q_heads=HQ, tokens=T, head_dim=D)
    pool = kvcache.KVPool(2, HQ, HKV, D, block_size=16, precision="f32", sparse_prefill=replace(SPARSE, dense_layers=1))
    seq = pool.new_sequence()
    dense, *_ = _prompt(ov_core, "f32", None)
    outs = [_step(op_model(ov_core, HQ, HKV, D, layer=layer), seq, v.queries, v.keys, v.values) for layer in (0, 1)]
    np.testing.assert_allclose(outs[0], dense, atol=1e-6, rtol=0)
    assert np.abs(outs[1] - dense).max() > 0.1 and seq.stats().prefill_blocks_dense == HQ * 16 * 17 // 2


def test_threshold_one_attends_every_block_as_dense(ov_core):
    out, seq, *_ = _prompt(
        ov_core, "f32", SparsePrefill(block_size=32, stride=4, threshold=1.0, last_dense_tokens=0, dense_layers=0)
    )
    dense, *_ = _prompt(ov_core, "f32", None)
    assert seq.stats().prefill_density == 1.0
    np.testing.assert_allclose(out, dense, atol=1e-6, rtol=0)


def test_later_steps_and_the_scored_rows_are_dense(ov_core):
    """A decode step after a sparse prompt reads the same cache as after a dense one; SnapKV's
    window attends densely, so its scores, and the tokens it keeps, are the dense prompt's."""
    snap = method_config("snapkv", budget=160, sink_tokens=4, recent_tokens=16, window=32)
    low = SparsePrefill(block_size=32, stride=4, threshold=0.5, last_dense_tokens=0, dense_layers=0)
    runs = {}
    for name, sparse in (("dense", None), ("sparse", low)):
        _, seq, req, v = _prompt(ov_core, "f32", sparse, method=snap, seed=2, tokens=T + 1)
        out = _step(req, seq, v.queries[:, :, T:], v.keys[:, :, T:], v.values[:, :, T:])
        runs[name] = ([seq.read_head(0, g)[0] for g in range(HKV)], out, seq.stats())
    assert runs["sparse"][2].prefill_density < 0.9  # the prompt was sparse, but not the window's rows
    for g in range(HKV):
        np.testing.assert_array_equal(runs["sparse"][0][g], runs["dense"][0][g])
    np.testing.assert_allclose(runs["sparse"][1], runs["dense"][1], atol=1e-6, rtol=0)


def test_bad_settings_are_refused_by_their_native_names():
    for kwargs, field in (
        (dict(block_size=40), "xattention_block_size"),
        (dict(block_size=64, stride=5), "xattention_stride"),
        (dict(threshold=0.0), "xattention_threshold"),
        (dict(threshold=1.5), "xattention_threshold"),
        (dict(last_dense_tokens=-1), "num_last_dense_tokens_in_prefill"),
        (dict(dense_layers=-1), "dense_layers"),
    ):
        with pytest.raises(ConfigError, match=rf"^{field}="):
            SparsePrefill(**kwargs)


def test_the_engine_takes_it_from_a_scheduler_config_and_keeps_the_passkey(model_dir, full_engine):
    """``SchedulerConfig.use_sparse_attention`` in mode XATTENTION, as a user sets it for native,
    turns our op's sparse prefill on with its settings; on a 1.5k-token passkey it answers as the
    dense prompt does while skipping blocks; decode is untouched."""
    import openvino_genai as ov_genai

    from ov_kvcrush.eval.tasks import passkey_prompt
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    sc = ov_genai.SchedulerConfig()
    sc.use_sparse_attention = True
    sc.sparse_attention_config = ov_genai.SparseAttentionConfig(
        mode=ov_genai.SparseAttentionMode.XATTENTION, xattention_threshold=0.9, xattention_block_size=128
    )
    engine = OpenVINOEngine(model_dir, scheduler_config=sc)
    assert engine.sparse_prefill == SparsePrefill(
        block_size=128, stride=8, threshold=0.9, last_dense_tokens=100, dense_layers=4
    )
    passkey = passkey_prompt(1500, lambda t: len(engine.encode(t)), seed=11, depth=0.4)
    settings = GenerationSettings(max_new_tokens=24)
    sparse = engine.generate(passkey.prompt, settings)
    dense = full_engine.generate(passkey.prompt, settings)
    assert passkey.answer in sparse.text and passkey.answer in dense.text
    assert 0.0 < sparse.counters["prefill_density"] < 1.0 and "prefill_density" not in dense.counters
    engine.close()
    with pytest.raises(UserError, match=r"sparse_prefill or scheduler_config\.use_sparse_attention, not both"):
        OpenVINOEngine(model_dir, scheduler_config=sc, sparse_prefill="xattention")
    with pytest.raises(ConfigError, match=r"sparse_prefill='trishape' is invalid: allowed one of xattention"):
        OpenVINOEngine(model_dir, sparse_prefill="trishape")


def test_generate_and_serve_take_it_as_a_flag(model_dir, tmp_path, capsys):
    """``generate --sparse-prefill xattention`` runs our sparse prompt (its density in the JSON's
    counters); ``serve --sparse-prefill`` gives it to the server's engine; torch refuses the flag."""
    import json

    from helpers import run_main

    from ov_kvcrush.cli.main import build_parser
    from ov_kvcrush.server.config import ServerConfig
    from ov_kvcrush.server.factory import make_pipeline

    prompt, out = tmp_path / "p.txt", tmp_path / "r.json"
    prompt.write_text("Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "fig"] * 60) + ". Name one.")
    code, _, err = run_main(
        capsys, "generate", "--backend", "openvino", "--sparse-prefill", "xattention", "--prompt-file", str(prompt),
        "--max-new-tokens", "4", "--model", str(model_dir), "--json", str(out),
    )  # fmt: skip
    assert code == 0, err
    assert 0.0 < json.loads(out.read_text())["counters"]["prefill_density"] <= 1.0
    code, _, err = run_main(capsys, "generate", "--backend", "torch", "--sparse-prefill", "xattention",
                            "--prompt-file", str(prompt))  # fmt: skip
    assert code == 2 and "--sparse-prefill is for --backend genai, openvino" in err
    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--sparse-prefill", "xattention"])
    config = ServerConfig.from_args(args)
    pipe = make_pipeline(config, config.compression())
    assert pipe.engine.sparse_prefill == SparsePrefill()
    pipe.engine.close()
