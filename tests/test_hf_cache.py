"""The transformers integration on tiny random models of each supported family (fast, no download).

Oracle: the same weights run by transformers' own attention (``sdpa``) and ``DynamicCache``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.engines.hf_cache import ATTN_IMPLEMENTATION, CompressedCache, storage_bytes
from ov_kvcrush.errors import UserError
from ov_kvcrush.methods import REGISTRY, QuantSettings
from ov_kvcrush.methods.full import SlidingWindowLayerCache

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)


def _tiny(family: str):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    if family == "llama":
        cfg = LlamaConfig(**COMMON)
    elif family == "qwen2":
        cfg = Qwen2Config(**COMMON)
    elif family == "mistral":
        cfg = MistralConfig(**COMMON, sliding_window=None)
    else:  # gemma3: local layers with a 24-token window, every 2nd layer global; its own scaling
        cfg = Gemma3TextConfig(
            **COMMON,
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention"] * 2,
            query_pre_attn_scalar=24,
        )
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=ATTN_IMPLEMENTATION).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _greedy(model, ids: torch.Tensor, n: int, cache=None) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, past_key_values=cache, pad_token_id=0
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
def test_full_method_equals_transformers(family):
    """``full`` through the compressed cache = transformers' own attention, token for token and in
    logits; Gemma 3's sliding layers (window 24 < 60 tokens) and its scaling included."""
    ref, ours = _tiny(family)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = CompressedCache(CompressionConfig().method_config(), ours.config)
    assert _greedy(ours, ids, 20, cache) == _greedy(ref, ids, 20)
    with torch.inference_mode():
        a = ref(ids).logits
        b = ours(ids, past_key_values=CompressedCache(CompressionConfig().method_config(), ours.config)).logits
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_gemma3_sliding_layers_hold_only_their_window():
    _, ours = _tiny("gemma3")
    method = CompressionConfig(method="h2o", budget=100).method_config()
    cache = CompressedCache(method, ours.config)
    kinds = [type(lc).__name__ for lc in cache.method_layers()]
    assert kinds == ["SlidingWindowLayerCache", "ImportanceLayerCache"] * 2
    assert cache.is_sliding == [True, False, True, False]
    ids = torch.randint(3, 128, (1, 50))
    with torch.inference_mode():
        ours(ids, past_key_values=cache)
    for lc in cache.method_layers():
        if isinstance(lc, SlidingWindowLayerCache):
            assert len(lc.store) == 24 and lc.store.positions[0, 0, 0].item() == 50 - 24
        else:
            assert len(lc.store) == 50  # under budget: everything kept


@pytest.mark.parametrize("method", [m for m in REGISTRY if m != "full"])
def test_every_method_with_a_large_budget_equals_full(method):
    """No method changes anything when the budget holds the whole sequence (MiniKV's 2-bit store
    keeps everything in its full-precision residual here, so it is lossless too)."""
    ref, ours = _tiny("llama")
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(2))
    opts = {"quant": QuantSettings(residual_tokens=128)} if method == "minikv" else {}
    cfg = CompressionConfig(method=method, budget=1000, options=opts)
    cache = CompressedCache(cfg.method_config().model_free(), ours.config)  # no calibration on a random model
    assert _greedy(ours, ids, 24, cache) == _greedy(ref, ids, 24)
    assert not cache.counters().get("evicted") and not cache.counters().get("merges")


def test_eviction_really_shrinks_what_is_held():
    """At a small budget the tensors held (measured from their storage) are what the methods
    report, and are a fraction of a full cache: nothing full-size is kept behind a mask."""
    _, ours = _tiny("llama")
    ids = torch.randint(3, 128, (1, 300))
    full = CompressedCache(CompressionConfig().method_config(), ours.config)
    small = CompressedCache(CompressionConfig(method="snapkv", budget=100).method_config(), ours.config)
    with torch.inference_mode():
        ours(ids, past_key_values=full)
        ours(ids, past_key_values=small)
    assert storage_bytes(list(full.method_layers())) == full.memory()["total"]
    assert storage_bytes(list(small.method_layers())) == small.memory()["total"]
    assert small.memory()["kv"] * 3 == full.memory()["kv"]
    assert small.get_seq_length() == 300  # positions keep counting seen tokens


