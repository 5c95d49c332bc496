"""How the bf16 prompt kernel multiplies (issue 72, item 1): chosen once per CPU and kept, the
environment's choice first, a bad cache file measured again, and the measurement itself the same
on a busy machine as on a quiet one (the probe it replaces flipped under two idle-priority
neighbours and cost 30 % of the prompt step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ov_kvcrush.op import bf16_choice, plugin

SCRIPT = (
    "from ov_kvcrush.op import plugin; c = plugin.bf16_choice_made(); "
    "assert plugin.bf16_products() == c.products; print(c.products); print(c.why)"
)
HAS_BF16 = "bf16" in plugin.kernel_isa()


def _choice(cache, **env: str) -> tuple[str, str]:
    """A fresh interpreter's choice and why, under cache root ``cache``."""
    run_env = {k: v for k, v in os.environ.items() if k != bf16_choice.ENV}
    run_env |= {"OV_KVCRUSH_CACHE": str(cache), **env}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=run_env, capture_output=True, text=True, check=True)
    products, why = out.stdout.strip().splitlines()
    return products, why


@pytest.mark.skipif(not HAS_BF16, reason="no AVX512-BF16 on this machine: nothing is chosen")
def test_the_choice_is_measured_once_per_cpu_then_kept_and_a_bad_file_is_measured_again(tmp_path):
    first, why = _choice(tmp_path)
    assert why.startswith("measured on this CPU")
    kept = json.loads((tmp_path / "cpu" / "bf16_products.json").read_text())
    assert kept["cpus"][bf16_choice.cpu_identity()]["products"] == first
    again, why = _choice(tmp_path)
    assert (again, why.startswith("kept for this CPU")) == (first, True)
    # what another CPU keeps in a shared home is left alone; its entry is not this one's
    other = "x86_64 / OtherVendor / 1 / 2 / 3 / Another CPU"
    flipped = "widened" if first == "dot" else "dot"
    kept["cpus"][other] = {**kept["cpus"][bf16_choice.cpu_identity()], "products": flipped}
    (tmp_path / "cpu" / "bf16_products.json").write_text(json.dumps(kept))
    assert _choice(tmp_path)[0] == first
    assert json.loads((tmp_path / "cpu" / "bf16_products.json").read_text())["cpus"][other]["products"] == flipped
    for bad in ('{"format": 1, "cpus": {', "[]", json.dumps({"format": 99, "cpus": kept["cpus"]})):
        (tmp_path / "cpu" / "bf16_products.json").write_text(bad)
        products, why = _choice(tmp_path)
        assert (products, why.startswith("measured")) == (first, True)
        assert json.loads((tmp_path / "cpu" / "bf16_products.json").read_text())["format"] == bf16_choice.FORMAT


def test_the_environment_decides_before_any_measurement_or_kept_choice(tmp_path):
    for products in bf16_choice.BF16_PRODUCTS:
        assert _choice(tmp_path, OVKC_BF16_PRODUCTS=products) == (products, "set by OVKC_BF16_PRODUCTS")
    assert not (tmp_path / "cpu").exists()  # nothing measured, nothing kept


@pytest.mark.skipif(not HAS_BF16, reason="no AVX512-BF16 on this machine: nothing is measured")
def test_the_measurement_chooses_the_same_with_two_busy_processes_beside_it():
    """Two CPU-bound processes at the lowest priority (issue 72's busy machine): every
    measurement among them chooses what the quiet ones do."""
    lib = plugin.load()
    quiet = {bf16_choice.measure(lib).products for _ in range(3)}
    assert len(quiet) == 1
    spin = "print('spinning', flush=True)\nwhile True: pass"
    busy = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]  # fmt: skip
    try:
        assert all(p.stdout.readline().strip() == "spinning" for p in busy)  # both in their loops
        loaded = [bf16_choice.measure(lib).products for _ in range(20)]
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert set(loaded) == quiet, (quiet, loaded)
