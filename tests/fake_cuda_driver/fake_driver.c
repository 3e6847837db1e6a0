/* A FAKE CUDA driver (test support; no GPU, no NVIDIA code): libcuda.so.1 for PyCUDA in CI.
 *
 * Linked with the stub generated from the toolkit's headers (generate_stub.py), whose weak
 * entry points answer CUDA_ERROR_NOT_SUPPORTED; this file defines the 34 entry points that
 * fa_verify's PyCUDA runner reaches. Host memory stands in for device memory. A module load
 * keeps the cubin only to check what a driver checks (ELF, architecture, the toolkit that
 * built it, the entry names); the cubin is never executed: cuLaunchKernel hands the entry
 * name, the launch geometry and the packed parameters to launch.py (Python, in this process),
 * which runs the same entry of a CPU build of the same .cu on fa_verify's CUDA-on-CPU runner.
 *
 * Settings, read at cuInit from the environment (tests set them per worker process):
 *   FA_FAKE_CUDA_DEVICES         "8.0:166912,9.0:232448": one device per item, compute
 *                                capability and opt-in shared memory per block (bytes)
 *   FA_FAKE_CUDA_MEMORY          bytes of memory per device (default 1 GiB)
 *   FA_FAKE_CUDA_DRIVER_VERSION  the CUDA version the driver reports (default 13000)
 *   FA_FAKE_CUDA_FAULTS          "cuMemAlloc_v2=2,cuLaunchKernel=700": entry point=CUresult
 *                                to return instead of doing the work
 * It refuses to start (cuInit fails) on a machine with a real NVIDIA driver.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_DEVICES 8
#define MAX_CONTEXT_STACK 16
#define DEFAULT_SHARED 49152
#define SHARED_PER_SM_EXTRA 1024

typedef struct { int major, minor, optin_shared; size_t memory, used; } Device;
struct CUctx_st { int device; int refs; CUresult sticky; };
struct CUmod_st { struct CUctx_st *ctx; unsigned char *image; size_t size; struct CUfunc_st *functions; };
struct CUfunc_st { struct CUmod_st *module; char name[256]; int max_dynamic_shared; struct CUfunc_st *next; };
typedef struct Allocation { uintptr_t base; size_t size; int device; struct Allocation *next; } Allocation;

static Device devices[MAX_DEVICES];
static int device_count = -1;
static int driver_version = 13000;
static struct CUctx_st primary[MAX_DEVICES];
static __thread struct CUctx_st *stack[MAX_CONTEXT_STACK];
static __thread int depth;
static Allocation *allocations;

/* --- settings and faults ------------------------------------------------------------------ */

static CUresult fault(const char *entry) {
    const char *faults = getenv("FA_FAKE_CUDA_FAULTS");
    size_t n = strlen(entry);
    for (const char *p = faults; p && *p;) {
        if (strncmp(p, entry, n) == 0 && p[n] == '=') return (CUresult)atoi(p + n + 1);
        p = strchr(p, ',');
        p = p ? p + 1 : NULL;
    }
    return CUDA_SUCCESS;
}
#define FAULT(entry) do { CUresult injected_ = fault(entry); if (injected_) return injected_; } while (0)

static int real_driver_here(void) {
    return access("/proc/driver/nvidia", F_OK) == 0 || access("/dev/nvidiactl", F_OK) == 0;
}

static void read_devices(void) {
    const char *spec = getenv("FA_FAKE_CUDA_DEVICES");
    const char *memory = getenv("FA_FAKE_CUDA_MEMORY");
    const char *version = getenv("FA_FAKE_CUDA_DRIVER_VERSION");
    if (!spec || !*spec) spec = "8.0:166912";
    if (version) driver_version = atoi(version);
    device_count = 0;
    for (const char *p = spec; p && *p && device_count < MAX_DEVICES;) {
        Device *d = &devices[device_count++];
        d->optin_shared = DEFAULT_SHARED;
        sscanf(p, "%d.%d:%d", &d->major, &d->minor, &d->optin_shared);
        d->memory = memory ? strtoull(memory, NULL, 10) : (size_t)1 << 30;
        p = strchr(p, ',');
        p = p ? p + 1 : NULL;
    }
}

