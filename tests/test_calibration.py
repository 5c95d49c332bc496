"""A method calibrated on the model once (Chelsea's ``outlier_heads="auto"``, issue 24).

The reference refuses to build layers from an uncalibrated config (naming the field); the
calibration cache is written whole and read back, a damaged file is measured again; and both
engines, each from its own full cache, find the outlier heads the paper's calibration finds.
"""

from __future__ import annotations

import json

import pytest
import torch

from ov_kvcrush.engines import calibration
from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods import ChelseaConfig
from ov_kvcrush.methods.chelsea import calibrate_outlier_heads
from ov_kvcrush.methods.vectors import layer_vectors
from ov_kvcrush.op.method_spec import method_spec


def layer_keys(layers: int = 5) -> list[torch.Tensor]:
    return [layer_vectors(seed, tokens=300).keys for seed in range(layers)]


def test_auto_outliers_wait_for_a_calibration():
    cfg = ChelseaConfig(budget=128, outlier_heads="auto")
    assert cfg.needs_calibration and not ChelseaConfig(budget=128).needs_calibration
    with pytest.raises(ConfigError, match=r"outlier_heads.*calibration"):
        cfg.make_layer(0, 2)
    with pytest.raises(ConfigError, match=r"outlier_heads.*calibration"):
        method_spec(cfg, 2, 6, 32)
    with pytest.raises(ConfigError, match="outlier_heads"):
        ChelseaConfig(budget=128, outlier_heads="all")
    keys = layer_keys()
    done = cfg.with_calibration(cfg.calibrate(keys))
    assert done.outlier_heads == calibrate_outlier_heads(keys, chunk_size=cfg.chunk_size) != ()
    assert not done.needs_calibration and done.make_layer(0, len(keys)) is not None
    with pytest.raises(ConfigError, match="outlier_heads"):
        cfg.with_calibration({"outlier_heads": "x"})


def test_the_product_calibrates_by_default_and_a_direct_config_does_not():
    """Through ``CompressionConfig`` (every engine, the CLI, eval, bench) Chelsea's outlier heads
    are ``auto``, as the paper keeps 4 % of heads whole; a user's value or a config built directly
    (the reference, no model) wins. Without a model, the bytes a budget holds are measured with a
    calibration on random keys: the same count of heads, counted against the budget."""
    from ov_kvcrush.config import CompressionConfig
    from ov_kvcrush.eval.budget import ModelShape, calibrated_on_noise

    assert CompressionConfig("chelsea", 128).method_config().outlier_heads == "auto"
    assert CompressionConfig("chelsea", 128, options={"outlier_heads": ()}).method_config().outlier_heads == ()
    assert ChelseaConfig(budget=128).outlier_heads == ()
    assert CompressionConfig("kvcrush", 128).method_config().needs_calibration is False
    auto = CompressionConfig("chelsea", 128).method_config()
    for layer_types, picked in ((("full_attention",) * 13, 1), (("full_attention",) * 26, 2)):
        shape = ModelShape(13 if picked == 1 else 26, 4, 2, 16, 4, layer_types)
        done = calibrated_on_noise(auto, shape)  # 4 % of the layers x KV heads
        assert len(done.outlier_heads) == picked and not done.needs_calibration
    # the method's layers are the global ones: 13 of 26 here, so one head as for 13 global layers
    shape = ModelShape(26, 4, 2, 16, 4, ("full_attention", "sliding_attention") * 13)
    assert len(calibrated_on_noise(auto, shape).outlier_heads) == 1
    assert CompressionConfig("chelsea", 128).method_config().model_free().outlier_heads == ()


