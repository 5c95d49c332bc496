// A cache of built OpenCL programs on disk for the emulation layer (gpu_identity_layer.c): Intel's
// OpenCL CPU runtime compiles each program from source with LLVM, which takes the emulated plugin
// tens of seconds per model and again per new shape, in every process. A program built once from
// a source, with the same options, for the same device and runtime, is loaded from its binary
// (CL_PROGRAM_BINARIES, which that runtime saves and loads: "final kernel binary save/load").
// Active only where OVKC_PROGRAM_CACHE names a folder (ov_kvcrush.gpu.emulation.enable() sets it).
#ifndef OVKC_PROGRAM_CACHE_H
#define OVKC_PROGRAM_CACHE_H
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <CL/cl_icd.h>

// the environment variable naming the cache's folder (ov_kvcrush.gpu.emulation.PROGRAM_CACHE_ENV)
#define PROGRAM_CACHE_ENV "OVKC_PROGRAM_CACHE"

// the runtime below the layer, and the source a program was made from (its final text, shims in)
void program_cache_init(const struct _cl_icd_dispatch* next);
void program_cache_remember(cl_program program, const char* source);

// clBuildProgram: a program remembered with a source is loaded from its binary when one is cached
// for its source, options and device (then it stands in for the program: program_cache_built), or
// built and its binary cached
cl_int CL_API_CALL program_cache_build(cl_program program, cl_uint n, const cl_device_id* devices,
                                       const char* options, void(CL_CALLBACK* notify)(cl_program, void*),
                                       void* user_data);
// the program that holds ``program``'s build: the one loaded from the cache, or ``program`` itself
cl_program program_cache_built(cl_program program);
// what asks a program for its build goes to the program that holds it
cl_int CL_API_CALL program_cache_program_info(cl_program program, cl_program_info what, size_t size, void* value,
                                              size_t* size_ret);
cl_int CL_API_CALL program_cache_build_info(cl_program program, cl_device_id device, cl_program_build_info what,
                                            size_t size, void* value, size_t* size_ret);
// clReleaseProgram: the last release of a program lets go of the one standing in for it
cl_int CL_API_CALL program_cache_release(cl_program program);

#endif
