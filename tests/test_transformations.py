"""The graph pass on real exports: tiny random llama / qwen2 models written by optimum-intel.

The converted model must give the logits of the unmodified stateful IR (OpenVINO's own SDPA and
KV state, ``KV_CACHE_PRECISION`` set to what our cache stores) at every step, and models the pass
cannot convert must fail with a message naming what is missing.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import converted_steps, native_steps
from ov_kvcrush.transformations import SEQUENCE_INPUT, ConversionError, convert_model

from ov_kvcrush.op import plugin


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def tiny(request):
    """A 2-layer random model of the family (8 query heads; 2 KV heads, Qwen2 1), exported with
    optimum-intel (``ov_kvcrush.models.families``; cached per machine)."""
    from ov_kvcrush.models.export import export_models
    from ov_kvcrush.models.families import family, tiny_checkpoint

    hf = tiny_checkpoint(request.param)
    ir = export_models([hf], "fp32")[hf]
    assert not isinstance(ir, str), ir
    fam = family(request.param).config_fields()
    return ir, fam["num_key_value_heads"]


@pytest.mark.parametrize("kv_precision", ["f32", "f16", "u8"])
def test_converted_logits_match_the_unmodified_model(tiny, kv_precision):
    """Against the unmodified model with OpenVINO's own cache in the same precision (u8: both
    quantize keys and values with a per-token scale, within rounding of each other)."""
    ir, kv_heads = tiny
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 380, size=150).tolist()
    ref, tokens = native_steps(ir / "openvino_model.xml", prompt, 24, kv_precision)
    got, conv, pool, seq = converted_steps(ir / "openvino_model.xml", prompt, tokens[:-1], kv_precision)
    tol = {"f32": 1e-4, "f16": 2e-3, "u8": 2e-2}[kv_precision]
    np.testing.assert_allclose(got, ref, atol=tol * np.abs(ref).max(), rtol=0)
    assert [int(np.argmax(x)) for x in got] == tokens
    assert conv.shape.layers == 2 and conv.shape.q_heads == 8 and conv.shape.kv_heads == kv_heads
    assert seq.stats().tokens_seen == 150 + 24
    assert pool.stats().blocks_in_use == 2 * kv_heads * -(-(150 + 24) // 32)


def test_converted_graph_has_no_kv_state(tiny):
    core = plugin.shared_core()
    conv = convert_model(core.read_model(tiny[0] / "openvino_model.xml"), plugin.loaded_path())
    kinds = [op.get_type_name() for op in conv.model.get_ordered_ops()]
    assert kinds.count("PagedAttention") == 2
    assert "ScaledDotProductAttention" not in kinds and "ReadValue" not in kinds and "Assign" not in kinds
    assert not conv.model.get_sinks() and not conv.model.get_variables()
    names = {p.get_friendly_name() for p in conv.model.get_parameters()}
    assert SEQUENCE_INPUT in names and "beam_idx" not in names and "beam_idx" in conv.removed_inputs
    assert conv.removed_variables == 4
    assert conv.scales == pytest.approx([32**-0.5] * 2)
    # converting again is refused: there is no SDPA left
    with pytest.raises(ConversionError, match="already has PagedAttention"):
        convert_model(conv.model, plugin.loaded_path())


def test_model_without_sdpa_is_refused():
    import openvino as ov
    import openvino.opset13 as ops

    x = ops.parameter([1, 8], np.float32, name="x")
    y = ops.matmul(x, ops.constant(np.ones((8, 4), np.float32)), False, False)
    with pytest.raises(ConversionError, match="no ScaledDotProductAttention op found"):
        convert_model(ov.Model([y], [x]), plugin.loaded_path())


def test_stateless_sdpa_is_refused_naming_the_pattern():
    """SDPA whose keys are plain inputs (a stateless export): the message names what was found."""
    import openvino as ov
    import openvino.opset13 as ops

    q = ops.parameter([1, 4, -1, 32], np.float32, name="q")
    k = ops.parameter([1, 4, -1, 32], np.float32, name="k")
    v = ops.parameter([1, 4, -1, 32], np.float32, name="v")
    k4 = ops.reshape(k, ops.constant(np.array([1, 4, -1, 32])), False)
    sdpa = ops.scaled_dot_product_attention(q, k4, v, causal=True)
    pattern = r"layer 0: the key .* does not come from a KV-state Concat \(found SDPA <- Reshape <- Parameter\)"
    with pytest.raises(ConversionError, match=pattern):
        convert_model(ov.Model([sdpa], [q, k, v]), plugin.loaded_path())
