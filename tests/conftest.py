"""Shared fixtures: the exported embedded model is built once per machine (cached) and reused."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (tests/test_kernels.py):
# the switch is read when a kernel is defined, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def model_dir():
    from ov_kvcrush.models.export import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def full_engine(model_dir):
    from ov_kvcrush.engines.genai import GenAIEngine

    return GenAIEngine(model_dir)


@pytest.fixture(scope="session")
def hf_dir():
    """The embedded model as a Hugging Face checkpoint (the torch engine's input), converted once and cached."""
    from ov_kvcrush.models.export import hf_checkpoint

    return hf_checkpoint(progress=False)


@pytest.fixture(scope="module")
def ov_core():
    """An OpenVINO core with the CPU extension (the op) added, as the pipelines load it."""
    from ov_kvcrush.op import plugin

    return plugin.shared_core()
