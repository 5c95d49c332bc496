"""Random-weight models of named architectures: GPU speed benchmarks without downloads.

``--model random:llama-3-8b`` builds Llama-3-8B's shape (32 layers, 32 query / 8 KV heads of
128, 14336-wide MLP, 128256-token vocabulary) with random weights, directly on the device and in
the run's dtype. Speed and memory depend on the shape alone, so TTFT, TPOT and KV bytes are the
real model's; the text is noise, so results are **speed-only** (the bench marks them so and
makes no quality claim).

The tokenizer is byte-level (one token per UTF-8 byte, ids 3..258; a longer vocabulary's other
ids decode to nothing): the bench's prompts keep their exact token counts and no tokenizer files
are needed. Rotary scaling (Llama 3.1's ``llama3`` rope type) is left out: it changes the
frequencies, not the cost.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

from ov_kvcrush.errors import ConfigError

# Imported where used, inside functions: what pulls in tokenizers, torch, transformers, heavy to
# import, so that importing this module stays light.

RANDOM_PREFIX = "random:"

#: name -> the config fields of that architecture (all Llama-family: the torch engine's cache
#: and the op's transformation both take them).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    # small enough for tests on a CPU
    "tiny-llama": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
}  # fmt: skip

#: the byte tokenizer's special tokens (ids 0..2) and its first byte id
BYTE_OFFSET = 3


def is_random_model(model: object) -> bool:
    """Whether ``model`` names a random-weight architecture (``random:<name>``, and no such path exists)."""
    return isinstance(model, (str, os.PathLike)) and str(model).startswith(RANDOM_PREFIX) and not Path(model).exists()


def random_architecture(model: str) -> dict[str, Any]:
    """The config fields of ``random:<name>`` (what a plan or a check needs, without importing
    transformers: seconds in a fresh interpreter); an unknown name is refused, listing the known ones."""
    name = str(model)[len(RANDOM_PREFIX) :] if is_random_model(model) else str(model)
    if name not in ARCHITECTURES:
        raise ConfigError(
            "model", model, "a path, or random:<architecture> with one of " + ", ".join(sorted(ARCHITECTURES))
        )
    return ARCHITECTURES[name]


def random_config(model: str) -> Any:
    """The transformers config of ``random:<name>`` (:func:`random_architecture`'s fields)."""
    from transformers import LlamaConfig

    return LlamaConfig(**random_architecture(model), bos_token_id=1, eos_token_id=2, pad_token_id=0)


def byte_tokenizer() -> Any:
    """A byte-level ``PreTrainedTokenizerFast``: every UTF-8 byte is one token, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    # ByteLevel maps byte b to a printable character; order them by byte value
    for i, ch in enumerate(sorted(alphabet, key=_byte_of)):
        vocab[ch] = BYTE_OFFSET + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
        clean_up_tokenization_spaces=False,
    )


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes-to-unicode map, inverted)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


#: models built in this process, shared by the engines that ask for the same one (weakly held)
_BUILT: weakref.WeakValueDictionary[tuple[str, str, str, str], Any] = weakref.WeakValueDictionary()


def build_random_model(model: str, device: Any, dtype: Any, attn: str) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the architecture with seeded random weights, built on ``device`` in ``dtype``.

    The weights depend only on the architecture (seeded), so engines in one process that ask for
    the same architecture, device, dtype and attention share one model: a bench run of several
    methods on a Llama-3-8B shape holds 16 GB of weights once, not once per configuration.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = random_config(model)
    key = (str(model), str(device), str(dtype), attn)
    net = _BUILT.get(key)
    if net is None:
        torch.manual_seed(0)  # the same weights in every engine of a run (torch vs hf-sdpa compare tokens)
        with torch.device(device):
            net = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn).eval()
        _BUILT[key] = net
    return net, byte_tokenizer()
