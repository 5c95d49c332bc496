"""The reference attention against a brute-force oracle: one query, one head, one key at a time."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ov_kvcrush.methods.attention as attention
from ov_kvcrush.methods.attention import ShapeError, attend


def brute(q, k, v, qpos, kpos, bias, key_mask, scale, window):
    """Loops over batch, query head, query and key; float64; returns (output, summed probabilities)."""
    b, hq, t, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    g = hq // hk
    out = torch.zeros(b, hq, t, d, dtype=torch.float64)
    scores = torch.zeros(b, hq, n, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kh = h // g
            for i in range(t):
                logits = []
                for j in range(n):
                    visible = kpos[bi, kh, j] <= qpos[i]
                    if window is not None:
                        visible = visible and kpos[bi, kh, j] > qpos[i] - window
                    if key_mask is not None:
                        visible = visible and bool(key_mask[bi, kh, j])
                    if visible:
                        x = float(q[bi, h, i].double() @ k[bi, kh, j].double()) * scale
                        logits.append(x + (float(bias[bi, kh, j]) if bias is not None else 0.0))
                    else:
                        logits.append(-math.inf)
                m = max(logits)
                if m == -math.inf:
                    continue
                w = torch.tensor([math.exp(x - m) if x > -math.inf else 0.0 for x in logits], dtype=torch.float64)
                w /= w.sum()
                out[bi, h, i] = w @ v[bi, kh].double()
                scores[bi, h] += w
    return out, scores


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 1000),
    hk=st.integers(1, 2),
    g=st.integers(1, 3),
    t=st.integers(1, 6),
    extra=st.integers(0, 8),
    window=st.one_of(st.none(), st.integers(1, 6)),
    use_bias=st.booleans(),
    use_mask=st.booleans(),
    chunk=st.booleans(),
)
def test_attend_equals_brute_force(seed, hk, g, t, extra, window, use_bias, use_mask, chunk, monkeypatch_module):
    gen = torch.Generator().manual_seed(seed)
    b, d = 2, 8
    n = t + extra
    q = torch.randn(b, hk * g, t, d, generator=gen)
    k = torch.randn(b, hk, n, d, generator=gen)
    v = torch.randn(b, hk, n, d, generator=gen)
    kpos = torch.stack([torch.randperm(n, generator=gen) for _ in range(b * hk)]).reshape(b, hk, n)  # evicted order
    qpos = torch.arange(n - t, n)
    bias = torch.rand(b, hk, n, generator=gen).add(0.5).log() if use_bias else None
    key_mask = torch.rand(b, hk, n, generator=gen) > 0.2 if use_mask else None
    scale = 0.3
    want_out, want_scores = brute(q, k, v, qpos, kpos, bias, key_mask, scale, window)
    # a tiny chunk size forces one query per chunk: same result
    monkeypatch_module.setattr(attention, "ATTEND_CHUNK_ELEMENTS", 1 if chunk else 1 << 26)
    kw = dict(q_positions=qpos, k_positions=kpos, bias=bias, key_mask=key_mask, scale=scale, window=window)
    explicit = attend(q, k, v, return_scores=True, **kw)
    fused = attend(q, k, v, **kw).output  # torch SDPA path
    torch.testing.assert_close(explicit.output.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(explicit.scores.double(), want_scores, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.double(), want_out, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_window_needs_positions():
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ShapeError, match="window"):
        attend(q, q, q, window=2)
