"""The fast path's layer caches against the references (the oracle), step by step and end to end."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from helpers import tiny_llama

from ov_kvcrush.engines.hf_cache import CompressedCache, storage_bytes
from ov_kvcrush.fastpath import fast_layer
from ov_kvcrush.fastpath.buffer import GROWTH_TOKENS, KVBuffer
from ov_kvcrush.fastpath.clusterkv import FastClusterKVLayerCache
from ov_kvcrush.fastpath.eviction import FastEvictionLayerCache
from ov_kvcrush.fastpath.minikv import FastMiniKVLayerCache
from ov_kvcrush.fastpath.quest import FastQuestLayerCache
from ov_kvcrush.kernels import interpreting, triton_importable
from ov_kvcrush.methods import (
    ClusterKVConfig,
    H2OConfig,
    MiniKVConfig,
    PyramidKVConfig,
    QuantSettings,
    QuestConfig,
    SnapKVConfig,
    StreamingLLMConfig,
    method_config,
)

CLUSTERKV_CASES = {
    # budget below the prompt: the last recalled cluster is trimmed; new tokens clustered every 8 steps
    "trimmed+incremental": ClusterKVConfig(budget=40, sink_tokens=4, tokens_per_cluster=10, cluster_every=8),
    "no-recall-cache": ClusterKVConfig(budget=40, sink_tokens=2, n_clusters=7, recall_cache_steps=0, cluster_every=5),
    "recall-cache-3": ClusterKVConfig(budget=64, sink_tokens=0, tokens_per_cluster=6, recall_cache_steps=3),
    "budget-over-prompt": ClusterKVConfig(budget=500, sink_tokens=4, tokens_per_cluster=16),
}


def _qkv(gen: torch.Generator, t: int, hq: int = 4, hk: int = 2, d: int = 16):
    return (
        torch.randn(1, hq, t, d, generator=gen),
        torch.randn(1, hk, t, d, generator=gen),
        torch.randn(1, hk, t, d, generator=gen),
    )


def _kernels(monkeypatch, kernels: str) -> None:
    """Run the fast layers' decode attention with ``kernels``: ``triton`` is the split-key kernel
    (interpreted on CPU tensors), ``torch`` gathers the attended keys for fused SDPA."""
    if kernels == "triton" and not (triton_importable() and interpreting()):
        pytest.skip("needs Triton's interpreter")
    monkeypatch.setenv("OV_KVCRUSH_KERNELS", kernels)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("case", list(CLUSTERKV_CASES))
def test_fast_clusterkv_attends_what_the_reference_attends(monkeypatch, case, kernels):
    _kernels(monkeypatch, kernels)
    config = CLUSTERKV_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    ref, fast = config.make_layer(2, 3), fast_layer(config, 2, 3, reserve=5)
    assert isinstance(fast, FastClusterKVLayerCache)
    prompt = _qkv(gen, 90)
    assert torch.allclose(fast.prefill(*prompt), ref.prefill(*prompt), atol=1e-5)
    for step in range(30):
        x = _qkv(gen, 3 if step == 12 else 1)  # one step of several tokens (a chat turn's suffix)
        got, want = fast.decode(*x), ref.decode(*x)
        assert torch.allclose(got, want, atol=1e-5), f"step {step}"
        # the same tokens per head (the reference lists them by slot, the fast path by rank)
        sel = fast.last_selected
        held = sel[sel >= 0].view(*sel.shape[:2], -1)  # the pending window's unwritten slots are -1
        assert torch.equal(held.sort(-1).values, ref.last_selected.sort(-1).values), f"step {step}"
    if kernels == "triton":  # the selection ran in the fused kernels, not the tensor operations
        assert fast.fused_slots is not None
    want_counters = dict(ref.counters)
    got_counters = fast.counters
    assert got_counters.pop("clustering_prefill_ms") > 0
    assert got_counters.pop("clustering_decode_ms", 0) >= 0
    assert got_counters == pytest.approx(want_counters)
    assert want_counters["clusterings"] >= (2 if config.cluster_every < 20 else 1)
    assert torch.equal(fast.tokens_held(), ref.tokens_held())


MINIKV = MiniKVConfig(
    budget=48, sink_tokens=4, recent_tokens=8, quant=QuantSettings(group_size=16, residual_tokens=16, prompt_tail=16)
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("bits", "selection"), [((2, 2), "h2o"), ((2, 4), "snapkv"), ((4, 4), "snapkv")]
)  # the paper's choices, a mixed store, the product's default
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_fast_minikv_answers_what_the_reference_answers(monkeypatch, kernels, bits, selection):
    """Prefill, then 40 steps (the residual flushed every 16, one step of 3 tokens) over the 2-bit
    (keys 2 and values 4, or 4-bit) store read in place (the Triton kernel, interpreted on CPU) or
    dequantised (torch)."""
    if kernels == "triton" and not (triton_importable() and interpreting()):
        pytest.skip("needs Triton's interpreter")
    monkeypatch.setenv("OV_KVCRUSH_KERNELS", kernels)
    gen = torch.Generator().manual_seed(7)
    quant = dataclasses.replace(MINIKV.quant, key_bits=bits[0], value_bits=bits[1])
    cfg = dataclasses.replace(MINIKV, quant=quant, selection=selection)
    ref, fast = cfg.make_layer(1, 3), fast_layer(cfg, 1, 3, reserve=8)
    assert isinstance(fast, FastMiniKVLayerCache)
    prompt = _qkv(gen, 90, d=32)
    assert torch.allclose(fast.prefill(*prompt), ref.prefill(*prompt), atol=1e-5)
    for step in range(40):
        x = _qkv(gen, 3 if step == 20 else 1, d=32)
        assert torch.allclose(fast.decode(*x), ref.decode(*x), atol=1e-4), f"step {step}"
        assert torch.equal(fast.tokens_held(), ref.tokens_held())
    assert fast.n_q == ref.store.quantized_tokens and fast.n_q > 48
    assert fast.counters == pytest.approx(ref.counters)
    assert fast.memory()["total"] == storage_bytes(fast)
    assert fast.memory()["kv"] < ref.memory()["kv"] * 1.5  # preallocated, still packed


EVICTION = {
    "snapkv": SnapKVConfig(budget=40, sink_tokens=4, recent_tokens=8, window=8),
    "h2o": H2OConfig(budget=40, sink_tokens=4, recent_tokens=8),
    "pyramidkv": PyramidKVConfig(budget=40, sink_tokens=4, recent_tokens=8, window=8),
    "streamingllm": StreamingLLMConfig(budget=40, sink_tokens=4),
}


@pytest.mark.parametrize("name", list(EVICTION))
@pytest.mark.parametrize("prompt", [90, 30])  # a prompt over the budget, and one under it
def test_fast_eviction_keeps_and_answers_what_the_reference_does(name, prompt):
    config = EVICTION[name]
    gen = torch.Generator().manual_seed(prompt)
    ref, fast = config.make_layer(1, 3), fast_layer(config, 1, 3)
    assert isinstance(fast, FastEvictionLayerCache)
    x = _qkv(gen, prompt)
    assert torch.allclose(fast.prefill(*x), ref.prefill(*x), atol=1e-5)
    for step in range(30):
        x = _qkv(gen, 2 if step == 15 else 1)  # a step of two tokens: handed to the reference and back
        assert torch.allclose(fast.decode(*x), ref.decode(*x), atol=1e-5), f"step {step}"
        kept = fast.positions[:, :, : fast.budget] if fast.fixed else fast.reference.store.positions
        assert torch.equal(kept, ref.store.positions), f"step {step}"
    assert fast.fixed and fast.seen == ref.seen
    assert fast.counters == pytest.approx(ref.counters)
    assert fast.memory()["kv"] == storage_bytes([fast.keys, fast.values])  # budget + 1 slots, allocated once


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("prompt", [90, 96])  # a partial last page, and whole pages
def test_fast_quest_recalls_the_pages_the_reference_recalls(monkeypatch, prompt, kernels):
    _kernels(monkeypatch, kernels)
    config = QuestConfig(budget=32, page_size=8)
    gen = torch.Generator().manual_seed(prompt)
    ref, fast = config.make_layer(2, 3), fast_layer(config, 2, 3, reserve=4)
    assert isinstance(fast, FastQuestLayerCache)
    x = _qkv(gen, prompt)
    assert torch.allclose(fast.prefill(*x), ref.prefill(*x), atol=1e-5)
    for step in range(30):  # past the reserve: the store grows and the bounds follow
        x = _qkv(gen, 3 if step == 9 else 1)
        assert torch.allclose(fast.decode(*x), ref.decode(*x), atol=1e-5), f"step {step}"
        sel = fast.last_selected
        got = sel[sel >= 0].view(*sel.shape[:2], -1)
        assert torch.equal(got.sort(-1).values, ref.last_selected.sort(-1).values), f"step {step}"
    assert fast.memory()["total"] == storage_bytes(fast)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_fast_clusterkv_dense_layer_attends_everything(monkeypatch, kernels):
    _kernels(monkeypatch, kernels)
    config = ClusterKVConfig(budget=20, sink_tokens=2, dense_layers=1)
    gen = torch.Generator().manual_seed(1)
    ref, fast = config.make_layer(0, 2), fast_layer(config, 0, 2)
    prompt = _qkv(gen, 50)
    assert torch.allclose(fast.prefill(*prompt), ref.prefill(*prompt), atol=1e-5)
    for _ in range(5):
        x = _qkv(gen, 1)
        assert torch.allclose(fast.decode(*x), ref.decode(*x), atol=1e-5)
    assert fast.counters.get("clusterings", 0) == 0 and fast.last_selected is None


def test_fast_memory_is_what_the_tensors_hold():
    config = CLUSTERKV_CASES["trimmed+incremental"]
    gen = torch.Generator().manual_seed(2)
    fast = fast_layer(config, 2, 3)
    fast.prefill(*_qkv(gen, 70))
    for _ in range(10):
        fast.decode(*_qkv(gen, 1))
    mem = fast.memory()
    assert mem["total"] == mem["kv"] + mem["metadata"]
    assert mem["total"] == storage_bytes(fast)  # every tensor it pins, counted once, at its allocated size


def test_methods_without_a_fast_layer_get_the_reference():
    assert fast_layer(SnapKVConfig(budget=128, quant=QuantSettings()), 0, 2) is None
    assert fast_layer(SnapKVConfig(budget=128, head_budgets="adaptive"), 0, 2) is None
    assert fast_layer(method_config("kvcrush", budget=128), 0, 2) is None
    assert fast_layer(ClusterKVConfig(budget=64, quant=QuantSettings()), 0, 2) is None
    assert fast_layer(ClusterKVConfig(budget=64, track_recall=True), 0, 2) is None


def test_kv_buffer_grows_without_losing_tokens():
    buf = KVBuffer(reserve=3)
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(1, 2, t, 8, generator=gen) for t in (5, 1, GROWTH_TOKENS, 1, 7)]
    for p in parts:
        buf.append(p, -p)
    k, v = buf.view()
    assert torch.equal(k, torch.cat(parts, dim=2)) and torch.equal(v, -k)
    assert buf.keys.shape[2] % GROWTH_TOKENS == 0 and buf.keys.shape[2] >= buf.n
    assert buf.nbytes() == storage_bytes(buf)


def test_greedy_tokens_on_a_model_equal_the_reference():
    """End to end on a tiny random Llama: the fast cache generates the reference cache's tokens."""
    model, cfg = tiny_llama()
    method = method_config(
        "clusterkv", budget=48, sink_tokens=4, tokens_per_cluster=12, cluster_every=10, dense_layers=1
    )
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(1))

    def greedy(fast: bool) -> tuple[list[int], CompressedCache]:
        cache = CompressedCache(method, cfg, fast_path=fast, reserve=24)
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, past_key_values=cache)
        return out[0, ids.shape[1] :].tolist(), cache

    want, ref_cache = greedy(False)
    got, fast_cache = greedy(True)
    assert any(isinstance(layer.method, FastClusterKVLayerCache) for layer in fast_cache.layers)
    assert got == want
    counters = fast_cache.counters()
    assert counters.pop("clustering_prefill_ms") > 0 and counters.pop("clustering_decode_ms") > 0
    assert counters == pytest.approx(ref_cache.counters())


