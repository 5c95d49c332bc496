"""The step-counting tool's long-context model (``ov_kvcrush/tools/gpu_step_counts.py``): the tiny
Llama 3's checkpoint with its context raised, the weights unchanged (oracle: the source files)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.model
def test_the_long_checkpoint_raises_the_context_and_keeps_the_weights():
    from ov_kvcrush.models.families import tiny_checkpoint
    from ov_kvcrush.tools.gpu_step_counts import STAGING_PREFIX, long_checkpoint

    source = tiny_checkpoint("llama3")
    long = long_checkpoint(5000)
    assert long != source and long == long_checkpoint(5000)  # cached: the same copy again
    config, base = (json.loads((d / "config.json").read_text()) for d in (long, source))
    assert config["max_position_embeddings"] >= 5000 + 64 > base["max_position_embeddings"]
    assert {k: v for k, v in config.items() if k != "max_position_embeddings"} == {
        k: v for k, v in base.items() if k != "max_position_embeddings"
    }
    assert (long / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert not list(long.parent.glob(STAGING_PREFIX + "*"))  # no half-written copy left
