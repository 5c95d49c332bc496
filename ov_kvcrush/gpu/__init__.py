"""The Intel GPU path: the op's kernels in OpenCL C (``plugins/gpu/kernels``), their host, and the
runtime that runs them (an Intel GPU, or Intel's OpenCL CPU runtime where there is none).

:mod:`ov_kvcrush.gpu.runtime` finds an OpenCL device with Intel's extensions and works around the
runtime's pitfalls; :mod:`ov_kvcrush.gpu.kernels` builds the kernels and launches them on numpy
arrays laid out as the CPU op's pool. ``docs/intel_gpu.md`` says what is verified where.
"""

#: who owns the device memory and launches the kernels: pyopencl from Python (the default), or the
#: C++ SYCL host (:mod:`ov_kvcrush.gpu.sycl_host`); ``TorchEngine(paged_device=...)`` names one
HOSTS = ("opencl", "sycl")
