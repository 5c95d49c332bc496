"""The cache-layer API of the installed transformers against what :mod:`ov_kvcrush.engines.hf_cache` implements.

transformers changes its cache-layer interface between releases (``get_max_cache_shape`` became
``get_max_length``; ``is_croppable`` appeared). A release that adds an abstract method makes
``CompressedLayer`` impossible to instantiate, and one that adds a concrete method reading
``self.keys`` (which a compressed layer does not have) breaks at the first ``generate``. These
tests fail on such a release here, by name, instead of at a user's first call.
"""

from __future__ import annotations

import inspect
from importlib.metadata import requires

import pytest
import transformers
from packaging.requirements import Requirement
from transformers.cache_utils import Cache, CacheLayerMixin

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.engines.hf_cache import CompressedCache, CompressedLayer

#: Methods of the base layer whose own implementation is right for a compressed layer too.
INHERITED_ON_PURPOSE = {"__init__", "__repr__", "__init_subclass__", "__subclasshook__"}


def _callables(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_abc")}


def test_no_abstract_method_of_the_cache_layer_is_left_unimplemented():
    missing = sorted(getattr(CompressedLayer, "__abstractmethods__", set()))
    assert not missing, f"transformers {transformers.__version__} added abstract cache-layer methods: {missing}"
    assert not inspect.isabstract(CompressedCache)
    cache = CompressedCache(CompressionConfig().method_config(), _config())
    assert all(isinstance(layer, CompressedLayer) for layer in cache.layers)
    assert cache.layers[0].get_seq_length() == 0


def test_every_method_of_the_base_layer_is_our_own():
    """A base-layer method we inherit would act on ``keys``/``values`` we never fill."""
    inherited = sorted(_callables(CacheLayerMixin) - _callables(CompressedLayer) - INHERITED_ON_PURPOSE)
    assert not inherited, (
        f"transformers {transformers.__version__}'s CacheLayerMixin has methods CompressedLayer does not "
        f"implement: {inherited}"
    )


def test_the_cache_api_we_call_is_there():
    params = inspect.signature(Cache.update).parameters
    assert list(params)[:4] == ["self", "key_states", "value_states", "layer_idx"]
    assert "layers" in inspect.signature(Cache.__init__).parameters
    from transformers import AttentionInterface

    assert "ov_kvcrush" in AttentionInterface._global_mapping


def test_the_installed_transformers_is_in_the_declared_range():
    req = next(Requirement(d) for d in requires("ov_kvcrush") or [] if Requirement(d).name == "transformers")
    assert req.specifier, "pyproject.toml must bound transformers on both sides"
    assert any(s.operator == "<" for s in req.specifier) and any(s.operator == ">=" for s in req.specifier)
    assert req.specifier.contains(transformers.__version__), (
        f"transformers {transformers.__version__} is outside the checked range {req.specifier}"
    )


@pytest.mark.parametrize("name", ["get_max_length", "get_max_cache_shape"])
def test_no_maximum_length_under_either_name(name):
    layer = CompressedCache(CompressionConfig().method_config(), _config()).layers[0]
    assert getattr(layer, name)() == -1


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
