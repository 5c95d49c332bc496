"""Set-up sanity check, run by ``make setup``: fail fast with the reason instead of later, deep in a test.

Checks the two pitfalls seen on this machine: a CUDA ``torchvision`` (pulled in by optimum-intel)
that breaks transformers with ``operator torchvision::nms does not exist``, and a torch that is
not the pinned CPU build; then that the evaluation data is there and that the CPU extension
(``plugins/cpu``) builds and loads into OpenVINO.
"""

from __future__ import annotations

import importlib.util
import sys

# Imported where used, inside functions: what pulls in openvino, openvino_genai,
# openvino_tokenizers, torch, transformers, heavy to import, so that importing this module stays
# light.


def main() -> int:
    problems = []
    if importlib.util.find_spec("torchvision") is not None:
        problems.append("torchvision is installed (breaks transformers here): pip uninstall -y torchvision")
    import torch

    if not torch.__version__.startswith("2.13.0"):
        problems.append(f"torch {torch.__version__} installed; the project pins torch==2.13.0 (CPU build)")
    try:
        from transformers import AutoModelForCausalLM  # noqa: F401
    except Exception as exc:  # pragma: no cover - reported, not expected
        problems.append(f"transformers does not import: {exc}")
    import openvino
    import openvino_genai  # noqa: F401
    import openvino_tokenizers  # noqa: F401

    try:  # the evaluation's offline text and word lists
        from ov_kvcrush import corpus

        corpus.essay_files()
        corpus.word_list("noun")
    except Exception as exc:
        problems.append(f"evaluation data: {exc}")

    isa = "?"
    try:  # the CPU extension (plugins/cpu): built here if needed, then loaded by OpenVINO and ctypes
        from ov_kvcrush.op import plugin

        plugin.shared_core()
        choice = plugin.bf16_choice_made()
        isa = f"{plugin.kernel_isa()}; bf16 prompt products: {choice.products}, {choice.why}"
    except Exception as exc:
        problems.append(f"CPU extension: {exc}")

    for p in problems:
        print(f"envcheck: {p}", file=sys.stderr)
    if not problems:
        print(f"envcheck: ok (torch {torch.__version__}, openvino {openvino.__version__}, CPU extension: {isa})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
