// Intel's relaxed allocation limits, emulated: what and why in large_buffers.h.
#define _POSIX_C_SOURCE 200809L  // strdup
#include "large_buffers.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static const struct _cl_icd_dispatch* next;
static cl_ulong limit;  // the emulated largest allocation; 0: not emulated
static uint64_t made, faults;

// handles remembered: the buffers past the limit, the programs built with the option
typedef struct {
    void** items;
    size_t n, cap;
} Handles;
static Handles large_mems, large_programs;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void add_handle(Handles* h, void* item) {
    pthread_mutex_lock(&lock);
    if (h->n == h->cap) {
        size_t cap = h->cap ? 2 * h->cap : 64;
        void** grown = realloc(h->items, cap * sizeof(void*));
        if (grown) h->items = grown, h->cap = cap;
    }
    if (h->n < h->cap) h->items[h->n++] = item;
    pthread_mutex_unlock(&lock);
}

static int has_handle(Handles* h, const void* item) {
    pthread_mutex_lock(&lock);
    size_t i = 0;
    while (i < h->n && h->items[i] != item) ++i;
    const int found = i < h->n;
    pthread_mutex_unlock(&lock);
    return found;
}

static void remove_handle(Handles* h, const void* item) {  // a released handle may be given again
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < h->n; ++i)
        if (h->items[i] == item) h->items[i--] = h->items[--h->n];
    pthread_mutex_unlock(&lock);
}

void large_buffers_init(const struct _cl_icd_dispatch* target) {
    next = target;
    const char* text = getenv(MAX_ALLOC_ENV);
    limit = text ? strtoull(text, NULL, 10) : 0;
}

int large_buffers_active(void) { return limit != 0; }

int large_buffers_device_info(cl_device_id device, cl_device_info what, size_t size, void* value, size_t* size_ret,
                              cl_int* err) {
    if (what == CL_DEVICE_MAX_MEM_ALLOC_SIZE) {
        cl_ulong real = 0;
        *err = next->clGetDeviceInfo(device, what, sizeof(real), &real, NULL);
        if (size_ret) *size_ret = sizeof(cl_ulong);
        if (*err == CL_SUCCESS && value) {
            if (size < sizeof(cl_ulong)) *err = CL_INVALID_VALUE;
            else *(cl_ulong*)value = real < limit ? real : limit;
        }
        return 1;
    }
    if (what != CL_DEVICE_EXTENSIONS) return 0;
    size_t real = 0;  // with its terminating NUL
    *err = next->clGetDeviceInfo(device, what, 0, NULL, &real);
    if (*err != CL_SUCCESS) return 1;
    const size_t total = real + 1 + strlen(RELAX_EXTENSION);
    if (size_ret) *size_ret = total;
    if (value == NULL) return 1;
    if (size < total) {
        *err = CL_INVALID_VALUE;
        return 1;
    }
    *err = next->clGetDeviceInfo(device, what, size, value, NULL);
    if (*err == CL_SUCCESS) {
        char* text = value;
        size_t end = strlen(text);
        if (end && text[end - 1] != ' ') text[end++] = ' ';
        strcpy(text + end, RELAX_EXTENSION);
    }
    return 1;
}

cl_mem large_buffers_create(cl_context context, cl_mem_flags flags, size_t size, void* host, cl_int* err) {
    const int unrestricted = (flags & UNRESTRICTED_SIZE_FLAG) != 0;
    flags &= ~UNRESTRICTED_SIZE_FLAG;  // the CPU runtime refuses the flag
    if (limit && size > limit && !unrestricted) {
        if (err) *err = CL_INVALID_BUFFER_SIZE;  // the driver's answer past the limit
        return NULL;
    }
    cl_mem buffer = next->clCreateBuffer(context, flags, size, host, err);
    if (buffer && limit && size > limit) {
        add_handle(&large_mems, buffer);
        __atomic_fetch_add(&made, 1, __ATOMIC_RELAXED);
    }
    return buffer;
}

cl_int large_buffers_release(cl_mem buffer) {
    cl_uint refs = 0;
    next->clGetMemObjectInfo(buffer, CL_MEM_REFERENCE_COUNT, sizeof(refs), &refs, NULL);
    cl_int err = next->clReleaseMemObject(buffer);
    if (err == CL_SUCCESS && refs == 1) remove_handle(&large_mems, buffer);
    return err;
}

char* large_buffers_options(cl_program program, const char* options) {
    char* out = strdup(options ? options : "");
    if (out == NULL) return NULL;
    const size_t n = strlen(LARGE_BUFFER_OPTION);
    char* at = strstr(out, LARGE_BUFFER_OPTION);
    if (at == NULL || (at[n] != '\0' && at[n] != ' ')) return out;
    memmove(at, at + n, strlen(at + n) + 1);
    if (limit) add_handle(&large_programs, program);
    return out;
}

void large_buffers_built(cl_program program, cl_program built) {
    if (built != program && has_handle(&large_programs, program)) add_handle(&large_programs, built);
}

void large_buffers_forget_program(cl_program program) {
    if (limit) remove_handle(&large_programs, program);
}

void large_buffers_check_arg(cl_kernel kernel, size_t size, const void* value) {
    if (!limit || size != sizeof(cl_mem) || value == NULL || !has_handle(&large_mems, *(const cl_mem*)value)) return;
    cl_program program = NULL;
    next->clGetKernelInfo(kernel, CL_KERNEL_PROGRAM, sizeof(program), &program, NULL);
    if (!has_handle(&large_programs, program)) __atomic_fetch_add(&faults, 1, __ATOMIC_RELAXED);
}

uint64_t large_buffers_made(void) { return __atomic_load_n(&made, __ATOMIC_RELAXED); }
uint64_t large_buffers_faults(void) { return __atomic_load_n(&faults, __ATOMIC_RELAXED); }
