// An OpenCL loader layer (OPENCL_LAYERS) under which OpenVINO's GPU plugin runs on Intel's OpenCL
// CPU runtime: the plugin's own path (its kernels, SimpleGPU custom layers, remote tensors) can then
// be exercised on a machine with no Intel GPU. A test fixture only: nothing loads it unless
// ov_kvcrush.gpu.emulation.enable() names it in OPENCL_LAYERS before the process's first OpenCL call.
//
// Each change has one reason, found by running the plugin on the CPU runtime (docs/intel_gpu.md):
//
// 1. Identity. A CPU device with cl_intel_subgroups is reported as CL_DEVICE_TYPE_GPU (the plugin
//    lists GPUs only: ocl_device_detector.cpp) with CL_DEVICE_IP_VERSION_INTEL of Xe-LP, 12.0.0
//    (oneDNN's nGEN reads the IP version first; with the CPU's it compiles a probe kernel and throws
//    on finding an x86 binary).
// 2. A kernel keeps its program's handle valid. The plugin releases a program once its kernels are
//    made, later asks a kernel for its program (CL_KERNEL_PROGRAM) and retains that handle: Intel's
//    GPU runtime allows it, the CPU runtime answers CL_INVALID_PROGRAM. The layer holds one program
//    reference per live kernel.
// 3. Three shims in the plugin's own kernel sources (those defining KERNEL(name)), for what they
//    assume of Intel GPUs and the CPU runtime's compiler does not give:
//    a. sub-groups from the linear local id: reorder_weights_opt runs (1, 1, 16) work-groups whose
//       lanes lie along dimension 2; the CPU runtime forms sub-groups along dimension 0 only (of one
//       work-item here), so its lane id becomes get_local_id(2) and its block write a store a lane;
//    b. native_powr of a negative base: the RMS kernel squares with native_powr(x, 2), which Intel
//       GPUs compute as x * x there and the CPU runtime as NaN: the base is taken as |x|;
//    c. mad with float and half arguments: IGC picks an overload, the CPU runtime's clang calls it
//       ambiguous: mad(a, b, c) is spelled a * b + c.
//
// 4. Programs built once are loaded from their binaries after (program_cache.c): the CPU runtime
//    compiles each of the plugin's programs with LLVM, tens of seconds a model and again a shape.
//
// 5. Where OVKC_EMULATED_MAX_ALLOC names a byte count, Intel's relaxed allocation limits with that
//    count as the largest allocation (large_buffers.c): what a pool past one allocation asks of an
//    Intel GPU's driver, held to its contract.
//
// It also counts, for tests of what a step costs (ov_kvcrush.gpu.emulation.Counts), what a GPU
// would be asked to do: kernels enqueued (by name), copies and fills on the device (commands a
// GPU runs as kernels too), blocking host waits (clFinish, clWaitForEvents, and every blocking
// read, write, map or copy) and the bytes copied between host and device (buffer reads and
// writes, buffers made from host memory, maps, and USM copies between host and device memory);
// and the programs made from source (what a GPU's driver compiles), those of the plugin's custom
// layers (ours: their source opens with the plugin's "Custom Layer Built-ins") apart. Counting
// changes nothing of what the calls do.
#define _POSIX_C_SOURCE 200809L  // strdup
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <CL/cl_icd.h>
#include <CL/cl_layer.h>
#include <CL/cl_ext.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "large_buffers.h"
#include "program_cache.h"

#define IP_VERSION_INTEL 0x4250
#define XE_LP_IP_VERSION (12u << 22)  // architecture 12, release 0, revision 0

static struct _cl_icd_dispatch layer_dispatch;
static const struct _cl_icd_dispatch* next;

static int is_emulated(cl_device_id device) {
    cl_device_type type = 0;
    if (next->clGetDeviceInfo(device, CL_DEVICE_TYPE, sizeof(type), &type, NULL) != CL_SUCCESS) return 0;
    if (!(type & CL_DEVICE_TYPE_CPU)) return 0;
    size_t size = 0;
    if (next->clGetDeviceInfo(device, CL_DEVICE_EXTENSIONS, 0, NULL, &size) != CL_SUCCESS || size == 0) return 0;
    char* extensions = malloc(size);
    int found = extensions && next->clGetDeviceInfo(device, CL_DEVICE_EXTENSIONS, size, extensions, NULL) == CL_SUCCESS &&
                strstr(extensions, "cl_intel_subgroups") != NULL;
    free(extensions);
    return found;
}

