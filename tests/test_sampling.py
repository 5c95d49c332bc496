"""The serving loop's one sampler (``engines/sampling.py``) against transformers' logits
processors (issue 73, item 2): the repetition penalty, top-k, top-p and min-p as transformers
applies them, OpenAI's frequency and presence penalties as OpenAI defines them, end-of-sequence
held back before ``min_new_tokens``, and a seedless request's fresh randomness."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ov_kvcrush.config import GenerationSettings
from ov_kvcrush.engines.sampling import (
    HOST_SAMPLER_SETTINGS,
    adjusted_logits,
    refuse_host_sampler_settings,
    sample_token,
    sampling_probs,
)
from ov_kvcrush.errors import ConfigError

VOCAB = 50


def _logits(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, VOCAB).astype(np.float32)


def _transformers_probs(logits: np.ndarray, s: GenerationSettings, history: list[int]) -> np.ndarray:
    """transformers' processors in ``generate``'s order over the same logits and history."""
    ids = torch.tensor([history], dtype=torch.long)
    x = torch.tensor(logits, dtype=torch.float64)[None]
    x = RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(ids, x)
    x = TemperatureLogitsWarper(s.temperature)(ids, x)
    if s.top_k:
        x = TopKLogitsWarper(s.top_k)(ids, x)
    if s.top_p < 1.0:
        x = TopPLogitsWarper(s.top_p)(ids, x)
    if s.min_p:
        x = MinPLogitsWarper(s.min_p)(ids, x)
    return torch.softmax(x, -1)[0].numpy()


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 7},
        {"top_p": 0.8},
        {"min_p": 0.05},
        {"repetition_penalty": 1.3, "top_k": 20, "top_p": 0.9},
        {"repetition_penalty": 0.8, "min_p": 0.1, "temperature": 0.9},
    ],
)
def test_the_distribution_is_transformers_processors(fields):
    s = GenerationSettings(do_sample=True, **fields)
    for seed in range(5):
        logits = _logits(seed)
        prompt, generated = [3, 4, 4, 9, 17], [9, 30, 30, 2]
        got = sampling_probs(adjusted_logits(logits, s, prompt, generated), s)
        want = _transformers_probs(logits, s, prompt + generated)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def test_frequency_and_presence_penalties_are_openais_over_the_answer_alone():
    """``logit - count * frequency_penalty - (count > 0) * presence_penalty`` over the generated
    tokens (OpenAI's parameter details); the prompt's tokens are not counted."""
    s = GenerationSettings(frequency_penalty=0.5, presence_penalty=0.25)
    logits = _logits(1)
    prompt, generated = [1, 2, 2], [2, 5, 5, 5, 7]
    want = logits.astype(np.float64)
    for token, count in {2: 1, 5: 3, 7: 1}.items():
        want[token] -= count * 0.5 + 0.25
    np.testing.assert_array_equal(adjusted_logits(logits, s, prompt, generated), want)
    # greedy decoding follows the penalized logits too
    top = int(np.argmax(logits))
    heavy = GenerationSettings(presence_penalty=2.0, frequency_penalty=2.0)
    assert sample_token(logits, heavy, None, [], [top] * 10) != top


def test_end_of_sequence_waits_for_min_new_tokens_and_a_seed_repeats_a_draw():
    s = GenerationSettings(do_sample=True, seed=3)
    logits = np.full(VOCAB, -5.0, np.float32)
    logits[0] = 20.0  # token 0 (the end) is all but certain
    assert sample_token(logits, s, np.random.default_rng(3)) == 0
    assert sample_token(logits, s, np.random.default_rng(3), banned=[0]) != 0
    flat = np.zeros(VOCAB, np.float32)
    draws = [sample_token(flat, s, np.random.default_rng(s.seed)) for _ in range(5)]
    assert len(set(draws)) == 1  # one seed, one draw
    fresh = [sample_token(flat, s, np.random.default_rng(None)) for _ in range(20)]
    assert len(set(fresh)) >= 10  # no seed: fresh randomness (50 equally likely tokens)


def test_settings_out_of_range_and_backends_without_them_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"min_p=1.5 is invalid: allowed a number in \[0.0, 1.0\]"):
        GenerationSettings(min_p=1.5)
    with pytest.raises(ConfigError, match=r"frequency_penalty=3"):
        GenerationSettings(frequency_penalty=3)
    with pytest.raises(ConfigError, match=r"min_new_tokens=40 is invalid"):
        GenerationSettings(max_new_tokens=32, min_new_tokens=40)
    assert GenerationSettings(seed=None).seed is None
    refuse_host_sampler_settings(GenerationSettings(), "torch")
    for name, neutral in HOST_SAMPLER_SETTINGS.items():
        value = 1 if name == "min_new_tokens" else 0.5 if neutral == 0.0 else 1.2
        with pytest.raises(ConfigError, match=rf"{name}=.* on backend torch \(backends openvino and genai apply it\)"):
            refuse_host_sampler_settings(GenerationSettings(**{name: value}), "torch")