/* --- driver, devices ------------------------------------------------------------------------- */

CUresult cuInit(unsigned int flags) {
    (void)flags;
    if (real_driver_here()) {
        fprintf(stderr, "fa_verify's fake CUDA driver refuses to run on a machine with a real NVIDIA driver\n");
        return CUDA_ERROR_NOT_PERMITTED;
    }
    FAULT("cuInit");
    read_devices();
    return CUDA_SUCCESS;
}

#define NEEDS_INIT() do { if (device_count < 0) return CUDA_ERROR_NOT_INITIALIZED; } while (0)
#define CHECK_DEVICE(dev) do { NEEDS_INIT(); if ((dev) < 0 || (dev) >= device_count) return CUDA_ERROR_INVALID_DEVICE; } while (0)

CUresult cuDriverGetVersion(int *version) { FAULT("cuDriverGetVersion"); *version = driver_version; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *count) { NEEDS_INIT(); FAULT("cuDeviceGetCount"); *count = device_count; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *dev, int ordinal) { CHECK_DEVICE(ordinal); FAULT("cuDeviceGet"); *dev = ordinal; return CUDA_SUCCESS; }

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    CHECK_DEVICE(dev);
    snprintf(name, (size_t)len, "fa_verify fake driver device %d (sm_%d%d)", dev, devices[dev].major, devices[dev].minor);
    return CUDA_SUCCESS;
}

CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev) {
    CHECK_DEVICE(dev);
    *major = devices[dev].major;
    *minor = devices[dev].minor;
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem(size_t *bytes, CUdevice dev) { CHECK_DEVICE(dev); *bytes = devices[dev].memory; return CUDA_SUCCESS; }

CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attr, CUdevice dev) {
    CHECK_DEVICE(dev);
    FAULT("cuDeviceGetAttribute");
    Device *d = &devices[dev];
    switch (attr) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = d->major; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = d->minor; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = d->optin_shared; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *value = DEFAULT_SHARED; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *value = d->optin_shared + SHARED_PER_SM_EXTRA; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *value = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *value = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *value = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *value = 65535; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *value = 32; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 1; break;
    default: *value = 0; break;
    }
    return CUDA_SUCCESS;
}

/* --- contexts -------------------------------------------------------------------------------- */

static struct CUctx_st *current(void) { return depth ? stack[depth - 1] : NULL; }

static CUresult push(struct CUctx_st *ctx) {
    if (depth == MAX_CONTEXT_STACK) return CUDA_ERROR_INVALID_VALUE;
    stack[depth++] = ctx;
    return CUDA_SUCCESS;
}

/* Every call that works on the current context: none -> INVALID_CONTEXT; a fault -> sticky. */
#define NEEDS_CONTEXT(ctx) struct CUctx_st *ctx = current(); \
    if (!ctx) return CUDA_ERROR_INVALID_CONTEXT; \
    if (ctx->sticky) return ctx->sticky