// -- 1. identity ----------------------------------------------------------------------------------
static cl_int CL_API_CALL get_device_ids(cl_platform_id platform, cl_device_type type, cl_uint n, cl_device_id* devices,
                                         cl_uint* found) {
    if (type & CL_DEVICE_TYPE_GPU) type |= CL_DEVICE_TYPE_CPU;  // the CPU device answers as a GPU
    return next->clGetDeviceIDs(platform, type, n, devices, found);
}

static cl_int CL_API_CALL get_device_info(cl_device_id device, cl_device_info what, size_t size, void* value,
                                          size_t* size_ret) {
    cl_int err = CL_SUCCESS;
    if (large_buffers_active() && is_emulated(device) &&
        large_buffers_device_info(device, what, size, value, size_ret, &err))
        return err;
    err = next->clGetDeviceInfo(device, what, size, value, size_ret);
    if (err != CL_SUCCESS || value == NULL || !is_emulated(device)) return err;
    if (what == CL_DEVICE_TYPE) *(cl_device_type*)value = CL_DEVICE_TYPE_GPU;
    if (what == IP_VERSION_INTEL) *(cl_uint*)value = XE_LP_IP_VERSION;
    return err;
}

// -- 2. a kernel keeps its program's handle valid ---------------------------------------------------
// (a program loaded from the program cache stands in for the one built from source: its kernels)
static cl_kernel CL_API_CALL create_kernel(cl_program program, const char* name, cl_int* err) {
    program = program_cache_built(program);
    cl_kernel kernel = next->clCreateKernel(program, name, err);
    if (kernel) next->clRetainProgram(program);
    return kernel;
}

static cl_int CL_API_CALL create_kernels(cl_program program, cl_uint n, cl_kernel* kernels, cl_uint* made_ret) {
    cl_uint made = 0;
    program = program_cache_built(program);
    cl_int err = next->clCreateKernelsInProgram(program, n, kernels, &made);
    if (err == CL_SUCCESS && kernels)
        for (cl_uint i = 0; i < made; ++i) next->clRetainProgram(program);
    if (made_ret) *made_ret = made;
    return err;
}

static cl_uint program_refs(cl_program program) {
    cl_uint refs = 0;
    next->clGetProgramInfo(program, CL_PROGRAM_REFERENCE_COUNT, sizeof(refs), &refs, NULL);
    return refs;
}

// a kernel's last release lets its program go: a program loaded from the cache may outlive the one
// built from source (the plugin releases that once it has its kernels) until its kernels go
static cl_int CL_API_CALL release_kernel(cl_kernel kernel) {
    cl_uint refs = 0;
    cl_program program = NULL;
    next->clGetKernelInfo(kernel, CL_KERNEL_REFERENCE_COUNT, sizeof(refs), &refs, NULL);
    next->clGetKernelInfo(kernel, CL_KERNEL_PROGRAM, sizeof(program), &program, NULL);
    cl_int err = next->clReleaseKernel(kernel);
    if (err != CL_SUCCESS || refs != 1 || program == NULL) return err;
    const cl_uint program_last = program_refs(program) == 1;
    if (program_cache_release(program) == CL_SUCCESS && program_last) large_buffers_forget_program(program);
    return err;
}

// -- 3. shims in the plugin's kernel sources --------------------------------------------------------
static const char PLUGIN_SOURCE_MARK[] = "#define KERNEL(name)";
static const char SHIM_PRELUDE[] =
    "#define native_powr(x, y) native_powr(fabs(x), (y))\n"
    "#define mad(a, b, c) ((a) * (b) + (c))\n"
    "#define OVKC_STORE_BY_LANE(out, idx, v) do { for (int b_ = 0; b_ < SECOND_BLOCK_SIZE; ++b_) "
    "(out)[(idx) + b_ * SECOND_SIZE + lid] = ((OUTPUT_TYPE*)&(v))[b_]; } while (0)\n";
// reorder_weights_opt's lane id and block write, each replaced by a text of the same length
static const char* const REORDER_FROM[] = {"const int lid = get_sub_group_local_id();",
                                           "OUTPUT_BLOCK_WRITE(output, output_idx, val);"};
