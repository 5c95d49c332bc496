"""Decoder families, as tiny random-weight checkpoints: what the model-coverage table is built on.

Users ask first whether KV compression works with *their* model. The op's graph pass and the torch
engine both make assumptions about how a family computes attention (where RoPE is applied, how
K/V are shaped and grouped, the scale, the mask, sliding windows, soft-capping). Each family here
is a small checkpoint built from transformers' own config class, with random weights (no
download), 2 layers and a GQA ratio other than SmolLM2's (3), saved with a small byte-level BPE
tokenizer so that it goes through exactly the path a user's checkpoint takes:
``ov-kvcrush export --model <dir>`` (optimum-intel, stateful SDPA), then our pass and engines.

Random weights prove mechanics (the op computes what the unmodified model computes, and what the
torch reference computes), not quality.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ov_kvcrush.corpus import essay_text, haystack_essays
from ov_kvcrush.models.staging import staging_dir
from ov_kvcrush.paths import cache_root

# Imported where used, inside functions: what pulls in tokenizers, torch, transformers, heavy to
# import, so that importing this module stays light.

#: The shape every family starts from: 8 query heads over 2 KV heads (GQA 4:1), head size 32.
BASE: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
#: the LM head's weights times this: logits of a spread like a trained model's (std ~3, not ~0.3)
LOGIT_SCALE = 10.0
#: Sliding-window span of the families with local layers (shorter than the tests' prompts, so it matters).
WINDOW = 96
#: Mistral's window, on every layer: its context (longer than the tests' prompts and answers).
MISTRAL_WINDOW = 512


@dataclass(frozen=True)
class Family:
    """One decoder family: its transformers ``model_type``, the fields that make it what it is
    (on top of :data:`BASE`), and why those fields were chosen."""

    name: str
    model_type: str
    fields: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    #: :data:`BASE` fields this family's config derives itself (Falcon's ``head_dim`` is a property)
    derived: tuple[str, ...] = ()
    #: why the compressed cache refuses this family (before any work), or "" when it runs it
    refused: str = ""
    #: whether optimum-intel exports it here (where not, ``refused`` says why; nothing tries)
    exportable: bool = True

    def config_fields(self) -> dict[str, Any]:
        return {k: v for k, v in {**BASE, **self.fields}.items() if k not in self.derived}


def _llama3_rope() -> dict[str, Any]:
    return dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        original_max_position_embeddings=128,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    )


def _longrope() -> dict[str, Any]:
    half = BASE["head_dim"] // 2
    return dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0 + 0.05 * i for i in range(half)],
        long_factor=[1.0 + 0.5 * i for i in range(half)],
        original_max_position_embeddings=128,
    )


_ALTERNATING = ["sliding_attention", "full_attention"]
_DEEPSEEK_MLA = dict(
    kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, num_key_value_heads=8,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
    first_k_dense_replace=1, n_group=1, topk_group=1,
)  # fmt: skip

FAMILIES: tuple[Family, ...] = (
    Family("llama3", "llama", dict(rope_parameters=_llama3_rope()), "Llama 3.x: llama3 RoPE scaling"),
    Family("qwen2", "qwen2", dict(num_key_value_heads=1), "Qwen2.5: q/k/v biases, multi-query (8:1)"),
    Family("qwen3", "qwen3", {}, "Qwen3: per-head q/k RMSNorm"),
    Family(
        "mistral",
        "mistral",
        dict(sliding_window=MISTRAL_WINDOW),
        "Mistral: a sliding window on every layer (the context is capped at it)",
    ),
    Family(
        "phi3",
        "phi3",
        dict(rope_parameters=_longrope(), original_max_position_embeddings=128, num_key_value_heads=4),
        "Phi-3: fused qkv projection, LongRoPE",
    ),
    Family(
        "gemma2",
        "gemma2",
        dict(sliding_window=WINDOW, query_pre_attn_scalar=24),
        "Gemma 2: attention soft-capping, local and global layers",
    ),
    Family(
        "gemma3",
        "gemma3_text",
        dict(sliding_window=WINDOW, layer_types=_ALTERNATING, query_pre_attn_scalar=24),
        "Gemma 3: local and global layers, q/k norms, a scale other than 1/sqrt(d)",
    ),
    Family(
        "granite",
        "granite",
        dict(attention_multiplier=0.05, embedding_multiplier=4.0, residual_multiplier=0.5, logits_scaling=2.0),
        "Granite: attention multiplier as the scale",
    ),
    Family("olmo2", "olmo2", {}, "OLMo 2: q/k RMSNorm over all heads"),
    Family("stablelm", "stablelm", dict(qk_layernorm=True, use_qkv_bias=True), "StableLM: partial RoPE (25%)"),
    Family(
        "falcon",
        "falcon",
        dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False, ffn_hidden_size=384),
        "Falcon: fused qkv, parallel attention",
        derived=("head_dim", "num_key_value_heads", "intermediate_size"),
        refused="transformers runs Falcon's attention in classes of its own (no attention-function hook), so the "
        "torch engine, the reference every method is checked against, cannot hold its cache",
    ),
    Family("gpt_neox", "gpt_neox", dict(num_key_value_heads=8), "GPT-NeoX (Pythia): multi-head, partial RoPE"),
    Family("starcoder2", "starcoder2", dict(num_key_value_heads=4), "StarCoder2: biases, LayerNorm"),
    Family("cohere", "cohere", dict(use_qk_norm=True), "Cohere (Command R): parallel block, q/k LayerNorm"),
    Family("smollm3", "smollm3", dict(no_rope_layer_interval=2), "SmolLM3: layers without RoPE"),
    Family("phi", "phi", dict(num_key_value_heads=8), "Phi-2: partial RoPE, dense head"),
    Family("glm", "glm", {}, "GLM-4: partial interleaved RoPE"),
    Family("gemma", "gemma", {}, "Gemma (1): GeGLU, scaled embeddings"),
    Family("olmo", "olmo", dict(clip_qkv=8.0), "OLMo: clipped q/k/v, LayerNorm without weights"),
    Family("arcee", "arcee", {}, "Arcee (AFM): ReLU² MLP"),
    Family(
        "cohere2",
        "cohere2",
        dict(sliding_window=WINDOW, layer_types=_ALTERNATING),
        "Command R7B: local layers with RoPE, global ones without",
    ),
    Family(
        "exaone4",
        "exaone4",
        dict(sliding_window=WINDOW, layer_types=_ALTERNATING),
        "EXAONE 4: local and global layers, q/k norms",
    ),
    Family("glm4", "glm4", {}, "GLM-4-0414: partial RoPE, post-norms"),
    Family("hunyuan", "hunyuan_v1_dense", {}, "Hunyuan dense: q/k norms"),
    Family(
        "granitemoe",
        "granitemoe",
        dict(num_local_experts=4, num_experts_per_tok=2, attention_multiplier=0.05),
        "Granite MoE",
    ),
    Family(
        "qwen2_moe",
        "qwen2_moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128),
        "Qwen1.5/2-MoE: a shared expert",
    ),
    Family("phimoe", "phimoe", dict(num_local_experts=4, num_experts_per_tok=2), "Phi-3.5-MoE"),
    Family(
        "deepseek_v3",
        "deepseek_v3",
        _DEEPSEEK_MLA,
        "DeepSeek-V3: multi-head latent attention",
        derived=("head_dim",),
        refused="optimum-intel 2.2 cannot export it under transformers 5 (its attention patch predates 5.x: "
        "tracing stops at an unexpected past_key_values argument)",
        exportable=False,
    ),
    Family(
        "gpt_oss",
        "gpt_oss",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, layer_types=_ALTERNATING),
        "gpt-oss: attention sinks, local and global layers, MoE",
        refused="its attention has sinks (a learned logit per head in the softmax's denominator), which the "
        "compressed cache's attention does not compute",
    ),
    Family("mixtral", "mixtral", dict(num_local_experts=4, num_experts_per_tok=2), "Mixtral: MoE"),
    Family(
        "qwen3_moe",
        "qwen3_moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1),
        "Qwen3-MoE",
    ),
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)


def verified_model_types() -> tuple[str, ...]:
    """The model types the compressed cache runs: those of the families it is verified on."""
    return tuple(dict.fromkeys(f.model_type for f in FAMILIES if not f.refused))


def refused_families() -> dict[str, str]:
    """Model type -> why the compressed cache refuses it."""
    return {f.model_type: f.refused for f in FAMILIES if f.refused}


def family(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"unknown family {name!r}: known {', '.join(FAMILY_NAMES)}")


def _training_text() -> str:
    return essay_text(haystack_essays()[0])[:20000]


def tiny_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of ``vocab_size`` ids trained on one essay (deterministic), with
    a ChatML template: the same kind of tokenizer SmolLM2 has, small enough for a tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_training_text()], trainer)
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=template,
        clean_up_tokenization_spaces=False,
    )


def randomize_vectors(model) -> None:
    """Give norms' weights and biases a spread, as trained ones have. Initialised to 1, a q/k norm
    makes every key's norm equal, and a method that ranks keys by norm (Knorm) then ranks float
    noise; initialised to 0, a q/k/v bias (Qwen2, StarCoder2) would not be checked at all."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.2 * torch.randn_like(param))


