"""Loading a transformers model for the torch engine: the supported families, on a checked device and dtype.

The torch engine and transformers' own baselines (:mod:`~ov_kvcrush.engines.hf_baseline`) load
through here; a bad device or dtype is refused before any loading work.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ov_kvcrush.engines.hf_cache import ATTN_IMPLEMENTATION
from ov_kvcrush.engines.model_family import check_family
from ov_kvcrush.engines.random_model import build_random_model, is_random_model
from ov_kvcrush.engines.torch_device import resolve_device, resolve_dtype
from ov_kvcrush.errors import UserError


def load_model(model_dir: str | Path, device: str = "cpu", dtype: str = "auto", attn: str = ATTN_IMPLEMENTATION):
    """Load an HF causal LM for the compressed cache; returns ``(model, tokenizer)``.

    ``attn`` can be any transformers attention implementation (``sdpa``, ``eager``): tests load
    the same checkpoint both ways to compare.
    """

    dev = resolve_device(device)  # refuse a bad device/dtype before any loading work
    dt = resolve_dtype(dtype, dev)
    if is_random_model(model_dir):  # random:<architecture>, speed only (engines/random_model.py)
        return build_random_model(str(model_dir), dev, dt, attn)
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise UserError(f"not a Hugging Face model directory (no config.json): {path}")
    # a family not verified, or one whose attention the cache does not compute, is refused here
    check_family(AutoConfig.from_pretrained(path).to_dict(), path.name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation=attn).to(dev).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
