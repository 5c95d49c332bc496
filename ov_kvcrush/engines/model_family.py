"""What a model's ``config.json`` says about its attention, read once for every engine.

* **Its family**: the op's graph pass and the torch engine's cache rely on how a family computes
  attention (RoPE before the cache, K/V shapes and groups, the scale, the mask). A family is run
  only once it has been verified (:mod:`ov_kvcrush.models.families`: full-cache logits equal the
  unmodified model's, every method's tokens equal the torch reference's); any other is refused
  before any work, with the families that are verified, never run to give wrong tokens silently.
* **Its sliding windows**, as transformers applies them: per layer from ``layer_types`` (Gemma 2
  and 3, Cohere 2); on every layer when there are no layer types and ``sliding_window`` is set
  (Mistral, Mixtral, StarCoder2, Phi-3), unless ``use_sliding_window`` is off (Qwen2's configs).
* **Its attention soft-capping** (Gemma 2), which optimum's export drops and our attention applies.
* **The context the compressed cache gives it**: a model whose every layer slides has no global
  layer to hold a method, so the compressed cache runs the method on every layer, which is exact
  only while the sequence fits the window: its context is capped at the window (every engine
  refuses longer requests up front, :func:`~ov_kvcrush.engines.base.check_context`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ov_kvcrush.errors import UserError
from ov_kvcrush.models.families import refused_families, verified_model_types


def text_config(cfg: dict) -> dict:
    """The language model's part of a config (a multimodal model's ``text_config``)."""
    return cfg.get("text_config") or cfg


def refusal(cfg: dict) -> str:
    """Why the compressed cache refuses a model of this config, naming its family and what it
    breaks ("" when it runs it)."""
    text = text_config(cfg)
    model_type = text.get("model_type")
    refused = refused_families().get(str(model_type))
    if refused:
        return f"model type {model_type!r} is refused: {refused}"
    if model_type not in verified_model_types():
        return (
            f"model type {model_type!r} has not been verified with the compressed cache (its logits "
            "and tokens against the unmodified model's); verified: " + ", ".join(verified_model_types())
        )
    return ""


def attention_softcap(cfg: dict) -> float:
    """The model's attention soft-capping (Gemma 2's ``attn_logit_softcapping``: each scaled logit
    becomes ``cap * tanh(s / cap)``), 0 for none. optimum's export drops it (its SDPA has no such
    input), so an engine that runs the model's attention itself reads it from here."""
    cap = text_config(cfg).get("attn_logit_softcapping")
    if cap is None:
        return 0.0
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0 or cap == float("inf"):
        raise UserError(f"config.json: attn_logit_softcapping={cap!r} is invalid: allowed null or a positive number")
    return float(cap)


def check_family(cfg: dict, name: str) -> None:
    """Raise :func:`refusal`'s reason, if any, naming the model (``name``: its directory)."""
    reason = refusal(cfg)
    if reason:
        raise UserError(f"{name}: {reason}")


def family_refusal(model_dir: Path) -> str:
    """:func:`refusal` of the model at ``model_dir`` ("" also when it has no readable config: the
    engine that loads it says what is wrong)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return refusal(cfg)


def layer_windows(cfg: dict) -> list[int]:
    """Per layer, its sliding-window span (0: a global layer), as transformers applies them."""
    text = text_config(cfg)
    layers = int(text.get("num_hidden_layers") or 0)
    window = int(text.get("sliding_window") or 0)
    layer_types = [str(t) for t in text.get("layer_types") or []]
    if layer_types:
        sliding = [t == "sliding_attention" for t in layer_types]
        if any(sliding) and window < 1:
            raise UserError(f"model type {text.get('model_type')!r} has sliding-window layers but no sliding_window")
        return [window if s else 0 for s in sliding]
    if window and text.get("use_sliding_window", True) is not False:
        return [window] * layers
    return [0] * layers


def sliding_context(cfg: dict) -> int:
    """The window, when every layer slides (the compressed cache's context); else 0 (no cap)."""
    windows = layer_windows(cfg)
    return min(windows) if windows and all(windows) else 0
