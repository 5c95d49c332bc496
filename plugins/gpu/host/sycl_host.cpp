// The Intel GPU path's SYCL host: a SYCL queue on the OpenCL backend that owns the device memory
// (USM device allocations: the pool's blocks, tables, scores) and launches the path's OpenCL C
// kernels (plugins/gpu/kernels/*.cl), built from source through the queue's native OpenCL context
// and wrapped as SYCL kernels. Built with plain g++ against intel-sycl-rt (no SYCL compiler: the
// device code is the OpenCL C, compiled by the device's driver at run time, as OpenVINO's GPU
// plugin compiles its own kernels). Its context is an OpenCL context, so the memory it owns can be
// handed to OpenVINO's GPU plugin as remote tensors (ov::intel_gpu::ocl::ClContext).
//
// A C API (as the CPU op's plugins/cpu exposes one), called from Python through ctypes
// (ov_kvcrush/gpu/sycl_host.py). The queue is in order: launches and copies run in the order they
// are made, as on the OpenCL queue of the pyopencl host. Every call returns 0 or a negative error
// code; the last error's text is kept per host (ovkc_sycl_error).

#define SYCL_DISABLE_FSYCL_SYCLHPP_WARNING
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <sycl/backend/opencl.hpp>
#include <sycl/sycl.hpp>
#include <vector>

namespace {

//: kinds of kernel arguments (ovkc_sycl_launch)
enum ArgKind : int32_t { ARG_POINTER = 0, ARG_INT32 = 1, ARG_FLOAT32 = 2, ARG_UINT32 = 3, ARG_NULL = 4 };

struct Host {
    sycl::queue queue;
    cl_context context = nullptr;
    cl_device_id device = nullptr;
    std::vector<cl_program> programs;
    std::vector<sycl::kernel> kernels;
    std::vector<void*> released;  // freed once the queue has drained (ovkc_sycl_finish)
    std::string error;
};

bool intel_opencl(const sycl::device& d) {
    if (d.get_backend() != sycl::backend::opencl) return false;
    const auto vendor = d.get_platform().get_info<sycl::info::platform::vendor>();
    return vendor.find("Intel") != std::string::npos;
}

// The first Intel GPU on the OpenCL backend; else, with allow_cpu, Intel's OpenCL CPU runtime.
bool choose_device(bool allow_cpu, sycl::device& out, std::string& why) {
    std::vector<sycl::device> cpus;
    for (const auto& platform : sycl::platform::get_platforms()) {
        for (const auto& d : platform.get_devices()) {
            if (!intel_opencl(d)) continue;
            if (d.is_gpu()) {
                out = d;
                return true;
            }
            if (d.is_cpu()) cpus.push_back(d);
        }
    }
    if (allow_cpu && !cpus.empty()) {
        out = cpus.front();
        return true;
    }
    why = cpus.empty() ? "no Intel OpenCL device is visible to SYCL's OpenCL backend"
                       : "no Intel GPU is visible to SYCL's OpenCL backend (only Intel's OpenCL CPU runtime)";
    return false;
}

int fail(Host* h, const std::string& what) {
    h->error = what;
    return -1;
}

template <class F>
int guarded(Host* h, F&& body) {
    try {
        return body();
    } catch (const std::exception& e) {
        return fail(h, e.what());
    }
}

void drain(Host* h) {
    h->queue.wait_and_throw();
    for (void* p : h->released) sycl::free(p, h->queue);
    h->released.clear();
}

}  // namespace

