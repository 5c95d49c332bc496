"""A whole exported model in OpenVINO's GPU plugin with our layers in place of its attention
(issue 49): the graph pass (``transformations/plugin_attention.py``) and ``PluginModel`` (the
pool a remote tensor of the plugin's context, full cache), run by the plugin on Intel's OpenCL
CPU runtime under the emulation layer. The model is the tiny random-weight Llama 3 of the family
checks (2 layers, 8 query and 2 KV heads of 32 dims; the embedded model's run is in
docs/intel_gpu.md: its compilation by the CPU runtime alone takes longer than this test). Oracle:
the CPU op's greedy tokens (the openvino engine, full cache, the same KV precision) for the same
ids, a prompt step then decode steps."""

from __future__ import annotations

import numpy as np
import pytest

PROMPT_TOKENS, NEW_TOKENS = 24, 3


def _greedy_in_worker(model_dir: str, ids: list[int], kv_precision: str) -> list[int]:
    from ov_kvcrush.gpu.plugin_model import PluginModel

    return PluginModel(model_dir, kv_precision=kv_precision, pool_blocks=64, block_size=16).greedy(ids, NEW_TOKENS)[0]


def _cpu_op_greedy(model_dir, ids: list[int], kv_precision: str) -> list[int]:
    from ov_kvcrush.config import CompressionConfig
    from ov_kvcrush.engines.openvino_model import OpenVINOModel
    from ov_kvcrush.models.coverage import F32

    op = OpenVINOModel(model_dir, CompressionConfig(method="full"), kv_precision=kv_precision, properties=F32)
    try:
        out = [int(np.argmax(op.prefill(ids)))]
        while len(out) < NEW_TOKENS:
            out.append(int(np.argmax(op.forward([out[-1]]))))
        return out
    finally:
        op.close()


@pytest.mark.model
def test_a_model_through_our_plugin_layers_gives_the_cpu_ops_greedy_tokens(emulation_worker, kv_precision="f32"):
    from ov_kvcrush.models.export import export_models
    from ov_kvcrush.models.families import tiny_checkpoint

    checkpoint = tiny_checkpoint("llama3")
    model_dir = export_models([checkpoint], "fp32")[checkpoint]
    ids = [int(t) for t in np.random.default_rng(3).integers(10, 380, PROMPT_TOKENS)]
    want = _cpu_op_greedy(model_dir, ids, kv_precision)
    got = emulation_worker.submit(_greedy_in_worker, str(model_dir), ids, kv_precision).result(timeout=600)
    assert got == want
