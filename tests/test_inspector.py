"""The inspector against oracles: what it reports kept, quantized and merged is what the method's
layer caches hold; errors are zero exactly where nothing was rewritten; the needle span is the
tokens of its text."""

from __future__ import annotations

import json

import pytest

from ov_kvcrush.cli.main import main
from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.errors import UserError
from ov_kvcrush.eval.inspector import EVICTED, KEPT, QUANTIZED, inspect_prompt

PROMPT = (
    "The archive holds letters from many years. " * 12
    + "The special magic number for blue-harbor is 4719263. "
    + "Readers came and went, and the letters stayed in their boxes. " * 10
    + "What is the special magic number for blue-harbor?"
)
NEEDLE = "4719263"


@pytest.fixture(scope="module")
def snapkv(hf_dir):
    return inspect_prompt(hf_dir, CompressionConfig("snapkv", 128), PROMPT, needle=NEEDLE)


def test_selection_alone_keeps_exact_tokens_within_the_budget(snapkv, hf_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(hf_dir)(PROMPT).input_ids
    assert snapkv.tokens == len(ids) > 128
    layers = {h.layer for h in snapkv.heads}
    assert len(snapkv.heads) == len(layers) * 3  # SmolLM2: 3 KV heads per layer
    for h in snapkv.heads:
        assert len(h.kept) == 128 and not h.quantized and not h.merged
        assert h.key_rel_err == 0.0 and h.value_rel_err == 0.0  # selection copies, never rewrites
        assert 0.0 <= h.tv_last_query <= 1.0
        assert h.kept[-64:] == list(range(snapkv.tokens - 64, snapkv.tokens))  # the recent window
    assert any(h.tv_last_query > 0 for h in snapkv.heads)  # something was evicted, and it mattered


def test_needle_span_is_the_tokens_of_its_text(snapkv, hf_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    start, end = snapkv.needle
    ids = tok(PROMPT).input_ids
    assert NEEDLE in tok.decode(ids[start:end]) and NEEDLE not in tok.decode(ids[start + 1 : end])
    shares = snapkv.needle_kept()
    assert shares is not None
    slot_shares = [shares[k] for k in ("evicted", "kept", "quantized", "merged")]
    assert sum(slot_shares) == pytest.approx(1.0) and shares["whole_heads"] + shares["partial_heads"] <= 1.0
    row_codes = {c for h in snapkv.heads for c in h.codes(snapkv.tokens)[start:end]}
    assert row_codes <= {EVICTED, KEPT}


def test_the_quantized_store_is_reported_with_its_error(hf_dir):
    comp = CompressionConfig("snapkv", 160, options={"quant": {"bits": 2, "residual_tokens": 32, "prompt_tail": 16}})
    rep = inspect_prompt(hf_dir, comp, PROMPT)
    for h in rep.heads:
        assert len(h.quantized) + len(h.kept) == 160
        assert len(h.quantized) % 32 == 0 and len(h.quantized) > 0
        assert h.kept[-16:] == list(range(rep.tokens - 16, rep.tokens))  # the pinned prompt tail
        assert h.key_rel_err > 0 and h.value_rel_err > 0
    codes = rep.heads[0].codes(rep.tokens)
    assert {codes[p] for p in rep.heads[0].quantized} == {QUANTIZED}


def test_chelsea_merges_are_reported(hf_dir):
    rep = inspect_prompt(hf_dir, CompressionConfig("chelsea", 128), PROMPT)
    assert any(h.merged for h in rep.heads)
    for h in rep.heads:
        if h.merged:
            assert all(d > 1 for d in h.merged.values()) and h.value_rel_err > 0


def test_cli_writes_json_and_a_heatmap(hf_dir, tmp_path, capsys):
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT, encoding="utf-8")
    out, png = tmp_path / "i.json", tmp_path / "i.png"
    argv = ["inspect", "--method", "snapkv", "--budget", "128", "--option", "block_size=32"]
    argv += ["--prompt-file", str(prompt), "--needle", NEEDLE, "--model", str(hf_dir)]
    assert main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert doc["method"] == "snapkv" and doc["options"] == {"block_size": 32}
    assert png.stat().st_size > 10_000 and "needle slots" in capsys.readouterr().out
    for layer in doc["layers"]:
        for h in layer["heads"]:  # whole 32-token spans (and the partial tail)
            kept = {p for start, end in h["kept"] for p in range(start, end)}
            full = doc["tokens"] // 32 * 32
            assert all(all(q in kept for q in range(p // 32 * 32, p // 32 * 32 + 32)) for p in kept if p < full)


def test_bad_input_is_named(hf_dir):
    with pytest.raises(UserError, match="needle"):
        inspect_prompt(hf_dir, CompressionConfig("snapkv", 128), PROMPT, needle="not in the prompt")
    with pytest.raises(UserError, match="method=full"):
        inspect_prompt(hf_dir, CompressionConfig(), PROMPT)