# --------------------------------------------------------------------------------------------
# what a CUDA graph asks of a step, checked on the CPU


class _NoHostRead:
    """Fail any read of a tensor's value by the host during a step: a replayed graph runs no Python."""

    NAMES = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__")

    def __enter__(self) -> _NoHostRead:
        self.saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}

        def refuse(name):
            def f(*args, **kwargs):
                raise AssertionError(f"a decode step read a tensor on the host (Tensor.{name})")

            return f

        for name in self.NAMES:
            setattr(torch.Tensor, name, refuse(name))
        return self

    def __exit__(self, *exc) -> None:
        for name, f in self.saved.items():
            setattr(torch.Tensor, name, f)


def _python_state(x, seen=None):
    """Every value a step could leave behind in Python: tensors by address and shape (updated in
    place they keep both), everything else by value."""
    seen = set() if seen is None else seen
    if isinstance(x, torch.Tensor):
        return ("tensor", x.data_ptr(), tuple(x.shape), x.dtype)
    if isinstance(x, (int, float, str, bool, type(None), torch.dtype, torch.device)):
        return x
    if id(x) in seen:
        return ("seen", id(x))
    seen.add(id(x))
    if isinstance(x, dict):
        return {k: _python_state(v, seen) for k, v in x.items()}
    if isinstance(x, (list, tuple)) or hasattr(x, "maxlen"):
        return [_python_state(v, seen) for v in x]
    if hasattr(x, "__dict__"):
        skip = {"attend_ms", "last_selected", "_last_selected", "policy_ms", "config"}  # timings; an output of the step
        return {k: _python_state(v, seen) for k, v in vars(x).items() if k not in skip}
    return repr(x)


