// Intel's relaxed allocation limits (cl_intel_relax_allocation_limits), emulated for the emulation
// layer (gpu_identity_layer.c) where OVKC_EMULATED_MAX_ALLOC names a byte count. On an Intel GPU
// one buffer may hold at most CL_DEVICE_MAX_MEM_ALLOC_SIZE (about 4 GiB on Arc cards) unless it is
// made with CL_MEM_ALLOW_UNRESTRICTED_SIZE_INTEL, and then every kernel that reads it must be built
// with -cl-intel-greater-than-4GB-buffer-required (its offsets 64-bit): Intel's "Allocations
// greater than 4GB" guide. The CPU runtime has no such limit and refuses both the flag and the
// option, so this shows its device with that byte count as its largest allocation and the
// extension listed, and holds the process to the driver's contract:
//   - a buffer past the limit without the flag is refused (CL_INVALID_BUFFER_SIZE), as the driver
//     does; with it, it is made (the flag taken off for the CPU runtime) and counted;
//   - the option is taken off a build's options, and the program remembered as built with it;
//   - an argument of a kernel that is a buffer past the limit, where the kernel's program was
//     built without the option, is counted as a fault (on a GPU its offsets would wrap at 4 GiB).
#ifndef OVKC_LARGE_BUFFERS_H
#define OVKC_LARGE_BUFFERS_H
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <CL/cl_icd.h>
#include <stdint.h>

// the environment variable of the emulated largest allocation (ov_kvcrush.gpu.emulation.MAX_ALLOC_ENV)
#define MAX_ALLOC_ENV "OVKC_EMULATED_MAX_ALLOC"
#define RELAX_EXTENSION "cl_intel_relax_allocation_limits"
#define UNRESTRICTED_SIZE_FLAG ((cl_mem_flags)1 << 23)  // CL_MEM_ALLOW_UNRESTRICTED_SIZE_INTEL
#define LARGE_BUFFER_OPTION "-cl-intel-greater-than-4GB-buffer-required"

// reads the environment; the rest does nothing where it names no limit
void large_buffers_init(const struct _cl_icd_dispatch* next);
int large_buffers_active(void);
// a device query it answers (the largest allocation, the extensions): 1 with *err set, else 0
int large_buffers_device_info(cl_device_id device, cl_device_info what, size_t size, void* value, size_t* size_ret,
                              cl_int* err);
// clCreateBuffer, the flag taken off; NULL with *err set where the driver refuses the size
cl_mem large_buffers_create(cl_context context, cl_mem_flags flags, size_t size, void* host, cl_int* err);
// clReleaseMemObject: a buffer's last release forgets it (its handle may be given again)
cl_int large_buffers_release(cl_mem buffer);
// clBuildProgram's options without the option (free it); the program remembered if it had it
char* large_buffers_options(cl_program program, const char* options);
// the program that holds its build (the program cache's stand-in) is remembered with it
void large_buffers_built(cl_program program, cl_program built);
// a program's last release
void large_buffers_forget_program(cl_program program);
// clSetKernelArg: a buffer past the limit given to a kernel built without the option is a fault
void large_buffers_check_arg(cl_kernel kernel, size_t size, const void* value);
// made past the limit, and faults
uint64_t large_buffers_made(void);
uint64_t large_buffers_faults(void);

#endif
