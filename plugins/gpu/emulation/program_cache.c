// The emulation layer's cache of built programs (program_cache.h says why). A cached binary is
// found by a hash of its key (the device's name, the runtime's version, the build options and the
// source) and used only where the key stored beside it is the same, byte for byte: a hash
// collision builds from source. Files are written whole (a temporary renamed into place), so a
// process stopped while writing leaves no entry another would read.
#define _POSIX_C_SOURCE 200809L  // strdup
#include "program_cache.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const struct _cl_icd_dispatch* next;
static const char MAGIC[8] = {'O', 'V', 'K', 'C', 'P', 'R', 'G', '1'};

// -- the programs made from source, and the ones standing in for them -------------------------------
typedef struct Entry {
    cl_program program, built;  // built: the program loaded from the cache (NULL: none)
    char* source;               // until the program is built
    struct Entry* next;
} Entry;
static Entry* entries;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

void program_cache_init(const struct _cl_icd_dispatch* target) { next = target; }

static Entry* find(cl_program program) {  // lock held
    for (Entry* e = entries; e; e = e->next)
        if (e->program == program) return e;
    return NULL;
}

void program_cache_remember(cl_program program, const char* source) {
    if (program == NULL || getenv(PROGRAM_CACHE_ENV) == NULL) return;
    Entry* e = calloc(1, sizeof(Entry));
    if (e == NULL || (e->source = strdup(source)) == NULL) {
        free(e);
        return;
    }
    e->program = program;
    pthread_mutex_lock(&lock);
    e->next = entries;
    entries = e;
    pthread_mutex_unlock(&lock);
}

static char* take_source(cl_program program) {  // the source of a program not yet built, or NULL
    pthread_mutex_lock(&lock);
    Entry* e = find(program);
    char* source = e ? e->source : NULL;
    if (e) e->source = NULL;
    pthread_mutex_unlock(&lock);
    return source;
}

static void stand_in(cl_program program, cl_program built) {
    pthread_mutex_lock(&lock);
    Entry* e = find(program);
    if (e) e->built = built;
    pthread_mutex_unlock(&lock);
    if (e == NULL) next->clReleaseProgram(built);
}

cl_program program_cache_built(cl_program program) {
    pthread_mutex_lock(&lock);
    Entry* e = find(program);
    cl_program built = e && e->built ? e->built : program;
    pthread_mutex_unlock(&lock);
    return built;
}

cl_int CL_API_CALL program_cache_release(cl_program program) {
    cl_uint refs = 0;
    next->clGetProgramInfo(program, CL_PROGRAM_REFERENCE_COUNT, sizeof(refs), &refs, NULL);
    cl_int err = next->clReleaseProgram(program);
    if (err != CL_SUCCESS || refs != 1) return err;
    pthread_mutex_lock(&lock);  // its last release: a later program may get the same handle
    Entry** at = &entries;
    while (*at && (*at)->program != program) at = &(*at)->next;
    Entry* e = *at;
    if (e) *at = e->next;
    pthread_mutex_unlock(&lock);
    if (e && e->built) next->clReleaseProgram(e->built);
    if (e) free(e->source);
    free(e);
    return err;
}

cl_int CL_API_CALL program_cache_program_info(cl_program program, cl_program_info what, size_t size, void* value,
                                              size_t* size_ret) {
    cl_program built = what == CL_PROGRAM_REFERENCE_COUNT ? program : program_cache_built(program);
    return next->clGetProgramInfo(built, what, size, value, size_ret);
}

cl_int CL_API_CALL program_cache_build_info(cl_program program, cl_device_id device, cl_program_build_info what,
                                            size_t size, void* value, size_t* size_ret) {
    return next->clGetProgramBuildInfo(program_cache_built(program), device, what, size, value, size_ret);
}

// -- the key and the files ----------------------------------------------------------------------------
static char* device_text(cl_device_id device, cl_device_info what) {
    size_t size = 0;
    if (next->clGetDeviceInfo(device, what, 0, NULL, &size) != CL_SUCCESS) return NULL;
    char* text = calloc(size + 1, 1);
    if (text && next->clGetDeviceInfo(device, what, size, text, NULL) != CL_SUCCESS) {
        free(text);
        return NULL;
    }
    return text;
}

// The plugin heads a custom layer's program with a comment naming the model's node ("// Layer
// OvkcStore_1050 using Custom Layer OvkcStore"): the same layer's program in each model layer,
// and in each model converted again, differed by that name alone, and each was compiled anew
// (1,751 programs in the plugin's tests, 2026-12-02). A comment changes nothing built: the key
// holds such a line without the node's name.
static const char LAYER_LINE[] = "// Layer ", CUSTOM_LAYER[] = " using Custom Layer ";

static void append_source(char* out, size_t* at, const char* source) {
    for (const char* line = source; *line;) {
        const char* end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line) + 1 : strlen(line);
        const char* custom = NULL;
        if (strncmp(line, LAYER_LINE, sizeof(LAYER_LINE) - 1) == 0) {
            custom = strstr(line, CUSTOM_LAYER);
            if (custom && custom >= line + n) custom = NULL;
        }
        if (custom) {  // "// Layer" and what follows the node's name
            memcpy(out + *at, LAYER_LINE, sizeof(LAYER_LINE) - 2);
            *at += sizeof(LAYER_LINE) - 2;
            n -= (size_t)(custom - line);
            line = custom;
        }
        memcpy(out + *at, line, n);
        *at += n;
        line += n;
    }
}

