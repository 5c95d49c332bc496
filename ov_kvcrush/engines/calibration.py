"""Calibrating a method on the model, once (Chelsea's ``outlier_heads="auto"``).

Chelsea's paper finds its outlier heads offline: the heads whose keys merge worst on some text
(Appendix B). A user should not run that by hand, so an engine does it when a method asks
(:attr:`~ov_kvcrush.methods.MethodConfig.needs_calibration`): it prefills
:data:`CALIBRATION_TOKENS` tokens of the corpus's first essays with a full cache, hands each
method layer's keys to :meth:`~ov_kvcrush.methods.MethodConfig.calibrate`, and builds its layers
from :meth:`~ov_kvcrush.methods.MethodConfig.with_calibration`. The result is cached per model
and method under ``$OV_KVCRUSH_CACHE/calibration/`` (written whole, then renamed: a half-written
file is never read; an unreadable one is measured again).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ov_kvcrush.corpus import essay_text, haystack_essays
from ov_kvcrush.engines.model_family import sliding_context
from ov_kvcrush.errors import UserError
from ov_kvcrush.outputs import write_atomic
from ov_kvcrush.paths import cache_root

# Imported where used, inside functions: what pulls in numpy, transformers, heavy to import, so that
# importing this module stays light.

#: tokens of calibration text (the essays are the evaluation's haystack prose)
CALIBRATION_TOKENS = 2048
#: how many essays are joined for the text (each is a few thousand tokens)
CALIBRATION_ESSAYS = 3


def calibration_ids(encode: Callable[[str], list[int]], tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The first ``tokens`` ids of the calibration text (no template)."""

    text = " ".join(essay_text(p) for p in haystack_essays()[:CALIBRATION_ESSAYS])
    ids = encode(text)
    if len(ids) < tokens:
        raise UserError(f"the calibration text has {len(ids)} tokens; {tokens} are needed")
    return ids[:tokens]


def cache_file(model_id: str, method: Any) -> Path:
    """Where the calibration of ``method`` on the model ``model_id`` names is kept."""
    digest = hashlib.sha256(f"{model_id}|{CALIBRATION_TOKENS}".encode()).hexdigest()[:16]
    return cache_root() / "calibration" / f"{method.calibration_key()}-{digest}.json"


def model_id(path: str | Path) -> str:
    """A model directory's identity for the cache: its path and its files' sizes and times (a
    re-exported model is calibrated again)."""
    p = Path(path).resolve()
    if not p.exists():  # a random-weight architecture (random:<name>): its name is its identity
        return str(path)
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    return "|".join([str(p), *(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)])


def resolve(
    method: Any,
    model: str | None,
    encode: Callable[[str], list[int]],
    layer_keys: Callable[[list[int]], list[torch.Tensor]],
) -> Any:
    """``method`` with its calibrated fields: from the cache, or measured now (``layer_keys``: a
    full cache's keys per method layer after prefilling the ids it is given) and cached. ``model``
    ``None``: a model with no identity to cache under, measured each time."""
    if not method.needs_calibration:
        return method
    if model is None:
        return method.with_calibration(method.calibrate(layer_keys(calibration_ids(encode))))
    path = cache_file(model, method)
    try:
        return method.with_calibration(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not cached yet (or unreadable): measure
    fields = method.calibrate(layer_keys(calibration_ids(encode)))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(fields)))
    return method.with_calibration(fields)


def hf_layer_keys(model: Any, ids: list[int]) -> list[torch.Tensor]:
    """transformers: ``ids`` prefilled into a full cache of our own (``model`` unchanged), then each
    global layer's keys ``[1, kv_heads, n, d]`` in float32 on the CPU."""
    from ov_kvcrush.engines.hf_cache import CompressedCache
    from ov_kvcrush.methods import FullConfig

    cache = CompressedCache(FullConfig(), model.config)
    ids = ids[: sliding_context(model.config.to_dict()) or len(ids)]  # every layer slides: within the window
    with torch.inference_mode():
        x = torch.tensor([ids], device=model.device)
        model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [layer.method.store.dense()[0].float().cpu() for layer in cache.layers if not layer.is_sliding]


def calibrate_hf(method: Any, model: Any, tokenizer: Any, source: str | Path | None = None) -> Any:
    """``method`` calibrated on a transformers ``model`` (once; cached like an engine's): what a
    user of :class:`~ov_kvcrush.engines.hf_cache.CompressedCache` with plain transformers calls
    before building the cache, e.g. for Chelsea's default ``outlier_heads="auto"``. ``source``:
    where the model came from (default: its config's ``_name_or_path``); a model built from a
    config has none and is measured each time."""
    source = source or getattr(model.config, "_name_or_path", "")
    return resolve(
        method,
        "torch|" + model_id(source) if source else None,
        lambda text: list(tokenizer(text, add_special_tokens=False).input_ids),
        lambda ids: hf_layer_keys(model, ids),
    )


def op_layer_keys(engine: Any, ids: list[int]) -> list[torch.Tensor]:
    """Backend openvino: ``ids`` prefilled into a full f32 cache of its own (the engine's compiled
    model; its own sequence is untouched), then each global layer's keys ``[1, kv_heads, n, d]``."""
    import numpy as np

    from ov_kvcrush.op.kvcache import KVPool, infer_steps

    s = engine.shape
    pool = KVPool(s.layers, s.q_heads, s.kv_heads, s.head_dim, precision="f32", windows=engine.windows)
    ids = ids[: sliding_context(engine.hf_config) or len(ids)]  # every layer slides: within the window
    try:
        seq = pool.new_sequence()
        infer_steps(engine.request, engine.step_inputs([ids], [seq], [0]), [seq.handle])
        return [
            torch.from_numpy(np.stack([seq.read_head(layer, g)[1] for g in range(s.kv_heads)]))[None]
            for layer in range(s.layers)
            if not engine.windows[layer]
        ]
    finally:
        pool.close()


__all__ = [
    "CALIBRATION_TOKENS",
    "cache_file",
    "calibrate_hf",
    "calibration_ids",
    "hf_layer_keys",
    "model_id",
    "op_layer_keys",
    "resolve",
]
