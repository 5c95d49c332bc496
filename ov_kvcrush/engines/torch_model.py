"""Loading a transformers model for the torch engine: the device, the dtype, the supported families.

The torch engine and transformers' own baselines (:mod:`~ov_kvcrush.engines.hf_baseline`) load
through here; a bad device or dtype is refused before any loading work.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ov_kvcrush.engines.hf_cache import ATTN_IMPLEMENTATION
from ov_kvcrush.engines.model_family import check_family
from ov_kvcrush.engines.random_model import build_random_model, is_random_model
from ov_kvcrush.errors import ConfigError, UserError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """``cpu``/``CPU`` or ``cuda``/``cuda:N``/``GPU``; a clear error when CUDA is not there."""
    name = device.lower()
    if name == "gpu":
        name = "cuda"
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("device", device, "cpu (no CUDA device is available on this machine)")
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise ConfigError("device", device, "cpu, cuda or cuda:N") from None
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError("device", device, f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        return dev
    raise ConfigError("device", device, "cpu, cuda or cuda:N (backend torch)")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (what the exported checkpoint holds), bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, "auto, " + ", ".join(DTYPES))
    return DTYPES[dtype]


def load_model(model_dir: str | Path, device: str = "cpu", dtype: str = "auto", attn: str = ATTN_IMPLEMENTATION):
    """Load an HF causal LM for the compressed cache; returns ``(model, tokenizer)``.

    ``attn`` can be any transformers attention implementation (``sdpa``, ``eager``): tests load
    the same checkpoint both ways to compare.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

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