def test_policy_time_is_the_method_calls_less_their_attention(monkeypatch):
    """The cache reports the method's own work per phase (what ``ov-kvcrush bench`` shows for the
    torch engine). On a clock that only the attention (3 ms) and H2O's selection (2 ms) advance,
    the split is exact: prefill = one selection per layer, decode = the decode steps' selections,
    and no attention time is counted as the method's."""
    import time as time_module

    from ov_kvcrush.methods.base import LayerCache
    from ov_kvcrush.methods.importance import ImportanceLayerCache

    clock = [0.0]
    selects = {"prefill": 0, "decode": 0}
    attend, select = LayerCache._attend_untimed, ImportanceLayerCache.select

    def slow_attend(self, *a, **kw):
        clock[0] += 0.003
        return attend(self, *a, **kw)

    def slow_select(self, *a, **kw):
        clock[0] += 0.002
        selects["decode" if len(self.store) else "prefill"] += 1
        return select(self, *a, **kw)

    monkeypatch.setattr(time_module, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(LayerCache, "_attend_untimed", slow_attend)
    monkeypatch.setattr(ImportanceLayerCache, "select", slow_select)
    _, ours = _tiny("llama")
    ids = torch.randint(3, 128, (1, 200))
    cache = CompressedCache(CompressionConfig(method="h2o", budget=120).method_config(), ours.config)
    _greedy(ours, ids, 6, cache)
    layers = ours.config.num_hidden_layers
    assert selects["prefill"] == layers
    spent = cache.policy_ms()
    assert spent["policy_prefill_ms"] == pytest.approx(2.0 * layers)
    assert spent["policy_decode_ms"] == pytest.approx(2.0 * selects["decode"])
    assert sum(lc.attend_ms for lc in cache.method_layers()) == pytest.approx(3.0 * layers * 6)


def test_storage_bytes_counts_a_pinned_full_tensor():
    big = torch.zeros(1000)
    assert storage_bytes({"slice": big[:10]}) == 4000
    assert storage_bytes([big[:10].clone(), big[:10].clone()]) == 80
    assert storage_bytes((big, big[5:])) == 4000  # one storage counted once


def test_model_without_our_attention_is_refused():
    ref, _ = _tiny("llama")
    cache = CompressedCache(CompressionConfig().method_config(), ref.config)
    with pytest.raises(RuntimeError, match="attn_implementation"), torch.inference_mode():
        ref(torch.randint(3, 128, (1, 5)), past_key_values=cache)
        ref(torch.randint(3, 128, (1, 1)), past_key_values=cache)


def test_beam_search_is_refused_with_a_clear_error():
    _, ours = _tiny("llama")
    cache = CompressedCache(CompressionConfig().method_config(), ours.config)
    with pytest.raises(UserError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))


@pytest.mark.parametrize("steps", [[1, 1, 1], [5, 1, 7], [12]])
def test_sliding_window_layer_equals_windowed_attention_over_everything(steps):
    """Multi-token steps included: each query sees exactly the keys of the last ``window`` positions."""
    from ov_kvcrush.methods.attention import attend
    from ov_kvcrush.methods.vectors import layer_vectors

    vec = layer_vectors(5, tokens=60)
    lc = SlidingWindowLayerCache(8)
    start = 20
    lc.prefill(*(x.clone() for x in vec.prefix(start)))
    for t in steps:
        q, k, v = (x[:, :, start : start + t].clone() for x in (vec.queries, vec.keys, vec.values))
        got = lc.decode(q, k, v)
        pos = torch.arange(start + t)
        want = attend(q, vec.keys[:, :, : start + t], vec.values[:, :, : start + t],
                      q_positions=pos[start:], k_positions=pos, window=8).output  # fmt: skip
        torch.testing.assert_close(got, want)
        start += t
        assert len(lc.store) == 8 and storage_bytes(lc) == lc.memory()["total"]