extern "C" {

// Open the device; nullptr with the reason in `why` (why_len bytes) when there is none.
void* ovkc_sycl_open(int allow_cpu, char* why, size_t why_len) {
    std::string reason;
    try {
        sycl::device d;
        if (choose_device(allow_cpu != 0, d, reason)) {
            auto h = std::make_unique<Host>();
            h->queue = sycl::queue(d, sycl::property::queue::in_order{});
            h->context = sycl::get_native<sycl::backend::opencl>(h->queue.get_context());
            h->device = sycl::get_native<sycl::backend::opencl>(d);
            return h.release();
        }
    } catch (const std::exception& e) {
        reason = e.what();
    }
    std::snprintf(why, why_len, "%s", reason.c_str());
    return nullptr;
}

void ovkc_sycl_close(void* handle) {
    auto* h = static_cast<Host*>(handle);
    try {
        drain(h);
    } catch (...) {
    }
    h->kernels.clear();
    for (cl_program p : h->programs) clReleaseProgram(p);
    delete h;
}

const char* ovkc_sycl_error(void* handle) { return static_cast<Host*>(handle)->error.c_str(); }

// The device's name, whether it is a GPU, and its sub-group sizes (up to max_sizes of them).
int ovkc_sycl_describe(void* handle, char* name, size_t name_len, int32_t* is_gpu, int32_t* sizes, int32_t max_sizes) {
    auto* h = static_cast<Host*>(handle);
    return guarded(h, [&] {
        const auto d = h->queue.get_device();
        std::snprintf(name, name_len, "%s", d.get_info<sycl::info::device::name>().c_str());
        *is_gpu = d.is_gpu() ? 1 : 0;
        const auto listed = d.get_info<sycl::info::device::sub_group_sizes>();
        int n = 0;
        for (size_t s : listed)
            if (n < max_sizes) sizes[n++] = static_cast<int32_t>(s);
        return n;
    });
}

// Build OpenCL C `source` with `options`; returns the program's index (the build log in `log`).
int ovkc_sycl_build(void* handle, const char* source, const char* options, char* log, size_t log_len) {
    auto* h = static_cast<Host*>(handle);
    cl_int err = CL_SUCCESS;
    cl_program program = clCreateProgramWithSource(h->context, 1, &source, nullptr, &err);
    if (err != CL_SUCCESS) return fail(h, "clCreateProgramWithSource failed: " + std::to_string(err));
    err = clBuildProgram(program, 1, &h->device, options, nullptr, nullptr);
    size_t size = 0;
    clGetProgramBuildInfo(program, h->device, CL_PROGRAM_BUILD_LOG, 0, nullptr, &size);
    std::string text(size, '\0');
    clGetProgramBuildInfo(program, h->device, CL_PROGRAM_BUILD_LOG, size, text.data(), nullptr);
    std::snprintf(log, log_len, "%s", text.c_str());
    if (err != CL_SUCCESS) {
        clReleaseProgram(program);
        return fail(h, "clBuildProgram failed (" + std::to_string(err) + "): " + text);
    }
    h->programs.push_back(program);
    return static_cast<int>(h->programs.size() - 1);
}

// Build a program from a device binary (CL_PROGRAM_BINARIES of an earlier build for this device
// and driver); returns the program's index, or -1 where the device refuses it (then build from
// source).
int ovkc_sycl_build_binary(void* handle, const unsigned char* binary, size_t size, const char* options) {
    auto* h = static_cast<Host*>(handle);
    cl_int status = CL_SUCCESS, err = CL_SUCCESS;
    cl_program program = clCreateProgramWithBinary(h->context, 1, &h->device, &size, &binary, &status, &err);
    if (err != CL_SUCCESS || status != CL_SUCCESS) {
        if (program != nullptr) clReleaseProgram(program);
        return fail(h, "the device refused the cached binary (" + std::to_string(err) + ")");
    }
    if (clBuildProgram(program, 1, &h->device, options, nullptr, nullptr) != CL_SUCCESS) {
        clReleaseProgram(program);
        return fail(h, "the cached binary did not build");
    }
    h->programs.push_back(program);
    return static_cast<int>(h->programs.size() - 1);
}

// The device binary of a built program: its size with `binary` null, else copied there (`size`
// bytes); negative on failure.
long long ovkc_sycl_program_binary(void* handle, int program, unsigned char* binary, size_t size) {
    auto* h = static_cast<Host*>(handle);
    if (program < 0 || static_cast<size_t>(program) >= h->programs.size()) return fail(h, "no such program");
    size_t have = 0;
    if (clGetProgramInfo(h->programs[program], CL_PROGRAM_BINARY_SIZES, sizeof have, &have, nullptr) != CL_SUCCESS)
        return fail(h, "the program's binary size is not available");
    if (binary == nullptr) return static_cast<long long>(have);
    if (size < have) return fail(h, "the buffer is smaller than the program's binary");
    unsigned char* out[] = {binary};
    if (clGetProgramInfo(h->programs[program], CL_PROGRAM_BINARIES, sizeof out, out, nullptr) != CL_SUCCESS)
        return fail(h, "the program's binary is not available");
    return static_cast<long long>(have);
}

// The device's driver version (what a cached binary is valid for, with the device's name).
int ovkc_sycl_driver(void* handle, char* out, size_t out_len) {
    auto* h = static_cast<Host*>(handle);
    return guarded(h, [&] {
        std::snprintf(out, out_len, "%s", h->queue.get_device().get_info<sycl::info::device::driver_version>().c_str());
        return 0;
    });
}

// The names of a built program's kernels, ';'-separated.
int ovkc_sycl_kernel_names(void* handle, int program, char* names, size_t names_len) {
    auto* h = static_cast<Host*>(handle);
    if (program < 0 || static_cast<size_t>(program) >= h->programs.size()) return fail(h, "no such program");
    size_t size = 0;
    clGetProgramInfo(h->programs[program], CL_PROGRAM_KERNEL_NAMES, 0, nullptr, &size);
    if (size > names_len) return fail(h, "kernel names longer than the buffer");
    clGetProgramInfo(h->programs[program], CL_PROGRAM_KERNEL_NAMES, size, names, nullptr);
    return 0;
}

// Kernel `name` of a built program as a SYCL kernel; returns its index.
int ovkc_sycl_kernel(void* handle, int program, const char* name) {
    auto* h = static_cast<Host*>(handle);
    if (program < 0 || static_cast<size_t>(program) >= h->programs.size()) return fail(h, "no such program");
    return guarded(h, [&] {
        cl_int err = CL_SUCCESS;
        cl_kernel k = clCreateKernel(h->programs[program], name, &err);
        if (err != CL_SUCCESS) return fail(h, std::string("no kernel ") + name);
        h->kernels.push_back(sycl::make_kernel<sycl::backend::opencl>(k, h->queue.get_context()));
        clReleaseKernel(k);  // the SYCL kernel holds its own reference
        return static_cast<int>(h->kernels.size() - 1);
    });
}

// Launch kernel `kernel` over `global` work-items (dims 1-3), in work-groups of `local` (all zero:
// the runtime's choice), with `nargs` arguments of `kinds` whose values are in `values` (a USM
// pointer's address, or an int32/uint32/float32's bits in the low 32 bits).
int ovkc_sycl_launch(void* handle, int kernel, int dims, const size_t* global, const size_t* local, int nargs,
                     const int32_t* kinds, const uint64_t* values) {
    auto* h = static_cast<Host*>(handle);
    if (kernel < 0 || static_cast<size_t>(kernel) >= h->kernels.size()) return fail(h, "no such kernel");
    if (dims < 1 || dims > 3) return fail(h, "dims must be 1, 2 or 3");
    return guarded(h, [&] {
        const bool sized = local[0] != 0;
        h->queue.submit([&](sycl::handler& cgh) {
            for (int i = 0; i < nargs; ++i) {
                const uint64_t v = values[i];
                uint32_t bits = static_cast<uint32_t>(v);
                switch (kinds[i]) {
                    case ARG_POINTER: cgh.set_arg(i, reinterpret_cast<void*>(v)); break;
                    case ARG_NULL: cgh.set_arg(i, static_cast<void*>(nullptr)); break;
                    case ARG_INT32: cgh.set_arg(i, static_cast<int32_t>(bits)); break;
                    case ARG_UINT32: cgh.set_arg(i, bits); break;
                    case ARG_FLOAT32: {
                        float f;
                        std::memcpy(&f, &bits, sizeof f);
                        cgh.set_arg(i, f);
                        break;
                    }
                    default: throw std::runtime_error("unknown argument kind " + std::to_string(kinds[i]));
                }
            }
            const sycl::kernel& k = h->kernels[kernel];
            if (dims == 1) {
                if (sized) cgh.parallel_for(sycl::nd_range<1>({global[0]}, {local[0]}), k);
                else cgh.parallel_for(sycl::range<1>(global[0]), k);
            } else if (dims == 2) {
                // SYCL's dimension 0 is the slowest-varying one, OpenCL's the fastest: reversed
                if (sized) cgh.parallel_for(sycl::nd_range<2>({global[1], global[0]}, {local[1], local[0]}), k);
                else cgh.parallel_for(sycl::range<2>(global[1], global[0]), k);
            } else {
                if (sized)
                    cgh.parallel_for(sycl::nd_range<3>({global[2], global[1], global[0]}, {local[2], local[1], local[0]}), k);
                else cgh.parallel_for(sycl::range<3>(global[2], global[1], global[0]), k);
            }
        });
        return 0;
    });
}

// Device memory of `bytes` (USM device allocation); nullptr on failure.
void* ovkc_sycl_alloc(void* handle, size_t bytes) {
    auto* h = static_cast<Host*>(handle);
    try {
        void* p = sycl::malloc_device(bytes, h->queue);
        if (p == nullptr) h->error = "out of device memory for " + std::to_string(bytes) + " bytes";
        return p;
    } catch (const std::exception& e) {
        h->error = e.what();
        return nullptr;
    }
}

// Give back device memory: freed once the work queued before it has run (at the next drain).
void ovkc_sycl_release(void* handle, void* ptr) {
    if (ptr != nullptr) static_cast<Host*>(handle)->released.push_back(ptr);
}

// Copy `bytes` from `src` to `dst` (either may be host or device memory), queued in order.
int ovkc_sycl_copy(void* handle, void* dst, const void* src, size_t bytes) {
    auto* h = static_cast<Host*>(handle);
    return guarded(h, [&] {
        if (bytes) h->queue.memcpy(dst, src, bytes);
        return 0;
    });
}

// Copy `rows` rows of `width` bytes, the source's rows `src_pitch` bytes apart, the destination's
// `dst_pitch` apart, queued in order: a copy a row (the rows are a layer's heads: a few dozen).
// Not ext_oneapi_memcpy2d: between two device allocations it falls back to a SYCL kernel, which
// only a SYCL compiler can build.
int ovkc_sycl_copy_rect(void* handle, void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                        size_t rows) {
    auto* h = static_cast<Host*>(handle);
    return guarded(h, [&] {
        auto* d = static_cast<char*>(dst);
        const auto* s = static_cast<const char*>(src);
        for (size_t r = 0; width && r < rows; ++r) h->queue.memcpy(d + r * dst_pitch, s + r * src_pitch, width);
        return 0;
    });
}

// Set `bytes` bytes at `dst` to `value`, queued in order.
int ovkc_sycl_fill(void* handle, void* dst, int value, size_t bytes) {
    auto* h = static_cast<Host*>(handle);
    return guarded(h, [&] {
        if (bytes) h->queue.memset(dst, value, bytes);
        return 0;
    });
}

// Wait for everything queued, then free the memory given back meanwhile.
int ovkc_sycl_finish(void* handle) {
    auto* h = static_cast<Host*>(handle);
    return guarded(h, [&] {
        drain(h);
        return 0;
    });
}

}  // extern "C"