GRAPHED = {
    "snapkv": dict(budget=40, sink_tokens=4, recent_tokens=8, window=8),
    "quest": dict(budget=32, page_size=8, dense_layers=1),
    "clusterkv": dict(budget=40, sink_tokens=4, tokens_per_cluster=12, cluster_every=6, dense_layers=1),
    "minikv": dict(budget=40, sink_tokens=4, recent_tokens=8, quant=QuantSettings(residual_tokens=16)),
    "full": {},
}


@pytest.mark.parametrize("name", list(GRAPHED))
def test_a_graphed_step_reads_nothing_on_the_host_and_leaves_no_python_state(name):
    """The contract of :class:`~ov_kvcrush.engines.cuda_graph.GraphedDecoder`, step by step on the
    CPU: inside a step (the part a graph replays) no tensor value reaches Python and no Python
    state changes (state tensors are updated in place); the tokens are the reference's."""
    model, cfg = tiny_llama()
    method = method_config(name, **GRAPHED[name])
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model.generate(
            ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, past_key_values=CompressedCache(method, cfg)
        )[0, ids.shape[1] :].tolist()
        cache = CompressedCache(method, cfg, fast_path=True, reserve=20)
        assert cache.graphable()
        tokens = [int(model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[0, -1].argmax())]
        keys, eager = set(), 0
        for step in range(1, 20):
            token = torch.tensor([[tokens[-1]]])
            position = torch.tensor([[ids.shape[1] + step - 1]])
            cache.before_step(1)
            key = cache.graph_key()  # a new key: the decoder runs the step eagerly, then captures
            replayed = key in keys
            if key is None:  # a step with host work inside (MiniKV's flush): always eager
                eager += 1
            else:
                keys.add(key)
            cache.set_graphed(True)
            before = _python_state(cache)
            with _NoHostRead() if replayed else contextlib.nullcontext():
                out = model(input_ids=token, position_ids=position, past_key_values=cache, logits_to_keep=1)
            if replayed:
                assert _python_state(cache) == before, f"step {step} changed the cache's Python state"
            cache.set_graphed(False)
            cache.after_step(1)
            tokens.append(int(out.logits[0, -1].argmax()))
    assert tokens == want
    # ClusterKV's shapes change once per clustering of new tokens (every 6 steps): 4 captures;
    # MiniKV's once per flush of the residual (every 16 steps), the flushing step itself eager
    assert len(keys) == {"clusterkv": 4, "full": 1}.get(name, len(keys))
    if name == "minikv":
        assert eager >= 1 and len(keys) >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_give_the_eager_tokens():
    from ov_kvcrush.config import CompressionConfig, GenerationSettings
    from ov_kvcrush.engines.torch_engine import TorchEngine

    settings = GenerationSettings(max_new_tokens=40, ignore_eos=True)
    prompt = "The pass key is 52445. " * 40
    configs = (
        CompressionConfig(),
        CompressionConfig("clusterkv", budget=256, options={"cluster_every": 16}),
        CompressionConfig("minikv", budget=256),
        CompressionConfig("snapkv", budget=256),
        CompressionConfig("quest", budget=256),
    )
    for comp in configs:
        eager = TorchEngine("random:tiny-llama", comp, device="cuda", cuda_graphs=False).generate(prompt, settings)
        graphed = TorchEngine("random:tiny-llama", comp, device="cuda").generate(prompt, settings)
        assert graphed.counters["graph_captures"] >= 1
        assert graphed.token_ids == eager.token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_clusterkv_clustering_beside_the_prefill_equals_clustering_in_line():
    """On CUDA the prompt's k-means runs on a stream of its own while the host goes on, joined by
    ``finish_prefill``: the same clusters and the same attention as a layer that clusters on the
    current stream (the same kernels; only atomics' order differs), read right after the join."""
    gen = torch.Generator().manual_seed(5)
    hk, n, d = 2, 4000, 64
    prompt = [torch.randn(1, h, n, d, generator=gen).cuda() for h in (4, hk, hk)]
    config = ClusterKVConfig(budget=256, sink_tokens=4, tokens_per_cluster=80, cluster_every=8)
    beside, inline = fast_layer(config, 2, 3, reserve=24), fast_layer(config, 2, 3, reserve=24)
    inline.overlap_clustering = False
    assert torch.equal(beside.prefill(*prompt), inline.prefill(*prompt))
    assert beside._side is not None and inline._side is None  # queued on the clustering stream
    beside.finish_prefill()
    assert beside._side is None
    for name in ("labels", "sizes", "sorted_tokens"):
        assert torch.equal(getattr(beside.index, name), getattr(inline.index, name)), name
    for step in range(20):
        x = [t.cuda() for t in _qkv(gen, 1, d=d)]
        assert torch.allclose(beside.decode(*x), inline.decode(*x), atol=1e-3), f"step {step}"
        assert torch.equal(beside.last_selected, inline.last_selected), f"step {step}"