CUresult cuCtxCreate(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev) {
    (void)params; (void)flags;
    CHECK_DEVICE(dev);
    FAULT("cuCtxCreate");
    struct CUctx_st *ctx = calloc(1, sizeof *ctx);
    ctx->device = dev;
    ctx->refs = 1;
    *pctx = ctx;
    return push(ctx);
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    CHECK_DEVICE(dev);
    FAULT("cuDevicePrimaryCtxRetain");
    primary[dev].device = dev;
    primary[dev].refs++;
    *pctx = &primary[dev];
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { CHECK_DEVICE(dev); if (primary[dev].refs) primary[dev].refs--; return CUDA_SUCCESS; }

CUresult cuCtxDestroy(CUcontext ctx) {
    for (int i = 0; i < depth; ++i)
        if (stack[i] == ctx) { memmove(&stack[i], &stack[i + 1], (size_t)(depth - i - 1) * sizeof *stack); --depth; --i; }
    if (ctx < &primary[0] || ctx >= &primary[MAX_DEVICES]) free(ctx);
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent(CUcontext ctx) { NEEDS_INIT(); return push(ctx); }
CUresult cuCtxPopCurrent(CUcontext *pctx) {
    if (!depth) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUctx_st *ctx = stack[--depth];
    if (pctx) *pctx = ctx;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext *pctx) { *pctx = current(); return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (depth) stack[depth - 1] = ctx; else if (ctx) return push(ctx);
    return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(CUdevice *dev) { struct CUctx_st *ctx = current(); if (!ctx) return CUDA_ERROR_INVALID_CONTEXT; *dev = ctx->device; return CUDA_SUCCESS; }
CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version) { (void)ctx; *version = 3020; return CUDA_SUCCESS; }
CUresult cuCtxSynchronize(void) { NEEDS_CONTEXT(ctx); FAULT("cuCtxSynchronize"); return CUDA_SUCCESS; }
CUresult cuStreamSynchronize(CUstream stream) { (void)stream; NEEDS_CONTEXT(ctx); return CUDA_SUCCESS; }

/* --- memory: host memory, counted against the device's size ---------------------------------- */

static Allocation *find_allocation(uintptr_t address) {
    for (Allocation *a = allocations; a; a = a->next)
        if (address >= a->base && address < a->base + (a->size ? a->size : 1)) return a;
    return NULL;
}

/* For launch.py: the allocation holding `address` (base and size), 0 if none. */
int fa_fake_cuda_allocation(uintptr_t address, uintptr_t *base, size_t *size) {
    Allocation *a = find_allocation(address);
    if (!a) return 0;
    *base = a->base;
    *size = a->size;
    return 1;
}

CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytes) {
    NEEDS_CONTEXT(ctx);
    FAULT("cuMemAlloc_v2");
    Device *d = &devices[ctx->device];
    if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    if (d->used + bytes > d->memory) return CUDA_ERROR_OUT_OF_MEMORY;
    void *p = aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    Allocation *a = malloc(sizeof *a);
    *a = (Allocation){(uintptr_t)p, bytes, ctx->device, allocations};
    allocations = a;
    d->used += bytes;
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult cuMemFree(CUdeviceptr dptr) {
    for (Allocation **p = &allocations; *p; p = &(*p)->next)
        if ((*p)->base == (uintptr_t)dptr) {
            Allocation *a = *p;
            *p = a->next;
            devices[a->device].used -= a->size;
            free((void *)a->base);
            free(a);
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemGetInfo(size_t *free_bytes, size_t *total) {
    NEEDS_CONTEXT(ctx);
    *total = devices[ctx->device].memory;
    *free_bytes = *total - devices[ctx->device].used;
    return CUDA_SUCCESS;
}

/* A copy touching device memory must stay inside one allocation, as on a GPU. */
static CUresult check_range(CUdeviceptr dptr, size_t bytes) {
    Allocation *a = find_allocation((uintptr_t)dptr);
    if (!a || (uintptr_t)dptr + bytes > a->base + a->size) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t bytes) {
    NEEDS_CONTEXT(ctx);
    FAULT("cuMemcpyHtoD_v2");
    CUresult r = check_range(dst, bytes);
    if (!r) memcpy((void *)(uintptr_t)dst, src, bytes);
    return r;
}

CUresult cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t bytes) {
    NEEDS_CONTEXT(ctx);
    FAULT("cuMemcpyDtoH_v2");
    CUresult r = check_range(src, bytes);
    if (!r) memcpy(dst, (const void *)(uintptr_t)src, bytes);
    return r;
}

CUresult cuMemsetD8(CUdeviceptr dst, unsigned char value, size_t n) {
    NEEDS_CONTEXT(ctx);
    CUresult r = check_range(dst, n);
    if (!r) memset((void *)(uintptr_t)dst, value, n);
    return r;
}

/* --- modules: the cubin is checked, never run ------------------------------------------------- */

/* The image's size from its ELF header (the section header table ends a cubin), 0 if not ELF. */
static size_t elf_size(const unsigned char *image) {
    if (!image || memcmp(image, "\177ELF", 4) != 0 || image[4] != 2) return 0;
    uint64_t shoff, phoff;
    uint16_t phentsize, phnum, shentsize, shnum;
    memcpy(&phoff, image + 32, 8); memcpy(&shoff, image + 40, 8);
    memcpy(&phentsize, image + 54, 2); memcpy(&phnum, image + 56, 2);
    memcpy(&shentsize, image + 58, 2); memcpy(&shnum, image + 60, 2);
    uint64_t end_sections = shoff + (uint64_t)shentsize * shnum, end_segments = phoff + (uint64_t)phentsize * phnum;
    return (size_t)(end_sections > end_segments ? end_sections : end_segments);
}

/* The CUDA release that built the cubin ("release 13.0" in its tool notes) as 13000, or 0. */
static int toolkit_version(const unsigned char *image, size_t size) {
    static const char tag[] = "compilation tools, release ";
    for (size_t i = 0; i + sizeof tag + 4 < size; ++i)
        if (memcmp(image + i, tag, sizeof tag - 1) == 0) {
            int major = 0, minor = 0;
            sscanf((const char *)image + i + sizeof tag - 1, "%d.%d", &major, &minor);
            return major * 1000 + minor * 10;
        }
    return 0;
}

CUresult cuModuleLoadData(CUmodule *module, const void *data) {
    NEEDS_CONTEXT(ctx);
    FAULT("cuModuleLoadData");
    const unsigned char *image = data;
    size_t size = elf_size(image);
    if (!size) return CUDA_ERROR_INVALID_IMAGE;  /* PTX text, a fatbin or a half-written file */
    uint32_t flags;
    memcpy(&flags, image + 48, 4);
    int arch = (flags >> 8) & 0xFF, sm = devices[ctx->device].major * 10 + devices[ctx->device].minor;
    if (arch / 10 != sm / 10 || arch > sm) return CUDA_ERROR_NO_BINARY_FOR_GPU;  /* cubins run within one major */
    int built_by = toolkit_version(image, size);  /* a cubin needs a driver of its CUDA major version or newer */
    if (built_by / 1000 > driver_version / 1000) return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
    struct CUmod_st *mod = calloc(1, sizeof *mod);
    mod->ctx = ctx;
    mod->size = size;
    mod->image = malloc(size);
    memcpy(mod->image, image, size);
    *module = mod;
    return CUDA_SUCCESS;
}

CUresult cuModuleLoadDataEx(CUmodule *module, const void *data, unsigned int n, CUjit_option *options, void **values) {
    (void)n; (void)options; (void)values;
    return cuModuleLoadData(module, data);
}

CUresult cuModuleUnload(CUmodule module) {
    for (struct CUfunc_st *f = module->functions, *next; f; f = next) { next = f->next; free(f); }
    free(module->image);
    free(module);
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
    NEEDS_CONTEXT(ctx);
    size_t n = strlen(name);
    char key[260];
    if (n > 255) return CUDA_ERROR_NOT_FOUND;
    key[0] = 0;
    memcpy(key + 1, name, n + 1);  /* symbol names sit between NULs in the string table */
    if (!memmem(module->image, module->size, key, n + 2)) return CUDA_ERROR_NOT_FOUND;
    for (struct CUfunc_st *f = module->functions; f; f = f->next)  /* one handle per name, as a driver */
        if (strcmp(f->name, name) == 0) { *function = f; return CUDA_SUCCESS; }  /* keeps its attributes */
    struct CUfunc_st *f = calloc(1, sizeof *f);
    f->module = module;
    memcpy(f->name, name, n + 1);
    f->max_dynamic_shared = DEFAULT_SHARED;
    f->next = module->functions;
    module->functions = f;
    *function = f;
    return CUDA_SUCCESS;
}

CUresult cuFuncGetAttribute(int *value, CUfunction_attribute attr, CUfunction f) {
    switch (attr) {
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *value = f->max_dynamic_shared; break;
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; break;
    default: *value = 0; break;
    }
    return CUDA_SUCCESS;
}

CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute attr, int value) {
    NEEDS_CONTEXT(ctx);
    FAULT("cuFuncSetAttribute");
    if (attr != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) return CUDA_SUCCESS;
    if (value < 0 || value > devices[f->module->ctx->device].optin_shared) return CUDA_ERROR_INVALID_VALUE;
    f->max_dynamic_shared = value;
    return CUDA_SUCCESS;
}

/* PyCUDA sets the block shape the legacy way before every cuLaunchKernel; the launch's own counts. */
CUresult cuFuncSetBlockShape(CUfunction f, int x, int y, int z) { (void)f; (void)x; (void)y; (void)z; return CUDA_SUCCESS; }

/* --- launches: run by launch.py on the CUDA-on-CPU runner ----------------------------------------- */

static CUresult run_in_python(CUfunction f, unsigned grid[3], unsigned block[3], unsigned shared,
                              const void *params, size_t size) {
    PyGILState_STATE gil = PyGILState_Ensure();
    CUresult result = CUDA_ERROR_LAUNCH_FAILED;
    PyObject *sys_path = PySys_GetObject("path");
    PyObject *folder = PyUnicode_FromString(FA_FAKE_DRIVER_PYTHON_DIR);
    if (sys_path && folder && !PySequence_Contains(sys_path, folder)) PyList_Insert(sys_path, 0, folder);
    Py_XDECREF(folder);
    PyObject *launch = PyImport_ImportModule("fake_cuda_driver.launch");
    PyObject *answer = launch ? PyObject_CallMethod(
        launch, "run", "s(III)(III)Iy#i", f->name, grid[0], grid[1], grid[2], block[0], block[1], block[2],
        shared, (const char *)params, (Py_ssize_t)size, f->module->ctx->device) : NULL;
    if (answer) result = (CUresult)PyLong_AsLong(answer);
    if (PyErr_Occurred()) PyErr_Print();
    Py_XDECREF(answer);
    Py_XDECREF(launch);
    PyGILState_Release(gil);
    return result;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, CUstream stream, void **kernel_params, void **extra) {
    (void)stream;
    NEEDS_CONTEXT(ctx);
    FAULT("cuLaunchKernel");
    if (f->module->ctx != ctx) return CUDA_ERROR_INVALID_HANDLE;  /* a function of another context */
    const void *params = NULL;
    size_t size = 0;
    for (void **e = extra; e && *e != CU_LAUNCH_PARAM_END; e += 2) {
        if (*e == CU_LAUNCH_PARAM_BUFFER_POINTER) params = e[1];
        else if (*e == CU_LAUNCH_PARAM_BUFFER_SIZE) size = *(size_t *)e[1];
    }
    if (kernel_params || !params) return CUDA_ERROR_NOT_SUPPORTED;  /* the fake takes packed parameters only */
    if ((unsigned long long)bx * by * bz > 1024 || bz > 64 || gy > 65535 || gz > 65535 || !gx || !gy || !gz)
        return CUDA_ERROR_INVALID_VALUE;
    if (shared > (unsigned)f->max_dynamic_shared) return CUDA_ERROR_INVALID_VALUE;  /* no opt-in for that much */
    unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    CUresult r = run_in_python(f, grid, block, shared, params, size);
    if (r == CUDA_ERROR_ILLEGAL_ADDRESS || r == CUDA_ERROR_LAUNCH_FAILED || r == CUDA_ERROR_LAUNCH_TIMEOUT) {
        ctx->sticky = r;  /* as on a GPU: the launch returns, the fault shows at the next synchronising */
        return CUDA_SUCCESS;  /* call, and the context stays unusable */
    }
    return r;
}