def test_a_calibration_is_cached_whole_and_measured_again_when_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv("OV_KVCRUSH_CACHE", str(tmp_path))
    cfg = ChelseaConfig(budget=128, outlier_heads="auto")
    keys = layer_keys()
    calls = []

    def measure(ids: list[int]) -> list[torch.Tensor]:
        calls.append(len(ids))
        return keys

    encode = lambda text: list(range(len(text.split())))  # noqa: E731  (one id per word)
    first = calibration.resolve(cfg, "model-a", encode, measure)
    assert calls == [calibration.CALIBRATION_TOKENS]
    path = calibration.cache_file("model-a", cfg)
    assert json.loads(path.read_text()) == {"outlier_heads": [list(p) for p in first.outlier_heads]}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left beside it
    assert calibration.resolve(cfg, "model-a", encode, measure) == first and len(calls) == 1  # read back
    path.write_text('{"outlier_heads": [[1, ')  # a half-written file is never used
    assert calibration.resolve(cfg, "model-a", encode, measure) == first and len(calls) == 2
    calibration.resolve(cfg, "model-b", encode, measure)  # another model: its own file
    assert len(calls) == 3


def test_plain_transformers_users_calibrate_with_one_call(tmp_path, monkeypatch):
    """``calibrate_hf``: the keys of transformers' own forward through a full cache of ours go to
    the paper's calibration, the result is cached per model, and the cache then builds."""
    from helpers import tiny_llama

    from ov_kvcrush.config import CompressionConfig
    from ov_kvcrush.engines.hf_cache import CompressedCache

    monkeypatch.setenv("OV_KVCRUSH_CACHE", str(tmp_path))
    model, cfg = tiny_llama(layers=13)  # 26 layer-heads: 4 % is one

    class WordIds:  # a tokenizer: one id per word
        def __call__(self, text: str, add_special_tokens: bool = False):
            return type("Encoded", (), {"input_ids": [3 + sum(map(ord, w)) % 120 for w in text.split()]})()

    method = CompressionConfig("chelsea", 128).method_config()
    with pytest.raises(ConfigError, match="calibrate_hf"):
        CompressedCache(method, cfg)
    done = calibration.calibrate_hf(method, model, WordIds())
    ids = calibration.calibration_ids(lambda text: WordIds()(text).input_ids)
    keys = calibration.hf_layer_keys(model, ids)
    assert len(keys) == 13 and keys[0].shape == (1, 2, calibration.CALIBRATION_TOKENS, 16)
    assert done.outlier_heads == calibrate_outlier_heads(keys, chunk_size=method.chunk_size)
    assert len(done.outlier_heads) == 1 and not (tmp_path / "calibration").exists()  # no name: not cached
    assert CompressedCache(done, cfg).layers[0].method is not None
    model.config._name_or_path = "tiny-llama"  # a model with a name is measured once and cached
    assert calibration.calibrate_hf(method, model, WordIds()) == done
    assert len(list((tmp_path / "calibration").iterdir())) == 1


@pytest.mark.slow
@pytest.mark.model
def test_both_engines_calibrate_the_same_outlier_heads(model_dir, hf_dir, tmp_path, monkeypatch):
    """The op's full cache and transformers' give the same keys to the paper's calibration: the
    same 4 % of SmolLM2's 90 heads, and the op's pool then keeps them whole."""
    from ov_kvcrush.config import CompressionConfig, GenerationSettings
    from ov_kvcrush.engines.torch_engine import TorchEngine
    from ov_kvcrush.serving.openvino_engine import OpenVINOEngine

    monkeypatch.setenv("OV_KVCRUSH_CACHE", str(tmp_path))
    comp = CompressionConfig(method="chelsea", budget=128, options={"outlier_heads": "auto"})
    ov_engine = OpenVINOEngine(model_dir, compression=comp)
    pairs = ov_engine.method.outlier_heads
    assert len(pairs) == round(0.04 * ov_engine.shape.layers * ov_engine.shape.kv_heads)
    torch_engine = TorchEngine(hf_dir, compression=comp)
    assert torch_engine.method.outlier_heads == pairs
    assert len(list((tmp_path / "calibration").iterdir())) == 2  # one file per engine's model
    ov_engine.start_chat()  # the cache stays after the turn
    r = ov_engine.generate("Tell me about Paris. " * 30, GenerationSettings(max_new_tokens=2))
    held = ov_engine.sequence.head_tokens()
    ov_engine.finish_chat()
    for layer, head in pairs:
        assert held[layer, head] == r.prompt_tokens + 1  # whole: the prompt and the first token
    assert held.min() < 128
