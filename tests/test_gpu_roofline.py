"""The decode roofline estimate for Intel GPUs (``ov_kvcrush.tools.gpu_roofline``, issue 71's
item 9): the weights counted from a config against the parameters transformers builds from it,
the full cache's KV bytes against the pool's own block layout, and the budget methods' bytes
bounded by the budget, not the context."""

from __future__ import annotations

import dataclasses
import json

from ov_kvcrush.gpu.layout import PoolShape
from ov_kvcrush.tools import gpu_roofline


def test_the_weights_counted_from_a_config_match_the_model_transformers_builds():
    from transformers import AutoConfig, AutoModelForCausalLM

    from ov_kvcrush.models.families import tiny_checkpoint

    folder = tiny_checkpoint("llama3")
    config = json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    built = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)
    assert gpu_roofline.params_of(config) == built


def test_the_full_caches_step_reads_every_held_slot_and_a_budget_method_what_it_keeps():
    model = gpu_roofline.ModelShape("m", layers=4, q_heads=8, kv_heads=2, head_dim=64, params=10**6,
                                    weight_bits=16, context=8192)  # fmt: skip
    slot = PoolShape("f16", 16, 64).block_bytes // 16  # a slot's key and value, as the pool lays them
    assert gpu_roofline.kv_step_bytes("full", model, 5000, 1024) == 4 * 2 * 5000 * slot
    for method in gpu_roofline.METHODS:
        at_8k = gpu_roofline.kv_step_bytes(method, model, 8192, 1024)
        assert at_8k == gpu_roofline.kv_step_bytes(method, model, 65536, 1024)  # the budget bounds it
        assert 0 < at_8k < gpu_roofline.kv_step_bytes("full", model, 8192, 1024)
    deep = dataclasses.replace(model, layers=32)
    for method in gpu_roofline.RECALL_METHODS:  # every token kept: what they rank grows with the context, slowly
        at_8k, at_64k = (gpu_roofline.kv_step_bytes(method, deep, n, 1024) for n in (8192, 65536))
        assert at_8k < at_64k < gpu_roofline.kv_step_bytes("full", deep, 65536, 1024) / 4
        assert at_8k > 2 * 2 * 8192 * slot  # its 2 dense layers read every slot
    # Chelsea: its outlier heads keep every token (none of 8 heads at 4 %: the budget bounds it; 2
    # of 64: they grow with the context, the others fall to their floor)
    merged = [gpu_roofline.kv_step_bytes("chelsea", model, n, 1024) for n in (8192, 65536)]
    assert merged[0] == merged[1] < gpu_roofline.kv_step_bytes("streamingllm", model, 8192, 1024)
    at_8k, at_64k = (gpu_roofline.kv_step_bytes("chelsea", deep, n, 1024) for n in (8192, 65536))
    assert at_8k < at_64k < gpu_roofline.kv_step_bytes("full", deep, 65536, 1024) / 8
    assert at_64k > 2 * 65536 * slot  # the two outlier heads read every slot
    rows = gpu_roofline.estimate([model], 1024, {"m": [8192]})
    for row in rows:
        for gpu, bandwidth in gpu_roofline.GPUS:
            assert abs(row.ms[gpu] - 1e3 * (row.weight_bytes + row.kv_bytes) / (bandwidth * 1e9)) < 1e-9
