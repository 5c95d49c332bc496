"""Equal-memory budgets: the token budget at which each method holds a given number of KV bytes.

Methods spend bytes differently: a 2-bit store holds about seven times more tokens than float32
in the same bytes, ClusterKV and Quest keep every token and only bound what is attended, MiniKV
keeps every generated token, scores and positions cost metadata. Comparing methods "at budget
256" therefore compares different memory. :func:`solve_budget` finds, per method, the largest
budget whose cache holds at most the target bytes at the end of a generation of the given size.

The bytes are **measured, not modelled**: :func:`held_bytes` builds the method's real per-layer
caches for the model's shapes, feeds them a prompt of random keys/values and the decode steps,
and reads :meth:`~ov_kvcrush.methods.base.LayerCache.memory` (the same number the engine
reports, which tests check against the tensors' storage). What a cache holds depends on token
counts, not values, so random data gives the model's numbers; the prompt's attention output
and scores are supplied (:class:`~ov_kvcrush.methods.base.PromptMemo`) instead of computed,
which makes a probe cheap. Memory grows with the budget, so a bisection needs about
``log2(tokens)`` probes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.engines.hf_cache import CompressedCache, ModelShape
from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods.attention import AttentionOutput
from ov_kvcrush.methods.base import PromptMemo

#: Tokens in one KV block (OpenVINO's CPU paged-attention block is 32 tokens, its GPU block 16);
#: the solver's precision is stated in blocks of this many tokens of full-precision KV over all layers.
BLOCK_TOKENS = 16


def block_bytes(shape: ModelShape) -> int:
    """One block: :data:`BLOCK_TOKENS` tokens of full-precision KV in every layer."""
    return shape.full_kv_bytes(BLOCK_TOKENS)


#: tokens of random keys per layer a calibration is run on here (two of Chelsea's chunks)
NOISE_CALIBRATION_TOKENS = 512


def calibrated_on_noise(method: Any, shape: ModelShape, seed: int = 0) -> Any:
    """``method`` with what it calibrates on a model (Chelsea's ``outlier_heads="auto"``) measured
    on random keys of ``shape``'s global layers instead: no model is at hand here, and what a
    calibration changes in the bytes is how many heads it picks (a fixed share), not which."""
    if not method.needs_calibration:
        return method
    gen = torch.Generator().manual_seed(seed)
    layers = sum(kind != "sliding_attention" for kind in shape.layer_types)
    keys = [
        torch.randn(1, shape.kv_heads, NOISE_CALIBRATION_TOKENS, shape.head_dim, generator=gen) for _ in range(layers)
    ]
    return method.with_calibration(method.calibrate(keys))


def held_bytes(
    compression: CompressionConfig, shape: ModelShape, prompt_tokens: int, new_tokens: int, seed: int = 0
) -> int:
    """Bytes the method's cache holds after a ``prompt_tokens`` prompt and ``new_tokens`` decode steps.

    Measured on the method's real layer caches (see the module docstring).
    """
    if prompt_tokens < 1 or new_tokens < 0:
        raise ValueError(f"prompt_tokens={prompt_tokens}, new_tokens={new_tokens}: allowed >= 1 and >= 0")
    cache = CompressedCache(calibrated_on_noise(compression.method_config(), shape, seed), shape.model_config())
    gen = torch.Generator().manual_seed(seed)
    dtype = {4: torch.float32, 2: torch.float16}.get(shape.element_bytes, torch.float32)
    hq, hk, d = shape.q_heads, shape.kv_heads, shape.head_dim

    def rand(heads: int, tokens: int) -> torch.Tensor:
        return torch.randn(1, heads, tokens, d, generator=gen).to(dtype)

    for layer in cache.layers:
        lc = layer.method
        q, k, v = rand(hq, prompt_tokens), rand(hk, prompt_tokens), rand(hk, prompt_tokens)
        scores = torch.rand(1, hq, prompt_tokens, generator=gen)
        lc.prompt_memo = PromptMemo(q, k, v, torch.zeros_like(q), AttentionOutput(torch.zeros_like(q), scores))
        try:
            lc.prefill(q, k, v)
        finally:
            lc.prompt_memo = None
        for _ in range(new_tokens):
            lc.decode(rand(hq, 1), rand(hk, 1), rand(hk, 1))
    return cache.memory()["total"]


#: Budgets probed above the bisection's answer. A selection of whole spans over a quantized store
#: holds bytes that step down as well as up within a span or two of budget (measured in the op,
#: spans of 32 over the 4-bit store at 6k: 8.02 MB at budgets 815-831, 7.88 MB at 847-863), so a
#: bisection alone can stop a span below the largest budget that fits, and two configurations
#: with the same bytes per budget could be given different budgets. The bytes are constant over
#: runs of budgets (16 wide there), so every SCAN_STRIDE-th budget is probed, then the budgets
#: past the largest that fits, one by one: 15 probes, not 64 (on the torch reference at 4k a probe
#: costs about 0.7 s).
SCAN_TOKENS = 64
SCAN_STRIDE = 8


@dataclass(frozen=True)
class BudgetChoice:
    """The budget the solver gave one method.

    Attributes:
        label: the method as reported (e.g. ``kvcrush+2bit``).
        budget: the token budget (``None`` when no budget reaches the target).
        kv_bytes: bytes the method holds at that budget (at the smallest budget when unreachable).
        target_bytes: the target.
        status: ``ok`` (within one block below the target), ``all`` (even an uncompressed
            budget fits), ``fixed`` (its bytes do not depend on the budget: recall methods keep
            every token), ``unreachable`` (its smallest cache is larger than the target).
    """

    label: str
    budget: int | None
    kv_bytes: int
    target_bytes: int
    status: str

    def describe(self, block_bytes: int) -> str:
        mib = self.kv_bytes / 2**20
        if self.status == "unreachable":
            return f"{self.label}: no budget fits (smallest cache {mib:.2f} MiB)"
        gap = (self.target_bytes - self.kv_bytes) / block_bytes
        extra = {"all": " (holds every token)", "fixed": " (bytes do not depend on the budget)"}.get(self.status, "")
        return f"{self.label}: budget {self.budget} -> {mib:.2f} MiB, {gap:.2f} blocks under the target{extra}"


def solve_budget(
    label: str,
    make: Callable[[int], CompressionConfig],
    shape: ModelShape,
    prompt_tokens: int,
    new_tokens: int,
    target_bytes: int,
    probe: Callable[[CompressionConfig], int] | None = None,
    block: int | None = None,
    scan: int = SCAN_TOKENS,
) -> BudgetChoice:
    """The largest budget whose cache holds at most ``target_bytes`` (see :class:`BudgetChoice`).

    ``make(budget)`` builds the method's config (it may refuse small budgets with a
    :class:`~ov_kvcrush.errors.ConfigError`, e.g. below sinks + recent window: the search starts
    at the smallest accepted one). ``probe`` measures a config's bytes; :func:`held_bytes` by
    default. ``block``: the bytes under which a method's bytes count as not depending on the
    budget (:func:`block_bytes` of the shape by default; the op's block on backend openvino).
    ``scan``: how many budgets above the bisection's answer are probed too (:data:`SCAN_TOKENS`).
    """
    if target_bytes < 1:
        raise ConfigError("kv_bytes", target_bytes, "a positive number of bytes")
    measure = probe or (lambda c: held_bytes(c, shape, prompt_tokens, new_tokens))
    memo: dict[int, int] = {}

    def nbytes(budget: int) -> int:
        if budget not in memo:
            memo[budget] = measure(make(budget))
        return memo[budget]

    def valid(budget: int) -> bool:
        try:
            make(budget)
        except ConfigError:
            return False
        return True

    hi = prompt_tokens + new_tokens  # no method compresses below this many tokens seen
    if not valid(hi):
        return BudgetChoice(label, None, 0, target_bytes, "unreachable")
    lo_bad, lo = 0, hi  # smallest accepted budget: validity is monotone in the budget
    while lo - lo_bad > 1:
        mid = (lo + lo_bad) // 2
        lo, lo_bad = (mid, lo_bad) if valid(mid) else (lo, mid)
    if nbytes(lo) > target_bytes:
        return BudgetChoice(label, None, nbytes(lo), target_bytes, "unreachable")
    fixed = nbytes(hi) - nbytes(lo) < (block or block_bytes(shape))
    if nbytes(hi) <= target_bytes:
        return BudgetChoice(label, hi, nbytes(hi), target_bytes, "fixed" if fixed else "all")
    good, bad = lo, hi  # nbytes(good) <= target < nbytes(bad)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if nbytes(mid) <= target_bytes else (good, mid)
    # bytes grow with the budget only up to a span's jitter: the bisection found a crossing, and a
    # larger budget just above it may hold fewer bytes (SCAN_TOKENS): every SCAN_STRIDE-th budget
    # of the next `scan`, then each budget up to the next stride past the largest that fits
    top = min(good + scan, hi)
    fits = [b for b in range(good + SCAN_STRIDE, top + 1, SCAN_STRIDE) if nbytes(b) <= target_bytes]
    good = fits[-1] if fits else good
    for above in range(good + 1, min(good + SCAN_STRIDE - 1, top) + 1):
        if nbytes(above) <= target_bytes:
            good = above
    return BudgetChoice(label, good, nbytes(good), target_bytes, "fixed" if fixed else "ok")
