"""Shared fixtures: the exported embedded model is built once per machine (cached) and reused."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (tests/test_kernels.py):
# the switch is read when a kernel is defined, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def patch_triton_language_once_per_launch() -> None:
    """Triton's interpreter patches ``triton.language`` (every builtin of ``tl``, ``tl.tensor``
    and ``tl.math``, found by ``inspect.getmembers``) at each launch, and again at every call of
    a nested ``@triton.jit`` helper, although the launch around it has patched the same modules:
    ~1.4 ms a call, a third of an interpreted kernel test's time (12,888 nested calls, 19 of 61 s
    in ``test_torch_batch``'s ClusterKV case). Inside a launch, a helper whose modules the launch
    patched skips the repeat (the re-patch set the same functions again and was never restored);
    the launch's own patch and its restore are unchanged. Where Triton's internals differ from
    3.9's, nothing is changed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "once_per_launch", False):
        return
    import inspect

    patched: set[int] = set()  # the modules the running launch patched (empty between launches)

    seen: dict[object, set[int]] = {}

    def langs(fn) -> set[int]:
        if fn not in seen:
            seen[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        return seen[fn]

    class LaunchScope:
        def __init__(self, scope) -> None:
            self.scope = scope

        def restore(self) -> None:
            patched.clear()
            self.scope.restore()

    class NestedScope:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        if patched and langs(fn) <= patched:
            return NestedScope()
        launch = not patched
        scope = patch(fn)
        patched.update(langs(fn))
        # a helper reaching modules its launch did not patch (Triton's own library reaches
        # ``tl.core``) patches them as Triton does, once a launch, unrestored as in Triton
        return LaunchScope(scope) if launch else scope

    patch_lang.once_per_launch = True
    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    patch_triton_language_once_per_launch()


def pytest_configure(config):
    """Under ``pytest -n N`` (``make test`` runs two workers), each worker keeps its share of the
    cores (worker i: every N-th core from the i-th) and sizes torch's threads to it. Without
    this, each worker's OpenVINO and torch start a thread per core of the machine: on two cores,
    two workers run four busy threads, and every parallel matmul waits on the one that lost its
    core. The cores the run started with stay in ``OV_KVCRUSH_TEST_ALL_CORES``, for a child that
    needs them all (``helpers.with_all_cores``)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if worker is None or count < 2 or len(cores) < count:
        return
    share = cores[int(worker.removeprefix("gw")) % count :: count]
    os.environ["OV_KVCRUSH_TEST_ALL_CORES"] = ",".join(map(str, cores))
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))


@pytest.fixture(scope="session", autouse=True)
def compiled_model_cache(tmp_path_factory):
    """Our op's models compile once per test process: the process's shared core keeps compiled
    models in a folder of this session (OpenVINO's ``CACHE_DIR``), so the many tests that compile
    the same IR with the same properties import it (0.16 s) instead of compiling it (1 s). One
    folder per process: OpenVINO writes a blob in place, so two processes must not share one.
    Nothing to do without OpenVINO (the GPU image runs the CUDA path's tests with torch alone)."""
    try:
        import openvino  # noqa: F401
    except ImportError:
        return
    from ov_kvcrush.op import plugin

    plugin.shared_core().set_property({"CACHE_DIR": str(tmp_path_factory.mktemp("compiled-models"))})


@pytest.fixture(params=("dot", "widened"))
def bf16_products(request):
    """A bf16 prompt test under each way the kernel multiplies (``plugin.BF16_PRODUCTS``), not
    only the one this CPU picks by itself."""
    from ov_kvcrush.op import plugin

    before = plugin.set_bf16_products(request.param)
    yield request.param
    plugin.set_bf16_products(before)


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


@pytest.fixture(scope="module")
def gpu_worker():
    """A worker process running the Intel GPU path's kernels (``ov_kvcrush.gpu``) on an Intel GPU
    or Intel's OpenCL CPU runtime: a fresh process, since the runtime cannot load once openvino
    is imported (as it is in the test processes). Skips, naming what is missing, without one."""
    from ov_kvcrush.gpu import runtime

    with runtime.isolated() as worker:
        try:
            worker.submit(runtime.device_info).result()
        except runtime.GPUPathError as e:
            pytest.skip(str(e))
        yield worker


@pytest.fixture(scope="session")
def emulation_worker():
    """A worker process running OpenVINO's GPU plugin on Intel's OpenCL CPU runtime under the
    emulation layer (``ov_kvcrush.gpu.emulation``), enabled before its first OpenCL call; one a
    test process, shared by the plugin's tests. Skips, naming what is missing, where the emulation
    cannot run."""
    from ov_kvcrush.gpu import emulation

    reason = emulation.unavailable()
    if reason:
        pytest.skip(reason)
    with emulation.worker() as worker:
        yield worker


@pytest.fixture(scope="session")
def tiny_llama3_ir() -> str:
    """The family checks' tiny random-weight Llama 3 (2 layers, 8 query and 2 KV heads of 32
    dims), exported to OpenVINO IR (fp32, cached per machine): the GPU plugin tests' model."""
    from ov_kvcrush.models.export import export_models
    from ov_kvcrush.models.families import tiny_checkpoint

    checkpoint = tiny_checkpoint("llama3")
    return str(export_models([checkpoint], "fp32")[checkpoint])


@pytest.fixture(scope="session")
def tiny_gemma3_ir() -> str:
    """The family checks' tiny random-weight Gemma 3 (a local layer of a 96-token window, then a
    global one; q/k norms, a scale other than 1/sqrt(d)), exported to OpenVINO IR (fp32, cached
    per machine): the GPU plugin's local layers."""
    from ov_kvcrush.models.export import export_models
    from ov_kvcrush.models.families import tiny_checkpoint

    checkpoint = tiny_checkpoint("gemma3")
    return str(export_models([checkpoint], "fp32")[checkpoint])


@pytest.fixture(scope="session")
def tiny_gemma2_ir() -> str:
    """The family checks' tiny random-weight Gemma 2 (a local layer of a 96-token window, then a
    global one; attention soft-capping at 50), exported to OpenVINO IR (fp32, cached per machine)."""
    from ov_kvcrush.models.export import export_models
    from ov_kvcrush.models.families import tiny_checkpoint

    checkpoint = tiny_checkpoint("gemma2")
    return str(export_models([checkpoint], "fp32")[checkpoint])


@pytest.fixture(scope="session")
def tiny_qwen2_ir() -> str:
    """The family checks' tiny random-weight Qwen2.5 (q/k/v biases, one KV head for 8 query heads
    of 32 dims, 2 layers), exported to OpenVINO IR (fp32, cached per machine): the GPU plugin's
    second family."""
    from ov_kvcrush.models.export import export_models
    from ov_kvcrush.models.families import tiny_checkpoint

    checkpoint = tiny_checkpoint("qwen2")
    return str(export_models([checkpoint], "fp32")[checkpoint])
