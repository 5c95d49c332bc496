"""MiniKV: 2-bit packing and quantization, the 2-bit store, frozen heavy hitters, compositions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods import REGISTRY, MiniKVConfig, QuantSettings, method_config
from ov_kvcrush.methods.quant import dequantize_groups, pack_codes, quantize_groups, theoretical_bytes, unpack_codes
from ov_kvcrush.methods.store import QuantStore
from ov_kvcrush.methods.vectors import layer_vectors


@settings(max_examples=50, deadline=None)
@given(
    words=st.integers(1, 8),
    rows=st.integers(1, 5),
    seed=st.integers(0, 10_000),
    dim=st.sampled_from([0, 1]),
    bits=st.sampled_from([2, 4]),
)
def test_pack_unpack_is_exact(words, rows, seed, dim, bits):
    per = 32 // bits
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, per * words), generator=gen, dtype=torch.uint8)
    codes = codes if dim == 1 else codes.T.contiguous()
    packed = pack_codes(codes, bits, dim=dim)
    assert packed.dtype == torch.int32 and packed.shape[dim] == words
    assert torch.equal(unpack_codes(packed, bits, dim=dim), codes)


def test_packing_layout_is_low_bits_first():
    codes = torch.zeros(16, dtype=torch.uint8)
    codes[0], codes[1], codes[15] = 1, 2, 3
    assert pack_codes(codes, 2).tolist() == [1 | (2 << 2) | -(1 << 30)]  # 3 << 30 as a signed int32
    codes = torch.zeros(8, dtype=torch.uint8)
    codes[0], codes[1], codes[7] = 1, 9, 15
    assert pack_codes(codes, 4).tolist() == [1 | (9 << 4) | -(1 << 28)]  # 15 << 28 as a signed int32


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 10_000), scale=st.floats(1e-3, 1e3), dim=st.sampled_from([2, 3]), bits=st.sampled_from([2, 4])
)
def test_quantization_error_within_half_a_step(seed, scale, dim, bits):
    x = torch.randn(1, 2, 32, 64, generator=torch.Generator().manual_seed(seed)) * scale
    x[0, 0, :16, :16] = 1.5  # a constant group
    codes, s, z = quantize_groups(x, 16, dim, bits)
    y = dequantize_groups(codes, s, z, 16, dim, torch.float32)
    step = s.float().repeat_interleave(16, dim=dim)
    fp16_slack = 2e-3 * x.abs().amax()
    assert ((x - y).abs() <= step / 2 + fp16_slack).all()
    assert int(codes.max()) <= (1 << bits) - 1


def test_four_bits_are_finer_than_two():
    x = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(3))
    err = {}
    for bits in (2, 4):
        codes, s, z = quantize_groups(x, 16, 3, bits)
        err[bits] = float((dequantize_groups(codes, s, z, 16, 3, torch.float32) - x).norm() / x.norm())
    assert err[4] < err[2] / 3  # 5x more levels: about 5x less error


@pytest.mark.parametrize("bits", [(2, 2), (4, 4), (2, 4)])
def test_store_bytes_match_theory_and_residual_flushes(bits):
    qs = QuantSettings(group_size=16, residual_tokens=32, key_bits=bits[0], value_bits=bits[1])
    store = QuantStore(qs)
    vec = layer_vectors(0, tokens=200)
    store.append(vec.keys[:, :, :100], vec.values[:, :, :100], torch.arange(100))
    assert store.quantized_tokens == 96 and store.residual_len == 4
    for i in range(100, 200):
        store.append(vec.keys[:, :, i : i + 1], vec.values[:, :, i : i + 1], torch.tensor([i]))
        assert store.residual_len < 32
    assert store.quantized_tokens + store.residual_len == 200
    per_tensor = 3 * store.quantized_tokens * 64  # keys, and as many values
    want = theoretical_bytes(per_tensor, 16, bits[0]) + theoretical_bytes(per_tensor, 16, bits[1])
    assert store.memory()["kv"] - store.residual_len * 3 * 64 * 2 * 4 == want
    k, _, p = store.dense()
    assert p[0, 0].tolist() == list(range(200))
    assert torch.equal(k[:, :, store.quantized_tokens :], vec.keys[:, :, store.quantized_tokens :])
    err = (k - vec.keys).abs().amax() / (vec.keys.amax() - vec.keys.amin())
    assert 0 < err < 0.5 / ((1 << bits[0]) - 1)  # at most half a step of a group's range


def test_pinned_prompt_tail_stays_exact_through_every_flush():
    qs = QuantSettings(group_size=16, residual_tokens=32)
    store = QuantStore(qs)
    vec = layer_vectors(0, tokens=260)
    store.append(vec.keys[:, :, :150], vec.values[:, :, :150], torch.arange(150), pin=40)
    # 110 unpinned prompt tokens: 96 quantized, 14 wait in the residual; the last 40 are pinned
    assert (store.quantized_tokens, store.pinned_len, store.residual_len) == (96, 40, 14)
    for i in range(150, 260):
        store.append(vec.keys[:, :, i : i + 1], vec.values[:, :, i : i + 1], torch.tensor([i]))
    k, v, p = store.dense()
    assert store.pinned_len == 40 and len(store) == 260
    order = p[0, 0]
    assert sorted(order.tolist()) == list(range(260))
    pinned = slice(store.quantized_tokens, store.quantized_tokens + 40)
    assert order[pinned].tolist() == list(range(110, 150))
    assert torch.equal(k[:, :, pinned], vec.keys[:, :, 110:150])
    assert torch.equal(v[:, :, pinned], vec.values[:, :, 110:150])
    # what was quantized is the unpinned tokens in order, and it is only that (within 2-bit error)
    q = store.quantized_tokens
    assert order[:q].tolist() == [t for t in range(260) if not 110 <= t < 150][:q]
    with pytest.raises(RuntimeError, match="pinned"):
        store.keep(torch.zeros(1, 3, 4, dtype=torch.long))


def test_prompt_tail_config_defaults_and_refusals():
    assert QuantSettings().pinned_tail() == 64 and QuantSettings(prompt_tail=0).pinned_tail() == 0
    with pytest.raises(ConfigError, match=r"quant\.prompt_tail"):
        QuantSettings(prompt_tail=-1)
    with pytest.raises(ConfigError, match=r"quant\.prompt_tail"):
        method_config("clusterkv", budget=256, quant=QuantSettings(prompt_tail=32))
    with pytest.raises(ConfigError, match=r"quant\.prompt_tail"):
        method_config("chelsea", budget=256, quant=QuantSettings(prompt_tail=32))
    method_config("clusterkv", budget=256, quant=QuantSettings())  # None: nothing pinned there


def test_minikv_keeps_the_prompt_tail_in_full_precision():
    vec = layer_vectors(1, tokens=300)
    for tail, exact in ((64, True), (0, False)):
        quant = QuantSettings(residual_tokens=32, prompt_tail=tail)
        cache = MiniKVConfig(budget=160, sink_tokens=8, recent_tokens=64, quant=quant).make_layer(3, 4)
        cache.prefill(*vec.prefix(300))
        k, _, p = cache.store.dense()
        last = ((p >= 300 - 64) & (p >= 0)).unsqueeze(-1).expand_as(k)  # the prompt's last 64 (all kept: recent)
        exact_keys = torch.gather(vec.keys[:, :, :300], 2, p.clamp_min(0).unsqueeze(-1).expand_as(k))
        assert torch.equal(k[last], exact_keys[last]) is exact


def test_minikv_freezes_prefill_heavy_hitters_and_keeps_generated_tokens():
    vec = layer_vectors(1, tokens=300)
    cfg = MiniKVConfig(budget=96, sink_tokens=8, recent_tokens=16, quant=QuantSettings(residual_tokens=32))
    budgets = [cfg.layer_budget(i, 4) for i in range(4)]
    assert sum(budgets) == 4 * 96 and budgets[0] > budgets[-1]
    cache = cfg.make_layer(3, 4)
    cache.prefill(*vec.prefix(250))
    chosen = cache.kept_positions()[..., : budgets[3]].sort(-1).values
    for i in range(250, 300):
        cache.decode(*vec.step(i))
    pos = cache.kept_positions().sort(-1).values  # the pinned prompt tail sits between the quantized and the residual
    assert torch.equal(pos[..., : budgets[3]], chosen)
    assert pos[0, 0, budgets[3] :].tolist() == list(range(250, 300))
    assert cache.store.quantized_tokens > 0


@pytest.mark.parametrize("name", ["h2o", "snapkv", "kvcrush", "clusterkv", "chelsea", "streamingllm"])
def test_any_selection_method_runs_over_the_2bit_store(name):
    vec = layer_vectors(2, tokens=340)
    kw = {"dense_layers": 0} if name == "clusterkv" else {}
    cfg_q = method_config(name, budget=128, quant=QuantSettings(prompt_tail=0), **kw)  # all of it in 2 bits
    cfg_f = method_config(name, budget=128, **kw)
    caches = []
    for cfg in (cfg_q, cfg_f):
        c = cfg.make_layer(0, 1)
        outs = [c.prefill(*vec.prefix(300))] + [c.decode(*vec.step(i)) for i in range(300, 340)]
        caches.append((c, outs))
    (cq, oq), (cf, of) = caches
    assert isinstance(cq.store, QuantStore) and cq.store.quantized_tokens > 0
    assert cq.memory()["kv"] < cf.memory()["kv"] * cq.tokens_held().sum() / cf.tokens_held().sum() / 2
    rel = (oq[-1] - of[-1]).norm() / of[-1].norm()
    assert rel < 0.6  # lossy, but the same attention


def test_quant_settings_validation():
    with pytest.raises(ConfigError, match=r"quant\.bits"):
        QuantSettings(bits=3)
    with pytest.raises(ConfigError, match=r"quant\.value_bits"):
        QuantSettings(value_bits=8)
    assert QuantSettings(bits=4).label == "4bit" and QuantSettings(key_bits=2, value_bits=4).label == "k2v4"
    with pytest.raises(ConfigError, match=r"quant\.residual_tokens"):
        QuantSettings(residual_tokens=40)
    with pytest.raises(ConfigError, match=r"quant\.group_size"):
        QuantSettings(group_size=12)
    assert "minikv" in REGISTRY and MiniKVConfig(budget=256).quant == QuantSettings(bits=4)


def test_minikv_defaults_are_the_product_and_preset_paper_the_papers():
    """The product selects by SnapKV's window over a 4-bit store (docs/quality.md: the paper's
    H2O sums over a 2-bit store answered no needle); ``preset=paper`` gives the paper's choices,
    fields given beside it win, and a bad preset is named."""
    from ov_kvcrush.config import CompressionConfig

    product = method_config("minikv", budget=256)
    assert (product.selection, product.quant.kbits, product.quant.vbits) == ("snapkv", 4, 4)
    paper = MiniKVConfig(
        budget=256, selection="h2o", pyramid_depth=7.0, sink_tokens=0, quant=QuantSettings(bits=2, prompt_tail=0)
    )
    assert method_config("minikv", budget=256, preset="paper") == paper
    assert CompressionConfig("minikv", 256, options={"preset": "paper"}).method_config() == paper
    assert method_config("minikv", budget=256, preset="paper", sink_tokens=8).sink_tokens == 8
    assert method_config("minikv", budget=256, preset="paper", quant={"bits": 4}).quant == QuantSettings(bits=4)
    with pytest.raises(ConfigError, match=r"preset='fast' is invalid: allowed one of paper"):
        method_config("minikv", budget=256, preset="fast")
    with pytest.raises(ConfigError, match=r"preset='paper' is invalid: allowed unset \(method h2o has no presets\)"):
        method_config("h2o", budget=256, preset="paper")
