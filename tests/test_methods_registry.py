"""Every registered method, driven by the registry: validation, exactness when nothing needs compressing,
budgets held, memory accounted, odd shapes handled."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods import ENGINES, REGISTRY, ShapeError, method_config, methods_for, methods_table
from ov_kvcrush.methods.base import MethodConfig, storage_bytes
from ov_kvcrush.methods.full import FullConfig
from ov_kvcrush.methods.vectors import layer_vectors
from ov_kvcrush.op.method_spec import method_spec

REQUIRED = {"full", "streamingllm", "h2o", "snapkv", "pyramidkv", "kvcrush", "clusterkv", "quest", "chelsea", "minikv"}
COMPRESSING = sorted(n for n in REGISTRY if n != "full")


def make(name: str, budget: int | None, **kw):
    if name == "full":
        return FullConfig()
    if name in ("clusterkv", "quest"):
        kw.setdefault("dense_layers", 0)
    return method_config(name, budget=budget, **kw)


def run_layer(cfg, vec, prompt: int, steps: int, layer: int = 0, layers: int = 1):
    cache = cfg.make_layer(layer, layers)
    q, k, v = vec.prefix(prompt)
    outs = [cache.prefill(q, k, v)]
    for i in range(prompt, prompt + steps):
        outs.append(cache.decode(*vec.step(i)))
    return cache, outs


def test_registry_has_every_method_with_matching_names():
    assert set(REGISTRY) >= REQUIRED
    for name, cls in REGISTRY.items():
        assert cls.name == name


@pytest.mark.parametrize("name", COMPRESSING)
def test_budget_is_required_and_validated(name):
    with pytest.raises(ConfigError, match="budget"):
        method_config(name)
    with pytest.raises(ConfigError, match="budget=0"):
        method_config(name, budget=0)
    with pytest.raises(ConfigError, match="budget"):
        method_config(name, budget="256")


def test_unknown_method_and_field_are_named():
    with pytest.raises(ConfigError, match="method='nope'"):
        method_config("nope")
    with pytest.raises(ConfigError, match="colour"):
        method_config("h2o", budget=256, colour=1)


@pytest.mark.parametrize("name", COMPRESSING)
def test_budget_at_least_the_sequence_equals_full_attention(name):
    """Nothing to compress -> the method's outputs are the full cache's, at every step."""
    vec = layer_vectors(1, tokens=120)
    kw = {"quant": None} if name == "minikv" else {}
    _, ref = run_layer(FullConfig(), vec, 100, 20)
    _, got = run_layer(make(name, 512, **kw), vec, 100, 20)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", COMPRESSING)
def test_compression_holds_the_budget_and_shrinks_memory(name):
    vec = layer_vectors(2, tokens=400)
    budget = 128
    full, _ = run_layer(FullConfig(), vec, 300, 100)
    cache, outs = run_layer(make(name, budget), vec, 300, 100)
    assert all(torch.isfinite(o).all() for o in outs)
    held = cache.tokens_held()
    if name in ("clusterkv", "quest"):  # recall methods keep everything, attend a budget
        assert int(held.max()) == 400
        assert int(cache.tokens_attended().max()) <= budget + (cache.config.cluster_every if name == "clusterkv" else 0)
    elif name == "minikv":  # frozen prefill selection + every generated token, quantized
        assert int(held.max()) == budget + 100
        store = cache.store
        per_token_fp32 = full.memory()["kv"] // 400
        bits = cache.config.quant.bits  # codes of `bits` + an fp16 scale and zero per 16 values
        quantized = store.quantized_tokens * per_token_fp32 * (bits + 2) // 32
        assert store.quantized_tokens > 0
        assert cache.memory()["kv"] == quantized + (store.pinned_len + store.residual_len) * per_token_fp32
    elif name == "kvzip":  # selects only after the engine's scoring pass (test_method_kvzip.py)
        assert int(held.max()) == 400
    elif name == "chelsea":
        assert int(held.max()) < budget + cache.config.merge_interval
        assert cache.memory()["kv"] < full.memory()["kv"] / 2
    else:
        assert int(held.max()) <= budget
        assert cache.memory()["kv"] == pytest.approx(full.memory()["kv"] * budget / 400, rel=1e-6)


WITH_QUANT = [(n, False) for n in sorted(REGISTRY)] + [
    (n, True) for n in sorted(REGISTRY) if "quant" in REGISTRY[n].__dataclass_fields__
]


@pytest.mark.parametrize(("name", "quant"), WITH_QUANT)
def test_memory_is_what_the_tensors_hold(name, quant):
    """``memory()`` equals the storage of every tensor the layer holds, measured independently
    (so nothing is kept unreported, and no kept slice pins a larger tensor)."""
    vec = layer_vectors(3, tokens=400)
    cfg = make(name, 96, **({"quant": True} if quant else {}))
    cache = cfg.make_layer(0, 1)
    q, k, v = (x.clone() for x in vec.prefix(300))  # fresh tensors, as an engine passes them
    cache.prefill(q, k, v)
    for i in range(300, 400):
        cache.decode(*(x.clone() for x in vec.step(i)))
    mem = cache.memory()
    assert mem["total"] == mem["kv"] + mem["metadata"] > 0
    assert cache.nbytes() == mem["total"] == storage_bytes(cache)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_empty_and_malformed_inputs_give_clear_errors(name):
    cache = make(name, 96).make_layer(0, 1)
    empty = torch.zeros(1, 2, 0, 16)
    with pytest.raises(ShapeError, match="at least one"):
        cache.prefill(torch.zeros(1, 4, 0, 16), empty, empty)
    with pytest.raises(ShapeError, match="keys must be"):
        cache.prefill(torch.zeros(1, 4, 3, 16), torch.zeros(2, 3, 16), torch.zeros(2, 3, 16))
    with pytest.raises(ShapeError, match="multiple of kv_heads"):
        cache.prefill(torch.zeros(1, 3, 3, 16), torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))
    with pytest.raises(ConfigError, match="layer_idx"):
        make(name, 96).make_layer(4, 4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(REGISTRY)),
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    prompt=st.integers(1, 70),
    steps=st.integers(0, 6),
    budget=st.integers(1, 200),
)
def test_any_shape_and_budget_gives_the_right_output_shape(name, batch, kv_heads, group, prompt, steps, budget):
    """Single tokens, budgets above the context or below the method's floor: right shapes or a ConfigError."""
    d = 16
    vec = layer_vectors(
        prompt * 7 + steps,
        batch=batch,
        kv_heads=kv_heads,
        q_heads=kv_heads * group,
        tokens=prompt + steps,
        head_dim=d,
        clusters=3,
    )
    kw = {"sink_tokens": 2, "recent_tokens": 2} if name not in ("full", "quest", "clusterkv", "streamingllm") else {}
    if name == "clusterkv":
        kw = {"sink_tokens": 2}
    if name == "chelsea":
        kw["chunk_size"] = 8
    try:
        cfg = make(name, budget, **kw)
    except ConfigError as e:
        assert "budget" in str(e)
        return
    cache, outs = run_layer(cfg, vec, prompt, steps)
    assert outs[0].shape == (batch, kv_heads * group, prompt, d)
    for o in outs[1:]:
        assert o.shape == (batch, kv_heads * group, 1, d)
    assert all(torch.isfinite(o).all() for o in outs)
    assert cache.tokens_held().shape == (batch, kv_heads)