static const char* const REORDER_TO[] = {"const int lid = (int)get_local_id(2);    ",
                                         "OVKC_STORE_BY_LANE(output, output_idx, val);"};

static void replace_same_length(char* text, const char* from, const char* to) {
    const size_t n = strlen(from);
    if (strlen(to) != n) return;  // a shim that would move the text is not applied
    for (char* at = strstr(text, from); at; at = strstr(at + n, from)) memcpy(at, to, n);
}

static void count_program(const char* source);  // the counts, below

static cl_program CL_API_CALL create_program(cl_context context, cl_uint count, const char** strings,
                                             const size_t* lengths, cl_int* err) {
    size_t total = 0;
    for (cl_uint i = 0; i < count; ++i) total += (lengths && lengths[i]) ? lengths[i] : strlen(strings[i]);
    char* joined = malloc(sizeof(SHIM_PRELUDE) + total);
    if (joined == NULL) return next->clCreateProgramWithSource(context, count, strings, lengths, err);
    char* body = joined + sizeof(SHIM_PRELUDE) - 1;
    size_t at = 0;
    for (cl_uint i = 0; i < count; ++i) {
        const size_t n = (lengths && lengths[i]) ? lengths[i] : strlen(strings[i]);
        memcpy(body + at, strings[i], n);
        at += n;
    }
    body[at] = '\0';
    cl_program program;
    const char* text = body;
    if (strstr(body, PLUGIN_SOURCE_MARK) == NULL) {
        program = next->clCreateProgramWithSource(context, count, strings, lengths, err);
    } else {
        memcpy(joined, SHIM_PRELUDE, sizeof(SHIM_PRELUDE) - 1);
        if (strstr(body, "KERNEL(reorder_weights_opt)"))
            for (size_t i = 0; i < sizeof(REORDER_FROM) / sizeof(REORDER_FROM[0]); ++i)
                replace_same_length(body, REORDER_FROM[i], REORDER_TO[i]);
        text = joined;
        program = next->clCreateProgramWithSource(context, 1, &text, NULL, err);
    }
    program_cache_remember(program, text);
    count_program(body);
    free(joined);
    return program;
}

// -- counts of what a GPU would be asked to do -----------------------------------------------------
// (the last two are large_buffers.c's: buffers made past the emulated limit, and faults)
enum { KERNELS, WAITS, TO_DEVICE, TO_HOST, DEVICE_COPIES, PROGRAMS, LAYER_PROGRAMS, LARGE_BUFFERS, LARGE_FAULTS,
       N_COUNTS };
// what the plugin's JIT writes first in a custom layer's source (custom_primitive.cpp), before the
// layer's shapes: a new shape of one of our layers is a new program
static const char CUSTOM_LAYER_MARK[] = "// Custom Layer Built-ins";
#define MAX_NAMES 512
static uint64_t counts[N_COUNTS];
static char* kernel_names[MAX_NAMES];
static uint64_t kernel_runs[MAX_NAMES];
static int n_names;
static pthread_mutex_t names_lock = PTHREAD_MUTEX_INITIALIZER;

static void add(int what, uint64_t n) { __atomic_fetch_add(&counts[what], n, __ATOMIC_RELAXED); }
static void count_program(const char* source) {
    add(PROGRAMS, 1);
    if (strstr(source, CUSTOM_LAYER_MARK)) add(LAYER_PROGRAMS, 1);
}
static void add_wait(cl_bool blocking) {
    if (blocking) add(WAITS, 1);
}

static void count_kernel(cl_kernel kernel) {
    char name[512] = "";  // longer names are cut (the plugin's are under 200 characters)
    size_t size = 0;
    if (next->clGetKernelInfo(kernel, CL_KERNEL_FUNCTION_NAME, 0, NULL, &size) != CL_SUCCESS || size > sizeof(name) ||
        next->clGetKernelInfo(kernel, CL_KERNEL_FUNCTION_NAME, sizeof(name), name, NULL) != CL_SUCCESS)
        name[0] = '\0';
    pthread_mutex_lock(&names_lock);
    int i = 0;
    while (i < n_names && strcmp(kernel_names[i], name) != 0) ++i;
    if (i == n_names && n_names < MAX_NAMES && (kernel_names[i] = strdup(name)) != NULL) ++n_names;
    if (i < n_names) ++kernel_runs[i];
    pthread_mutex_unlock(&names_lock);
    add(KERNELS, 1);
}

