/* A CUDA driver-API probe for the real-GPU kit (tests/gpu/README.md).
 *
 * It loads libcuda.so.1 at run time, so it builds with a bare C compiler and no CUDA
 * toolkit: `cc -O2 -o probe probe.c -ldl`.  It initialises CUDA, takes the primary context
 * of every device CUDA gives it (as a CUDA program does, which is when NVML starts listing
 * it as a compute process), allocates --mem MiB on each, optionally holds them --hold
 * seconds, frees them and prints ONE JSON line on stdout:
 *
 *   {"pid", "uid", "cvd", "mps_pipe", "mps_threads", "devices": ["GPU-…", …], "start", "ready",
 *    "end", "error"}
 *
 * start/ready/end are CLOCK_REALTIME in seconds: start at entry to main (before cuInit),
 * ready once every context and allocation exists, end just before printing.  devices are
 * the UUIDs CUDA reports (cuDeviceGetUuid_v2 where the driver has it), written as NVML
 * writes a GPU's UUID.  `--ready FILE` writes its pid to FILE once ready, so a caller can
 * wait for the contexts to exist instead of sleeping.  cvd, mps_pipe and mps_threads are
 * CUDA_VISIBLE_DEVICES, CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (null
 * when unset).  Exit status: 0; 100 when CUDA has no device
 * (cudaErrorNoDevice); 1 on any other CUDA failure (error says which call); 2 bad usage.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"

#define MAX_DEVICES 64

/* Loaded with dlsym; typed from the declarations so a mismatch fails to compile. */
static __typeof__(cuInit) *p_cuInit;
static __typeof__(cuDeviceGetCount) *p_cuDeviceGetCount;
static __typeof__(cuDeviceGet) *p_cuDeviceGet;
static __typeof__(cuDeviceGetUuid_v2) *p_cuDeviceGetUuid;
static __typeof__(cuDevicePrimaryCtxRetain) *p_cuDevicePrimaryCtxRetain;
static __typeof__(cuCtxSetCurrent) *p_cuCtxSetCurrent;
static __typeof__(cuMemAlloc_v2) *p_cuMemAlloc;
static __typeof__(cuMemFree_v2) *p_cuMemFree;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void format_uuid(const CUuuid *u, char *out) {
    const unsigned char *b = (const unsigned char *)u->bytes;
    sprintf(out, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
            b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* JSON string: the value of CUDA_VISIBLE_DEVICES may hold anything a user typed. */
static void put_string(const char *s) {
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static void put_env(const char *name) {
    const char *value = getenv(name);
    if (value)
        put_string(value);
    else
        printf("null");
}

struct result {
    double start, ready, end;
    int count;
    char uuids[MAX_DEVICES][48];
    char error[160];
};

static void report(const struct result *r) {
    printf("{\"pid\": %d, \"uid\": %d, \"cvd\": ", (int)getpid(), (int)getuid());
    put_env("CUDA_VISIBLE_DEVICES");
    printf(", \"mps_pipe\": ");
    put_env("CUDA_MPS_PIPE_DIRECTORY");
    printf(", \"mps_threads\": ");
    put_env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    printf(", \"devices\": [");
    for (int i = 0; i < r->count; i++) {
        if (i)
            printf(", ");
        put_string(r->uuids[i]);
    }
    printf("], \"start\": %.6f, \"ready\": ", r->start);
    if (r->ready > 0)
        printf("%.6f", r->ready);
    else
        printf("null");
    printf(", \"end\": %.6f, \"error\": ", r->end);
    if (r->error[0])
        put_string(r->error);
    else
        printf("null");
    printf("}\n");
    fflush(stdout);
}

static int load(void *lib, void **slot, const char *name, struct result *r) {
    *slot = dlsym(lib, name);
    if (!*slot) {
        snprintf(r->error, sizeof r->error, "libcuda.so.1 has no %s", name);
        return -1;
    }
    return 0;
}

static int load_all(struct result *r) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        snprintf(r->error, sizeof r->error, "dlopen libcuda.so.1: %s", dlerror());
        return -1;
    }
    if (load(lib, (void **)&p_cuInit, "cuInit", r) || load(lib, (void **)&p_cuDeviceGetCount, "cuDeviceGetCount", r) ||
        load(lib, (void **)&p_cuDeviceGet, "cuDeviceGet", r) ||
        load(lib, (void **)&p_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", r) ||
        load(lib, (void **)&p_cuCtxSetCurrent, "cuCtxSetCurrent", r) ||
        load(lib, (void **)&p_cuMemAlloc, "cuMemAlloc_v2", r) || load(lib, (void **)&p_cuMemFree, "cuMemFree_v2", r))
        return -1;
    /* _v2 reports a MIG instance's own UUID; the old call its parent GPU's. */
    p_cuDeviceGetUuid = (__typeof__(cuDeviceGetUuid_v2) *)dlsym(lib, "cuDeviceGetUuid_v2");
    if (!p_cuDeviceGetUuid)
        return load(lib, (void **)&p_cuDeviceGetUuid, "cuDeviceGetUuid", r);
    return 0;
}

static int failed(struct result *r, const char *call, CUresult rc) {
    snprintf(r->error, sizeof r->error, "%s: CUDA error %d", call, rc);
    return rc == CUDA_ERROR_NO_DEVICE ? 100 : 1;
}

static int run(struct result *r, double hold, size_t mib, const char *ready_file) {
    static CUdeviceptr mem[MAX_DEVICES];
    static CUcontext ctxs[MAX_DEVICES];
    CUdevice dev;
    int n = 0, status = 0;
    CUresult rc;

    if (load_all(r))
        return 1;
    if ((rc = p_cuInit(0)) != 0)
        return failed(r, "cuInit", rc);
    if ((rc = p_cuDeviceGetCount(&n)) != 0)
        return failed(r, "cuDeviceGetCount", rc);
    if (n == 0)
        return failed(r, "cuDeviceGetCount", CUDA_ERROR_NO_DEVICE);
    if (n > MAX_DEVICES)
        n = MAX_DEVICES;
    for (int i = 0; i < n; i++) {
        CUuuid uuid;
        if ((rc = p_cuDeviceGet(&dev, i)) != 0)
            return failed(r, "cuDeviceGet", rc);
        if ((rc = p_cuDeviceGetUuid(&uuid, dev)) != 0)
            return failed(r, "cuDeviceGetUuid", rc);
        format_uuid(&uuid, r->uuids[i]);
        r->count = i + 1;
        if ((rc = p_cuDevicePrimaryCtxRetain(&ctxs[i], dev)) != 0)
            return failed(r, "cuDevicePrimaryCtxRetain", rc);
        if ((rc = p_cuCtxSetCurrent(ctxs[i])) != 0)
            return failed(r, "cuCtxSetCurrent", rc);
        if (mib && (rc = p_cuMemAlloc(&mem[i], mib << 20)) != 0)
            return failed(r, "cuMemAlloc_v2", rc);
    }
    r->ready = now();
    if (ready_file) {
        /* Its pid, written to a temporary name and renamed: a reader never sees it half. */
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.%d.tmp", ready_file, (int)getpid());
        FILE *f = fopen(tmp, "w");
        if (f) {
            fprintf(f, "%d\n", (int)getpid());
            if (fclose(f) == 0)
                rename(tmp, ready_file);
        }
    }
    if (hold > 0) {
        struct timespec ts = {(time_t)hold, (long)((hold - (double)(time_t)hold) * 1e9)};
        while (nanosleep(&ts, &ts) != 0) {
        }
    }
    for (int i = 0; i < n && mib; i++) {
        p_cuCtxSetCurrent(ctxs[i]);
        if ((rc = p_cuMemFree(mem[i])) != 0)
            status = failed(r, "cuMemFree_v2", rc);
    }
    return status;
}

static void usage(void) {
    fprintf(stderr, "usage: probe [--hold SECONDS] [--mem MIB] [--ready FILE]\n");
    exit(2);
}

int main(int argc, char **argv) {
    struct result r;
    double hold = 0;
    long mib = 16;
    const char *ready_file = NULL;
    char *end;

    memset(&r, 0, sizeof r);
    r.start = now();
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc)
            usage();
        if (!strcmp(argv[i], "--hold")) {
            hold = strtod(argv[++i], &end);
            if (*end || hold < 0)
                usage();
        } else if (!strcmp(argv[i], "--mem")) {
            mib = strtol(argv[++i], &end, 10);
            if (*end || mib < 0)
                usage();
        } else if (!strcmp(argv[i], "--ready")) {
            ready_file = argv[++i];
        } else {
            usage();
        }
    }
    int status = run(&r, hold, (size_t)mib, ready_file);
    r.end = now();
    report(&r);
    return status;
}