# --------------------------------------------------------------------------------------------
# the registry drives every list of methods per engine


def test_every_method_declares_its_own_runtimes():
    """A subclass does not inherit its parent's runtimes (PyramidKV is SnapKV's subclass, but native
    openvino_genai has no PyramidKV): every registered class names them itself, the reference
    among them; its engines are derived from them."""
    for name, cls in REGISTRY.items():
        assert "runtimes" in vars(cls), name
        assert cls.runtimes["reference"] == (), name
        assert "torch" in cls.engines and set(cls.engines) <= set(ENGINES), name
    with pytest.raises(TypeError, match="runtimes"):
        type("Bad", (MethodConfig,), {"runtimes": {"cuda": ()}})


def test_methods_for_each_engine_are_the_declared_ones():
    for engine in ENGINES:
        assert methods_for(engine) == tuple(n for n, c in REGISTRY.items() if engine in c.engines)
    assert methods_for("torch") == tuple(REGISTRY)
    assert "quest" not in methods_for("openvino") and "pyramidkv" not in methods_for("genai")
    with pytest.raises(ConfigError, match="engine"):
        methods_for("cuda")


@pytest.mark.parametrize("name", [n for n in REGISTRY if n != "full"])
def test_the_op_spec_is_built_by_the_method_or_refused_by_name(name):
    cfg = method_config(name, budget=256)
    if "openvino" in cfg.engines:
        spec = dict(item.split("=", 1) for item in method_spec(cfg, 4, 9, 32).split(";"))
        assert spec["method"] == name and len(spec["budgets"].split(",")) == 4
        assert spec["quant"] == ("1" if getattr(cfg, "quant", None) is not None else "0")
    else:
        with pytest.raises(ConfigError, match=f"method='{name}' .*our op .*{name} runs on: backend torch"):
            method_spec(cfg, 4, 9, 32)


def test_bench_eval_and_config_lists_are_the_registry():
    from ov_kvcrush.bench import backend_methods
    from ov_kvcrush.config import CompressionConfig, check_native
    from ov_kvcrush.eval.runner import EvalPlan

    for backend in ("genai", "openvino", "torch"):
        assert backend_methods(backend) == methods_for(backend)
    for name in REGISTRY:
        cfg = CompressionConfig(name, None if name == "full" else 256)
        if name in methods_for("genai"):
            check_native(cfg, 32)
        else:
            with pytest.raises(ConfigError, match="backend genai"):
                check_native(cfg, 32)
    assert {m.method for m in EvalPlan(tasks=("passkey",), backend="genai").compressed()} == set(
        methods_for("genai")
    ) - {"full"}


def test_cli_help_lists_exactly_the_methods_of_each_backend(capsys):
    from ov_kvcrush.cli.main import build_parser

    for command in ("generate", "chat"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for engine in ENGINES:
            listed = re.search(rf"{engine}: ([a-z0-9, ]+?)(;|$| --)", text).group(1)
            assert tuple(listed.replace(",", " ").split()) == methods_for(engine), (command, engine)


def test_readme_methods_table_is_the_registry():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert methods_table() in readme
    for name, cls in REGISTRY.items():
        row = next(line for line in methods_table().splitlines() if line.startswith(f"| `{name}` "))
        assert row.count("| yes ") == len(cls.engines)


def test_each_method_module_cites_its_paper_and_its_departures():
    import importlib

    for name, cls in REGISTRY.items():
        doc = importlib.import_module(cls.__module__).__doc__ or ""
        if name == "full":
            continue
        assert re.search(r"arXiv \d{4}\.\d{4,5}", doc), name
        assert "depart" in doc.lower(), name
