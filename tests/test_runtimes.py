"""Where each method runs: every runtime's registration held to the methods' declarations, the
refusals derived from them, and the support table generated from them."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.errors import ConfigError
from ov_kvcrush.fastpath import FAST_LAYERS, fast_layer
from ov_kvcrush.gpu.device_layers import DEVICE_LAYERS, PLUGIN_LAYERS
from ov_kvcrush.methods import REGISTRY, method_config, methods_on, require, support_table
from ov_kvcrush.methods.runtimes import BY_NAME, RUNTIMES, refusal, runs

ROOT = Path(__file__).resolve().parents[1]

#: a config of each method that some runtime refuses, and the option it sets
REFUSED = {
    "clusterkv": ({"track_recall": True}, "track_recall"),
    "quest": ({"track_recall": True}, "track_recall"),
    "snapkv": ({"head_budgets": "adaptive"}, "head_budgets"),
    "h2o": ({"block_size": 16}, "block_size"),
    "streamingllm": ({"quant": True}, "quant"),
    "minikv": ({"quant": None}, "quant"),
    "chelsea": ({"quant": True}, "quant"),
}


def test_each_runtime_registers_exactly_the_methods_that_declare_it():
    """The CUDA fast path's and the Intel GPU pool's builders are keyed by the methods that declare
    those runtimes (the C++ op's table is held in ``test_op_methods``)."""
    assert set(FAST_LAYERS) == set(methods_on("cuda"))
    assert set(DEVICE_LAYERS) == set(methods_on("gpu-pool"))
    assert set(PLUGIN_LAYERS) == set(methods_on("gpu-plugin"))


def test_the_gpu_plugin_runs_over_the_pools_layers():
    """Each sequence on device GPU is the pool's layer caches, but for those only the plugin's
    model steps drive (KVzip's scoring pass): the plugin runs no option of a method the pool runs
    that the pool does not."""
    for name in methods_on("gpu-plugin"):
        if name not in DEVICE_LAYERS:
            assert PLUGIN_LAYERS[name] is not None and name not in methods_on("gpu-pool"), name
            continue
        plugin, pool = REGISTRY[name].runtimes["gpu-plugin"], REGISTRY[name].runtimes["gpu-pool"]
        assert set(pool) <= set(plugin), name
        assert PLUGIN_LAYERS[name] is DEVICE_LAYERS[name], name


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refused_option_is_named_with_the_runtimes_that_run_it(name):
    options, option = REFUSED[name]
    config = CompressionConfig(name, 256, options=options).method_config()
    refusing = [r.name for r in RUNTIMES if r.name in config.runtimes and refusal(config, r.name) is not None]
    assert refusing, name
    for runtime in refusing:
        assert not runs(config, runtime)
        with pytest.raises(ConfigError, match=f"options.{option}=") as caught:
            require(config, runtime)
        running = [BY_NAME[r].title for r in config.runtimes if r not in refusing]
        assert caught.value.allowed.endswith("runs on: " + "; ".join(running)), (runtime, caught.value.allowed)
    require(config, "reference")  # the oracle runs every config


def test_a_method_a_runtime_does_not_run_is_named_with_the_ones_it_does():
    config = method_config("kvzip", budget=256)
    with pytest.raises(ConfigError, match=r"method='kvzip' is invalid: allowed one of full, .* kvcrush, .*runs on:"):
        require(config, "gpu-pool")


def test_where_a_method_says_why_a_runtime_does_not_run_it_the_refusal_and_the_table_say_it():
    from ov_kvcrush.methods.runtimes import check_declaration

    for name, cls in REGISTRY.items():
        for runtime, why in cls.not_run_because.items():
            with pytest.raises(ConfigError, match=f"not {name}: " + why[:40].replace("(", r"\(")):
                require(method_config(name, budget=256), runtime)
            row = next(line for line in support_table().splitlines() if line.startswith(f"| `{name}` "))
            assert f"no: {why}" in row.split(" | ")[1 + [r.name for r in RUNTIMES].index(runtime)], (name, runtime)
    with pytest.raises(TypeError, match="not_run_because"):  # a reason for a runtime that runs the method
        check_declaration("x", {"reference": (), "cpu-op": ()}, {"cpu-op": "because"})


def test_a_runtime_that_does_not_run_a_method_says_why_where_the_method_does():
    """Every method runs on device GPU now (issue 71); the reason a method may give is still
    the refusal's and the table's, shown here on a method of the reference alone."""
    from ov_kvcrush.methods import FullConfig
    from ov_kvcrush.methods.runtimes import Declaration, support_cell

    class ReferenceOnly(FullConfig):
        runtimes: ClassVar[Declaration] = {"reference": ()}
        not_run_because: ClassVar[dict[str, str]] = {"gpu-plugin": "no device kernels for it"}

    with pytest.raises(ConfigError, match=r"\(our GPU plugin layers.*; not full: no device kernels for it\)"):
        require(ReferenceOnly(), "gpu-plugin")
    assert support_cell(ReferenceOnly, "gpu-plugin") == "no: no device kernels for it"
    assert support_cell(ReferenceOnly, "cpu-op") == ""


def test_the_cuda_fast_path_takes_the_reference_for_what_it_refuses():
    """Where ``cuda`` refuses a config the torch engine runs the reference (no error)."""
    for name, (options, _) in REFUSED.items():
        config = CompressionConfig(name, 256, options=options).method_config()
        if "cuda" in config.runtimes and not runs(config, "cuda"):
            assert fast_layer(config, 0, 4) is None, name
    assert fast_layer(method_config("snapkv", budget=256), 0, 4) is not None


def test_the_support_table_is_generated_from_the_declarations():
    assert (ROOT / "docs" / "support.md").read_text() == support_table()
    assert "](docs/support.md)" in (ROOT / "README.md").read_text()  # its short form: the methods table
    table = support_table()
    for name, cls in REGISTRY.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` "))
        assert row.count("| yes") == len(cls.runtimes), name