def checkpoint_dir(fam: Family) -> Path:
    key = json.dumps([fam.model_type, fam.config_fields(), _RECIPE], sort_keys=True)
    return cache_root() / "families" / f"{fam.name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


#: Bump when the checkpoint recipe changes (seed, tokenizer), so cached checkpoints are rebuilt.
_RECIPE = 3


def tiny_checkpoint(name: str) -> Path:
    """The tiny random-weight HF checkpoint of family ``name`` (built once per machine, cached;
    written to a staging directory and renamed into place, so a half-written one is never used)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fam = family(name)
    out = checkpoint_dir(fam)
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with staging_dir(out.parent, ".tmp-family-") as tmp:
        stage = tmp / "hf"
        config = AutoConfig.for_model(fam.model_type, **fam.config_fields())
        tok = tiny_tokenizer(config.vocab_size)
        config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
        config.pad_token_id = tok.pad_token_id
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        randomize_vectors(model)
        with torch.no_grad():  # logits spread as a trained model's are (init gives ~0.3: every step a near tie)
            model.get_output_embeddings().weight.mul_(LOGIT_SCALE)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.bos_token_id = tok.bos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(stage)
        tok.save_pretrained(stage)
        if out.exists():
            shutil.rmtree(out)
        stage.rename(out)
    return out
