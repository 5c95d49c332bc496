"""``ov-kvcrush demo``: the product's rows beside the native anchor, as a user runs it."""

from __future__ import annotations

import re

import pytest
from helpers import cli, run_main

from ov_kvcrush.cli.demo import label, runs


@pytest.mark.slow
def test_the_main_job_answers_every_row():
    """``ov-kvcrush demo`` as ``make demo`` runs it (its own prompt and budget): native and every
    row of ours find the passkey, and the compressed rows of ours hold less than the full cache
    or (ClusterKV, which recalls) as much."""
    proc = cli("demo")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    expected = [label(b, cfg) for b, cfg in runs(512, with_torch=False)]
    answers = re.findall(r"^(.+?) +answer: .*\((correct|WRONG)\)$", out, flags=re.M)
    assert [name.strip() for name, _ in answers] == expected
    assert [verdict for _, verdict in answers] == ["correct"] * len(expected), out


@pytest.mark.slow
def test_the_demo_answers_with_the_product_and_with_the_reference_behind_a_flag(capsys):
    """Through the entry point's ``main`` (the fresh interpreter's run is the main job's, above)."""
    code, out, err = run_main(capsys, "demo", "--tokens", "400", "--budget", "192", "--torch")
    assert code == 0, err
    expected = [label(b, cfg) for b, cfg in runs(192, with_torch=True)]
    positions = [out.find(f"{name} ") for name in expected]
    assert all(p >= 0 for p in positions), [n for n, p in zip(expected, positions, strict=True) if p < 0]
    assert positions == sorted(positions)  # full caches first, then native, ours, the reference
    assert {b for b, _ in runs(192, with_torch=False)} == {"genai", "openvino"}  # torch only with --torch
    stats = re.findall(r"TTFT +(\d+) ms +TPOT +([\d.]+) ms +KV held +([\d.]+) MiB of ([\d.]+) MiB full", out)
    assert len(stats) == len(expected)
    for name, (_, tpot, held, full) in zip(expected, stats, strict=True):
        assert float(tpot) > 0 and float(held) > 0
        if "kvcrush" in name or "quant" in name:  # evicting methods hold less than the full cache
            assert float(held) < float(full), name
