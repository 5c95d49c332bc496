"""Native ``openvino_genai`` on OpenVINO's GPU plugin under the emulation layer, beside CPU: the
embedded model's greedy text on both (:mod:`ov_kvcrush.gpu.emulation` runs the plugin on Intel's
OpenCL CPU runtime).

    python -m ov_kvcrush.tools.gpu_native
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from ov_kvcrush.gpu import emulation, runtime
from ov_kvcrush.models.export import ensure_default_model
from ov_kvcrush.op import plugin

# Imported where used, inside functions: what pulls in openvino_genai, heavy to import, so that
# importing this module stays light.

#: the prompt and length (the plugin compiles the model in about 30 s on 2 cores)
NATIVE_PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
NATIVE_TOKENS = 12


@dataclass(frozen=True)
class NativeResult:
    """Native ``openvino_genai`` greedy text on the plugin's ``GPU`` beside ``CPU``."""

    device: str
    texts: dict[str, str]
    seconds: dict[str, float]


def native_greedy(prompt: str, new_tokens: int) -> NativeResult:
    """The embedded model through native ``openvino_genai.LLMPipeline`` (its stateful SDPA path,
    in f32) on the plugin's ``GPU`` and on ``CPU``, greedy (:func:`~ov_kvcrush.gpu.emulation.enable` called first)."""
    import openvino_genai  # heavy: only once the emulation layer is enabled

    device = emulation.plugin_device(plugin.shared_core())
    path = str(ensure_default_model("fp32", progress=False))
    config = openvino_genai.GenerationConfig(max_new_tokens=new_tokens, do_sample=False)
    texts, seconds = {}, {}
    for name in ("CPU", "GPU"):
        t0 = time.perf_counter()
        pipe = openvino_genai.LLMPipeline(path, name, INFERENCE_PRECISION_HINT="f32")
        texts[name] = str(pipe.generate(prompt, config))
        seconds[name] = round(time.perf_counter() - t0, 2)
    return NativeResult(device, texts, seconds)


def main() -> int:
    try:
        emulation.enable()
        native = native_greedy(NATIVE_PROMPT, NATIVE_TOKENS)
    except runtime.GPUPathError as e:
        print(f"gpu_native: {e}", file=sys.stderr)
        return 2
    for name, text in native.texts.items():
        print(f"{name} ({native.seconds[name]} s, compile included): {text!r}")
    same = native.texts["CPU"] == native.texts["GPU"]
    verdict = "equals" if same else "differs from"
    print(f"native greedy text on the plugin's GPU ({native.device}) {verdict} CPU's")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