// read by ov_kvcrush.gpu.emulation through ctypes (the loader loaded this library; dlopen of the
// same path gives the same copy)
int ovkc_counts(uint64_t* out, int n) {
    for (int i = 0; i < n && i < N_COUNTS; ++i)
        out[i] = i == LARGE_BUFFERS  ? large_buffers_made()
                 : i == LARGE_FAULTS ? large_buffers_faults()
                                     : __atomic_load_n(&counts[i], __ATOMIC_RELAXED);
    return N_COUNTS;
}

int ovkc_kernel_runs(int i, char* name, size_t size, uint64_t* runs) {
    pthread_mutex_lock(&names_lock);
    int found = i >= 0 && i < n_names;
    if (found) {
        strncpy(name, kernel_names[i], size - 1);
        name[size - 1] = '\0';
        *runs = kernel_runs[i];
    }
    pthread_mutex_unlock(&names_lock);
    return found;
}

static size_t rect_bytes(const size_t* region) { return region[0] * region[1] * region[2]; }

static cl_int CL_API_CALL enqueue_kernel(cl_command_queue q, cl_kernel kernel, cl_uint dims, const size_t* offset,
                                         const size_t* global, const size_t* local, cl_uint n, const cl_event* wait,
                                         cl_event* event) {
    cl_int err = next->clEnqueueNDRangeKernel(q, kernel, dims, offset, global, local, n, wait, event);
    if (err == CL_SUCCESS) count_kernel(kernel);
    return err;
}

static cl_int CL_API_CALL finish(cl_command_queue q) {
    add(WAITS, 1);
    return next->clFinish(q);
}

static cl_int CL_API_CALL wait_for_events(cl_uint n, const cl_event* events) {
    add(WAITS, 1);
    return next->clWaitForEvents(n, events);
}

static cl_int CL_API_CALL read_buffer(cl_command_queue q, cl_mem buffer, cl_bool blocking, size_t offset, size_t size,
                                      void* ptr, cl_uint n, const cl_event* wait, cl_event* event) {
    add_wait(blocking);
    add(TO_HOST, size);
    return next->clEnqueueReadBuffer(q, buffer, blocking, offset, size, ptr, n, wait, event);
}

static cl_int CL_API_CALL write_buffer(cl_command_queue q, cl_mem buffer, cl_bool blocking, size_t offset, size_t size,
                                       const void* ptr, cl_uint n, const cl_event* wait, cl_event* event) {
    add_wait(blocking);
    add(TO_DEVICE, size);
    return next->clEnqueueWriteBuffer(q, buffer, blocking, offset, size, ptr, n, wait, event);
}

static cl_int CL_API_CALL read_rect(cl_command_queue q, cl_mem buffer, cl_bool blocking, const size_t* buffer_origin,
                                    const size_t* host_origin, const size_t* region, size_t buffer_row,
                                    size_t buffer_slice, size_t host_row, size_t host_slice, void* ptr, cl_uint n,
                                    const cl_event* wait, cl_event* event) {
    add_wait(blocking);
    add(TO_HOST, rect_bytes(region));
    return next->clEnqueueReadBufferRect(q, buffer, blocking, buffer_origin, host_origin, region, buffer_row,
                                         buffer_slice, host_row, host_slice, ptr, n, wait, event);
}

static cl_int CL_API_CALL write_rect(cl_command_queue q, cl_mem buffer, cl_bool blocking, const size_t* buffer_origin,
                                     const size_t* host_origin, const size_t* region, size_t buffer_row,
                                     size_t buffer_slice, size_t host_row, size_t host_slice, const void* ptr,
                                     cl_uint n, const cl_event* wait, cl_event* event) {
    add_wait(blocking);
    add(TO_DEVICE, rect_bytes(region));
    return next->clEnqueueWriteBufferRect(q, buffer, blocking, buffer_origin, host_origin, region, buffer_row,
                                          buffer_slice, host_row, host_slice, ptr, n, wait, event);
}

static void* CL_API_CALL map_buffer(cl_command_queue q, cl_mem buffer, cl_bool blocking, cl_map_flags flags,
                                    size_t offset, size_t size, cl_uint n, const cl_event* wait, cl_event* event,
                                    cl_int* err) {
    add_wait(blocking);
    if (!(flags & CL_MAP_WRITE_INVALIDATE_REGION)) add(TO_HOST, size);  // the host sees the device's bytes
    if (flags & (CL_MAP_WRITE | CL_MAP_WRITE_INVALIDATE_REGION)) add(TO_DEVICE, size);  // and they go back
    return next->clEnqueueMapBuffer(q, buffer, blocking, flags, offset, size, n, wait, event, err);
}

