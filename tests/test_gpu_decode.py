"""A decode through the GPU path's kernels (issue 49), on Intel's OpenCL CPU runtime: the device
layer caches (``ov_kvcrush.gpu.layer_cache``) against the reference layer caches step by step,
and greedy generation of the embedded model through them against the reference engine.

Layer by layer, on random keys and values: the outputs within float rounding of the reference's,
the tokens each KV head keeps (their positions) equal to the reference's, and the scores the
selection ranks by (the prompt's pooled window sums, each decode step's probabilities added,
gathered on eviction) within float rounding of the reference's ``acc``. The kernels run in the
``gpu_worker`` process (conftest); the functions it runs are this module's, at sub-group sizes 8
and 16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods import MethodConfig
from ov_kvcrush.methods.full import FullConfig
from ov_kvcrush.methods.importance import H2OConfig, SnapKVConfig

SUB_GROUPS = (8, 16)
#: every kind of config the path serves, over scores with and without pooling
CASES = [
    FullConfig(),
    H2OConfig(budget=40, sink_tokens=4, recent_tokens=8),
    SnapKVConfig(budget=40, sink_tokens=4, recent_tokens=8, window=16, pool_kernel=7),
    SnapKVConfig(budget=40, sink_tokens=0, recent_tokens=16, pool="avg"),
]
HQ, HKV, D, BLOCK = 6, 2, 64, 16


def _tensor(g: torch.Generator, t: int, heads: int) -> torch.Tensor:
    return torch.randn(1, heads, t, D, generator=g)


def run_layer_beside_reference(config: MethodConfig, sub_group: int) -> dict[str, float]:
    """In the worker: a 100-token prompt, 30 decode steps and one 3-token step through a device
    layer and the reference layer; the largest differences seen."""
    from ov_kvcrush.gpu.layer_cache import device_layer
    from ov_kvcrush.gpu.layout import PoolShape
    from ov_kvcrush.gpu.pool import DevicePool

    method = config.name
    pool = DevicePool(PoolShape("f32", BLOCK, D, HQ // HKV), blocks=64, sub_group=sub_group)
    ours, ref = device_layer(config, 0, 1, pool, HKV, HQ), config.make_layer(0, 1)
    g = torch.Generator().manual_seed(sub_group + len(repr(config)))
    worst = {"output": 0.0, "scores": 0.0, "positions": 0.0}
    steps = [100] + [1] * 15 + [3] + [1] * 15
    for t in steps:
        q, k, v = _tensor(g, t, HQ), _tensor(g, t, HKV), _tensor(g, t, HKV)
        a, b = ours.decode(q, k, v), ref.decode(q, k, v)
        worst["output"] = max(worst["output"], float((a - b).abs().max()))
        if method == "full":
            continue
        positions = ref.store.positions[0].numpy()
        if positions.shape != ours.layer.positions.shape or (positions != ours.layer.positions).any():
            worst["positions"] = 1.0
            break
        held = ours.layer.held
        got = pool.dev.to_host(ours.scores, np.float32, (HQ, ours.stride))[:, :held]
        worst["scores"] = max(worst["scores"], float(np.abs(got - ref.acc[0].numpy()).max()))
    worst["held"] = float(ours.layer.held)
    worst["blocks_in_use"] = float(pool.blocks_in_use)
    ours.release()
    worst["blocks_after_release"] = float(pool.blocks_in_use)
    return worst


@pytest.mark.parametrize("sub_group", SUB_GROUPS)
@pytest.mark.parametrize("config", CASES, ids=["full", "h2o", "snapkv-max7", "snapkv-avg31"])
def test_device_layer_steps_as_the_reference(gpu_worker, config, sub_group):
    worst = gpu_worker.submit(run_layer_beside_reference, config, sub_group).result()
    assert worst["output"] < 1e-4, worst
    assert worst["positions"] == 0.0, worst  # every KV head keeps the reference's tokens
    assert worst["scores"] < 1e-4, worst
    tokens = sum([100] + [1] * 15 + [3] + [1] * 15)
    assert worst["held"] == (tokens if config.name == "full" else config.budget)
    assert worst["blocks_in_use"] == HKV * -(-worst["held"] // BLOCK)  # evicted blocks went back
    assert worst["blocks_after_release"] == 0


def generate_through_device(method: str, budget: int) -> dict:
    """In the worker: the embedded model's greedy tokens through the device cache and the reference's."""
    from ov_kvcrush.gpu.generate import essay_prompt, run_on_device
    from ov_kvcrush.models.export import hf_checkpoint

    run = run_on_device(hf_checkpoint(progress=False), CompressionConfig(method=method, budget=budget),
                        essay_prompt(3300), 12)  # fmt: skip
    return {"run": run, "per_step": run.per_step()}


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("method", ["full", "snapkv", "h2o"])
def test_greedy_tokens_through_the_device_equal_the_reference(gpu_worker, method):
    """~750 tokens at budget 128 (the prompt and budget on which the CPU op's tokens equal the
    reference's: test_openvino_methods): the same 12 greedy tokens, the same tokens held, and
    per decode step the cache's own crossings (tables, counts, decisions) under 1 % of the KV
    bytes the step reads in place."""
    out = gpu_worker.submit(generate_through_device, method, 128).result()
    run, step = out["run"], out["per_step"]
    assert 650 <= run.prompt_tokens <= 850
    assert run.token_ids == run.reference_ids
    assert run.decode.layer_steps == 30 * 11  # every layer, every token after the first
    # the slots a step reads: the prompt and the tokens so far (full: step j holds prompt + j), or
    # the budget and the step's token (evicted after the step)
    held = run.prompt_tokens + 6 if method == "full" else 128 + 1
    assert step["kv_read"] == 3 * held * 2 * 64 * 4  # KV heads x slots x (key, value) x head size x f32
    assert step["cache_own_over_read"] < 0.01, step


def test_a_method_the_path_does_not_serve_is_named():
    from ov_kvcrush.gpu.layer_cache import check_served

    for method, options in [("chelsea", {}), ("snapkv", {"quant": True}), ("h2o", {"block_size": 32})]:
        with pytest.raises(ConfigError, match="full, h2o, snapkv"):
            check_served(CompressionConfig(method=method, budget=512, options=options).method_config())
    check_served(CompressionConfig(method="snapkv", budget=512).method_config())


def test_paged_device_is_checked_before_loading(tmp_path):
    from ov_kvcrush.engines.torch_engine import TorchEngine

    with pytest.raises(ConfigError, match="paged_device"):
        TorchEngine(tmp_path, paged_device="cuda")
    with pytest.raises(ConfigError, match="paged_device"):
        TorchEngine(tmp_path, device="cuda", paged_device="opencl")