// "ovkc program cache 2", the device's name, the runtime's version, the options, the source
// (custom layers' node names left out)
static char* make_key(cl_device_id device, const char* options, const char* source, size_t* len) {
    char *name = device_text(device, CL_DEVICE_NAME), *driver = device_text(device, CL_DRIVER_VERSION);
    char* key = NULL;
    if (name && driver) {
        const char* opts = options ? options : "";
        size_t size = strlen(name) + strlen(driver) + strlen(opts) + strlen(source) + 32;
        key = malloc(size);
        if (key) {
            size_t at = (size_t)snprintf(key, size, "ovkc program cache 2\n%s\n%s\n%s\n", name, driver, opts);
            append_source(key, &at, source);
            *len = at;
        }
    }
    free(name);
    free(driver);
    return key;
}

static void entry_path(char* path, size_t size, const char* key, size_t len) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a: picks the file; the key stored in it decides
    for (size_t i = 0; i < len; ++i) h = (h ^ (unsigned char)key[i]) * 1099511628211ull;
    snprintf(path, size, "%s/%016llx.bin", getenv(PROGRAM_CACHE_ENV), (unsigned long long)h);
}

// the binary cached for ``key``, or NULL
static unsigned char* read_entry(const char* key, size_t len, size_t* bin_len) {
    char path[4096];
    entry_path(path, sizeof(path), key, len);
    FILE* f = fopen(path, "rb");
    if (f == NULL) return NULL;
    char magic[8];
    uint64_t stored_len = 0, n = 0;
    unsigned char *stored = NULL, *bin = NULL;
    if (fread(magic, 1, 8, f) == 8 && memcmp(magic, MAGIC, 8) == 0 && fread(&stored_len, 8, 1, f) == 1 &&
        stored_len == len && (stored = malloc(len)) && fread(stored, 1, len, f) == len &&
        memcmp(stored, key, len) == 0 && fread(&n, 8, 1, f) == 1 && n > 0 && (bin = malloc(n)) &&
        fread(bin, 1, n, f) == n) {
        *bin_len = n;
    } else {
        free(bin);
        bin = NULL;
    }
    free(stored);
    fclose(f);
    return bin;
}

static void write_entry(const char* key, size_t len, const unsigned char* bin, size_t bin_len) {
    static uint64_t serial;
    char path[4096], tmp[4200];
    entry_path(path, sizeof(path), key, len);
    snprintf(tmp, sizeof(tmp), "%s.%ld.%llu.tmp", path, (long)getpid(),
             (unsigned long long)__atomic_fetch_add(&serial, 1, __ATOMIC_RELAXED));
    FILE* f = fopen(tmp, "wb");
    if (f == NULL) return;
    const uint64_t key_len = len, n = bin_len;
    int ok = fwrite(MAGIC, 1, 8, f) == 8 && fwrite(&key_len, 8, 1, f) == 1 && fwrite(key, 1, len, f) == len &&
             fwrite(&n, 8, 1, f) == 1 && fwrite(bin, 1, bin_len, f) == bin_len;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) remove(tmp);
}

// -- the build ----------------------------------------------------------------------------------------
static cl_program load(cl_program program, cl_device_id device, const char* options, const char* key,
                       size_t len) {
    size_t bin_len = 0;
    unsigned char* bin = read_entry(key, len, &bin_len);
    if (bin == NULL) return NULL;
    cl_context context = NULL;
    cl_int status = CL_SUCCESS, err = CL_SUCCESS;
    next->clGetProgramInfo(program, CL_PROGRAM_CONTEXT, sizeof(context), &context, NULL);
    const unsigned char* bins[1] = {bin};
    cl_program built = next->clCreateProgramWithBinary(context, 1, &device, &bin_len, bins, &status, &err);
    free(bin);
    if (built && (err != CL_SUCCESS || status != CL_SUCCESS ||
                  next->clBuildProgram(built, 1, &device, options, NULL, NULL) != CL_SUCCESS)) {
        next->clReleaseProgram(built);
        built = NULL;
    }
    return built;
}

static void save(cl_program program, const char* key, size_t len) {
    size_t bin_len = 0;
    if (next->clGetProgramInfo(program, CL_PROGRAM_BINARY_SIZES, sizeof(bin_len), &bin_len, NULL) != CL_SUCCESS ||
        bin_len == 0)
        return;
    unsigned char* bin = malloc(bin_len);
    unsigned char* bins[1] = {bin};
    if (bin && next->clGetProgramInfo(program, CL_PROGRAM_BINARIES, sizeof(bins), bins, NULL) == CL_SUCCESS)
        write_entry(key, len, bin, bin_len);
    free(bin);
}

static cl_device_id only_device(cl_program program, cl_uint n, const cl_device_id* devices) {
    if (n == 1 && devices) return devices[0];
    cl_uint count = 0;
    cl_device_id device = NULL;
    if (n == 0 && next->clGetProgramInfo(program, CL_PROGRAM_NUM_DEVICES, sizeof(count), &count, NULL) == CL_SUCCESS &&
        count == 1)
        next->clGetProgramInfo(program, CL_PROGRAM_DEVICES, sizeof(device), &device, NULL);
    return device;
}

cl_int CL_API_CALL program_cache_build(cl_program program, cl_uint n, const cl_device_id* devices,
                                       const char* options, void(CL_CALLBACK* notify)(cl_program, void*),
                                       void* user_data) {
    cl_device_id device = notify ? NULL : only_device(program, n, devices);  // a build of one device, waited for
    char* source = device ? take_source(program) : NULL;
    size_t len = 0;
    char* key = source ? make_key(device, options, source, &len) : NULL;
    free(source);
    cl_program built = key ? load(program, device, options, key, len) : NULL;
    if (built) {
        stand_in(program, built);
        free(key);
        return CL_SUCCESS;
    }
    cl_int err = next->clBuildProgram(program, n, devices, options, notify, user_data);
    if (err == CL_SUCCESS && key) save(program, key, len);
    free(key);
    return err;
}