static cl_int CL_API_CALL copy_buffer(cl_command_queue q, cl_mem src, cl_mem dst, size_t src_offset,
                                      size_t dst_offset, size_t size, cl_uint n, const cl_event* wait,
                                      cl_event* event) {
    add(DEVICE_COPIES, 1);
    return next->clEnqueueCopyBuffer(q, src, dst, src_offset, dst_offset, size, n, wait, event);
}

static cl_int CL_API_CALL copy_rect(cl_command_queue q, cl_mem src, cl_mem dst, const size_t* src_origin,
                                    const size_t* dst_origin, const size_t* region, size_t src_row, size_t src_slice,
                                    size_t dst_row, size_t dst_slice, cl_uint n, const cl_event* wait,
                                    cl_event* event) {
    add(DEVICE_COPIES, 1);
    return next->clEnqueueCopyBufferRect(q, src, dst, src_origin, dst_origin, region, src_row, src_slice, dst_row,
                                         dst_slice, n, wait, event);
}

static cl_int CL_API_CALL fill_buffer(cl_command_queue q, cl_mem buffer, const void* pattern, size_t pattern_size,
                                      size_t offset, size_t size, cl_uint n, const cl_event* wait, cl_event* event) {
    add(DEVICE_COPIES, 1);
    return next->clEnqueueFillBuffer(q, buffer, pattern, pattern_size, offset, size, n, wait, event);
}

static cl_mem CL_API_CALL create_buffer(cl_context context, cl_mem_flags flags, size_t size, void* host, cl_int* err) {
    if (flags & CL_MEM_COPY_HOST_PTR) add(TO_DEVICE, size);
    return large_buffers_create(context, flags, size, host, err);
}

// -- 5. relaxed allocation limits (large_buffers.c) -------------------------------------------------
static cl_int CL_API_CALL release_buffer(cl_mem buffer) { return large_buffers_release(buffer); }

static cl_int CL_API_CALL build_program(cl_program program, cl_uint n, const cl_device_id* devices,
                                        const char* options, void(CL_CALLBACK* notify)(cl_program, void*),
                                        void* user_data) {
    char* plain = large_buffers_options(program, options);  // the CPU runtime refuses the option
    cl_int err = program_cache_build(program, n, devices, plain ? plain : options, notify, user_data);
    large_buffers_built(program, program_cache_built(program));
    free(plain);
    return err;
}

// a handle is forgotten at its last release only: the program loaded from the cache in place of
// this one stays while its kernels do (their last release forgets it: release_kernel)
static cl_int CL_API_CALL release_program(cl_program program) {
    const cl_uint refs = program_refs(program);
    cl_program built = program_cache_built(program);
    const cl_uint built_last = built != program && program_refs(built) == 1;
    cl_int err = program_cache_release(program);
    if (err == CL_SUCCESS && refs == 1) {
        large_buffers_forget_program(program);
        if (built_last) large_buffers_forget_program(built);
    }
    return err;
}

static cl_int CL_API_CALL set_kernel_arg(cl_kernel kernel, cl_uint index, size_t size, const void* value) {
    large_buffers_check_arg(kernel, size, value);
    return next->clSetKernelArg(kernel, index, size, value);
}

// USM (cl_intel_unified_shared_memory, which the plugin uses where the device has it): its copies
// are extension functions, reached through clGetExtensionFunctionAddressForPlatform
static clEnqueueMemcpyINTEL_fn next_memcpy;
static clGetMemAllocInfoINTEL_fn alloc_info;

static int on_device(cl_context context, const void* ptr) {
    cl_unified_shared_memory_type_intel type = CL_MEM_TYPE_UNKNOWN_INTEL;
    if (alloc_info) alloc_info(context, ptr, CL_MEM_ALLOC_TYPE_INTEL, sizeof(type), &type, NULL);
    return type == CL_MEM_TYPE_DEVICE_INTEL;
}

