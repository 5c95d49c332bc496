"""Every OpenCL kernel of the GPU path compiles for real Intel GPUs (issue 49): ``ocloc`` for
Xe-LP (tgllp), Arc / Xe-HPG (dg2-g10) and Xe-HPC (pvc), at each sub-group size the target runs and
each set of constants the host builds it with, and with the large buffers' option (a pool past one
allocation). ``make setup`` installs ``ocloc`` (Debian's
``intel-opencl-icd``, ``setup/system-packages.sh``); where it is missing the tests skip, saying so."""

from __future__ import annotations

import pytest

from ov_kvcrush.gpu import offline

BUILDS = offline.builds()
#: each kernel source's first build (its index): ``make test-fast`` compiles these, ``make test`` (CI) all
FIRST_OF_EACH_SOURCE = {b[0]: i for i, b in reversed(list(enumerate(BUILDS)))}


def build_id(build: tuple) -> str:
    source, target, sg, constants, large = build
    return f"{source}-{target}-sg{sg}-" + "-".join(f"{k}{v}" for k, v in sorted(constants.items())) + "-large" * large


@pytest.mark.skipif(offline.ocloc() is None, reason="ocloc is not installed (Debian: apt-get install intel-opencl-icd)")
@pytest.mark.parametrize(
    "build",
    [pytest.param(b, marks=() if FIRST_OF_EACH_SOURCE[b[0]] == i else pytest.mark.slow) for i, b in enumerate(BUILDS)],
    ids=[build_id(b) for b in BUILDS],
)
def test_the_kernel_compiles_for_the_target_without_error(build):
    result = offline.compile_one(*build)
    assert result.ok, result.log


def test_every_kernel_source_is_built_for_every_target():
    """A new kernel file or target cannot slip past the compile test."""
    sources = {path.name for path in offline.kernel_dir().glob("*.cl")}
    assert sources == set(offline.VARIANTS)
    assert {(s, t) for s, t, _sg, _c, _large in BUILDS} == {(s, t) for s in sources for t in offline.TARGETS}
    assert {s for s, *_rest, large in BUILDS if large} == sources