static cl_int CL_API_CALL usm_memcpy(cl_command_queue q, cl_bool blocking, void* dst, const void* src, size_t size,
                                     cl_uint n, const cl_event* wait, cl_event* event) {
    add_wait(blocking);
    cl_context context = NULL;
    next->clGetCommandQueueInfo(q, CL_QUEUE_CONTEXT, sizeof(context), &context, NULL);
    const int to = on_device(context, dst), from = on_device(context, src);
    if (to && !from) add(TO_DEVICE, size);
    if (from && !to) add(TO_HOST, size);
    if (from && to) add(DEVICE_COPIES, 1);
    return next_memcpy(q, blocking, dst, src, size, n, wait, event);
}

static void* CL_API_CALL extension_function(cl_platform_id platform, const char* name) {
    void* f = next->clGetExtensionFunctionAddressForPlatform(platform, name);
    if (f == NULL || name == NULL || strcmp(name, "clEnqueueMemcpyINTEL") != 0) return f;
    next_memcpy = (clEnqueueMemcpyINTEL_fn)f;
    alloc_info = (clGetMemAllocInfoINTEL_fn)next->clGetExtensionFunctionAddressForPlatform(platform,
                                                                                           "clGetMemAllocInfoINTEL");
    return (void*)usm_memcpy;
}

// -- the layer's entry points -----------------------------------------------------------------------
CL_API_ENTRY cl_int CL_API_CALL clGetLayerInfo(cl_layer_info name, size_t size, void* value, size_t* size_ret) {
    if (name != CL_LAYER_API_VERSION) return CL_INVALID_VALUE;
    if (size_ret) *size_ret = sizeof(cl_layer_api_version);
    if (value) {
        if (size < sizeof(cl_layer_api_version)) return CL_INVALID_VALUE;
        *(cl_layer_api_version*)value = CL_LAYER_API_VERSION_100;
    }
    return CL_SUCCESS;
}

CL_API_ENTRY cl_int CL_API_CALL clInitLayer(cl_uint entries, const struct _cl_icd_dispatch* target,
                                            cl_uint* entries_ret, const struct _cl_icd_dispatch** layer) {
    // the loader's table may be shorter than these headers' (an older loader): copy what it has
    size_t own = sizeof(layer_dispatch) / sizeof(void*);
    if (entries < own) own = entries;
    if (target == NULL || entries_ret == NULL || layer == NULL) return CL_INVALID_VALUE;
    next = target;
    program_cache_init(target);
    large_buffers_init(target);
    memcpy(&layer_dispatch, target, own * sizeof(void*));
    layer_dispatch.clGetDeviceIDs = get_device_ids;
    layer_dispatch.clGetDeviceInfo = get_device_info;
    layer_dispatch.clCreateKernel = create_kernel;
    layer_dispatch.clCreateKernelsInProgram = create_kernels;
    layer_dispatch.clReleaseKernel = release_kernel;
    layer_dispatch.clCreateProgramWithSource = create_program;
    layer_dispatch.clBuildProgram = build_program;
    layer_dispatch.clGetProgramInfo = program_cache_program_info;
    layer_dispatch.clGetProgramBuildInfo = program_cache_build_info;
    layer_dispatch.clReleaseProgram = release_program;
    layer_dispatch.clReleaseMemObject = release_buffer;
    layer_dispatch.clSetKernelArg = set_kernel_arg;
    layer_dispatch.clEnqueueNDRangeKernel = enqueue_kernel;
    layer_dispatch.clFinish = finish;
    layer_dispatch.clWaitForEvents = wait_for_events;
    layer_dispatch.clEnqueueReadBuffer = read_buffer;
    layer_dispatch.clEnqueueWriteBuffer = write_buffer;
    layer_dispatch.clEnqueueReadBufferRect = read_rect;
    layer_dispatch.clEnqueueWriteBufferRect = write_rect;
    layer_dispatch.clEnqueueMapBuffer = map_buffer;
    layer_dispatch.clCreateBuffer = create_buffer;
    layer_dispatch.clEnqueueCopyBuffer = copy_buffer;
    layer_dispatch.clEnqueueCopyBufferRect = copy_rect;
    layer_dispatch.clEnqueueFillBuffer = fill_buffer;
    layer_dispatch.clGetExtensionFunctionAddressForPlatform = extension_function;
    *entries_ret = (cl_uint)own;
    *layer = &layer_dispatch;
    return CL_SUCCESS;
}
