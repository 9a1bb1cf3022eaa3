/* A stand-in libcuda.so.1 (the CUDA driver API) for the simulated machine of the tests.
 *
 * Build: cc -shared -fPIC -O2 -o libcuda.so.1 -Wl,-soname,libcuda.so.1 libcuda.c
 * and put its directory on LD_LIBRARY_PATH beside the fake libnvidia-ml.so.1
 * (../fakenvml/FORMAT.md).  It gives a process the devices the real driver would, by the
 * rules ../support/fakecuda.py documents and implements (the topology in $FAKENVML_TOPOLOGY,
 * CUDA_VISIBLE_DEVICES as indices in CUDA's order or UUIDs, CUDA_DEVICE_ORDER, lost GPUs,
 * one MIG instance per process before R570, MPS clients of ../fakemps), and, like the real
 * driver, becomes visible to NVML when a context exists: cuDevicePrimaryCtxRetain registers
 * the process on that device in $FAKENVML_STATE/procs/<pid> (the context's memory plus
 * what cuMemAlloc_v2 took), which the fake NVML lists for as long as the pid lives.
 *
 * Only the calls a driver-API program needs to take a device exist: cuInit,
 * cuDriverGetVersion, cuDeviceGetCount, cuDeviceGet, cuDeviceGetName, cuDeviceGetUuid
 * (_v2), cuDevicePrimaryCtxRetain/Release, cuCtxSetCurrent, cuMemAlloc_v2, cuMemFree_v2,
 * cuGetErrorString.  No kernel runs; memory is bookkeeping.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "../gpu/cuda_abi.h"

#define MAX_GPUS 32
#define MAX_MIGS 8
#define MAX_DEVS (MAX_GPUS * MAX_MIGS)
#define MAX_ALLOCS 1024
#define UUID_LEN 96
#define CONTEXT_MIB 300 /* what a bare context costs on a real GPU, roughly */
#define MULTI_MIG_DRIVER 570

struct mig { char uuid[UUID_LEN]; int slot, gi, ci, used; };
struct gpu {
    char uuid[UUID_LEN], name[96];
    int mig_on, cc_major, cc_minor, lost, nmig;
    struct mig migs[MAX_MIGS];
};
struct device { char uuid[UUID_LEN], name[128]; int retained; long long mib; };

static struct gpu gpus[MAX_GPUS];
static int ngpus, driver_major, not_loaded;
static struct device devs[MAX_DEVS];
static int ndevs, initialised, current = -1, mps_fd = -1;
static struct { CUdeviceptr ptr; int dev; long long mib; } allocs[MAX_ALLOCS];
static CUdeviceptr next_ptr = 0x7f0000000000ULL;
static char reg_path[4096];

/* ---- the topology (the subset of ../fakenvml/FORMAT.md that CUDA's view needs) ---- */

/* The value of KEY=... in a line, or NULL; quoted values lose their quotes. */
static int field(const char *line, const char *key, char *out, size_t size) {
    size_t klen = strlen(key);
    for (const char *p = line; (p = strstr(p, key)) != NULL; p += klen) {
        if ((p != line && !isspace((unsigned char)p[-1])) || p[klen] != '=')
            continue;
        const char *v = p + klen + 1, *e;
        if (*v == '"') {
            e = strchr(++v, '"');
            if (!e)
                return 0;
        } else {
            for (e = v; *e && !isspace((unsigned char)*e) && *e != '#'; e++) {
            }
        }
        snprintf(out, size, "%.*s", (int)(e - v), v);
        return 1;
    }
    return 0;
}

static int word(const char *line, int n, char *out, size_t size) {
    const char *p = line;
    for (int i = 0;; i++) {
        while (*p && isspace((unsigned char)*p))
            p++;
        if (!*p || *p == '#')
            return 0;
        const char *s = p;
        while (*p && !isspace((unsigned char)*p) && *p != '#')
            p++;
        if (i == n) {
            snprintf(out, size, "%.*s", (int)(p - s), s);
            return 1;
        }
    }
}

static struct gpu *gpu_by_uuid(const char *uuid) {
    for (int i = 0; i < ngpus; i++)
        if (!strcmp(gpus[i].uuid, uuid))
            return &gpus[i];
    return NULL;
}

static void mark_lost(const char *list) {
    char buf[4096], *save = NULL;
    snprintf(buf, sizeof buf, "%s", list);
    for (char *u = strtok_r(buf, ",", &save); u; u = strtok_r(NULL, ",", &save)) {
        struct gpu *g = gpu_by_uuid(u);
        if (g)
            g->lost = 1;
    }
}

static void parse_line(const char *line, char *lost, size_t lost_size) {
    char kind[32], v[256];
    if (!word(line, 0, kind, sizeof kind))
        return;
    if (!strcmp(kind, "driver") && word(line, 1, v, sizeof v)) {
        driver_major = atoi(v);
    } else if (!strcmp(kind, "gpu") && ngpus < MAX_GPUS) {
        struct gpu *g = &gpus[ngpus++];
        field(line, "uuid", g->uuid, sizeof g->uuid);
        if (!field(line, "name", g->name, sizeof g->name))
            snprintf(g->name, sizeof g->name, "NVIDIA GPU");
        g->mig_on = field(line, "mig", v, sizeof v) && !strcmp(v, "on");
        g->cc_major = 8;
        if (field(line, "cc", v, sizeof v))
            sscanf(v, "%d.%d", &g->cc_major, &g->cc_minor);
    } else if (!strcmp(kind, "mig") && field(line, "parent", v, sizeof v)) {
        struct gpu *g = gpu_by_uuid(v);
        if (!g || g->nmig >= MAX_MIGS)
            return;
        struct mig *m = &g->migs[g->nmig++];
        field(line, "uuid", m->uuid, sizeof m->uuid);
        m->slot = field(line, "slot", v, sizeof v) ? atoi(v) : 0;
        m->gi = field(line, "gi", v, sizeof v) ? atoi(v) : 0;
        m->ci = field(line, "ci", v, sizeof v) ? atoi(v) : 0;
    } else if (!strcmp(kind, "fault") && word(line, 1, v, sizeof v)) {
        char value[2048] = "";
        word(line, 2, value, sizeof value);
        if (!strcmp(v, "driver_not_loaded"))
            not_loaded = 1;
        else if (!strcmp(v, "gpu_lost") && strlen(lost) + strlen(value) + 2 < lost_size)
            strcat(strcat(lost, ","), value);
    }
}

static int sort_migs(const void *a, const void *b) {
    return ((const struct mig *)a)->slot - ((const struct mig *)b)->slot;
}

static int read_topology(void) {
    const char *path = getenv("FAKENVML_TOPOLOGY");
    char line[8192], lost[4096] = "";
    FILE *f = path && *path ? fopen(path, "r") : NULL;
    if (!f)
        return -1;
    while (fgets(line, sizeof line, f))
        parse_line(line, lost, sizeof lost);
    fclose(f);
    mark_lost(lost);
    for (int i = 0; i < ngpus; i++)
        qsort(gpus[i].migs, (size_t)gpus[i].nmig, sizeof(struct mig), sort_migs);
    return 0;
}

/* ---- which devices CUDA gives this process ---- */

static int add(const char *uuid, const char *name) {
    for (int i = 0; i < ndevs; i++)
        if (!strcmp(devs[i].uuid, uuid))
            return -1; /* listed already: the list ends here */
    snprintf(devs[ndevs].uuid, UUID_LEN, "%s", uuid);
    snprintf(devs[ndevs].name, sizeof devs[ndevs].name, "%s", name);
    ndevs++;
    return 0;
}

static int add_gpu(const struct gpu *g) {
    if (!g->mig_on)
        return add(g->uuid, g->name);
    for (int i = 0; i < g->nmig; i++) {
        char name[128];
        snprintf(name, sizeof name, "%s MIG", g->name);
        if (add(g->migs[i].uuid, name))
            return -1;
    }
    return 0;
}

/* GPUs as CUDA numbers them: by compute capability, highest first (stable), unless
 * CUDA_DEVICE_ORDER=PCI_BUS_ID asks for NVML's order. */
static void cuda_order(const struct gpu **order) {
    const char *o = getenv("CUDA_DEVICE_ORDER");
    int pci = o && !strcmp(o, "PCI_BUS_ID");
    for (int i = 0; i < ngpus; i++)
        order[i] = &gpus[i];
    for (int i = 1; i < ngpus && !pci; i++)
        for (int j = i; j > 0; j--) {
            const struct gpu *a = order[j - 1], *b = order[j];
            if (a->cc_major > b->cc_major || (a->cc_major == b->cc_major && a->cc_minor >= b->cc_minor))
                break;
            order[j - 1] = b;
            order[j] = a;
        }
}

static int add_entry(const char *e, const struct gpu **order) {
    if (*e && strspn(e, "0123456789") == strlen(e)) {
        long n = strtol(e, NULL, 10);
        if (n >= ngpus || order[n]->lost)
            return -1;
        return add_gpu(order[n]);
    }
    if (!strncmp(e, "GPU-", 4) && e[4]) {
        const struct gpu *found = NULL;
        for (int i = 0; i < ngpus; i++)
            if (!strncmp(gpus[i].uuid, e, strlen(e))) {
                if (found)
                    return -1; /* ambiguous */
                found = &gpus[i];
            }
        return found && !found->lost ? add_gpu(found) : -1;
    }
    if (!strncmp(e, "MIG-GPU-", 8)) {
        char parent[UUID_LEN];
        int gi, ci, used = 0;
        if (sscanf(e + 4, "%95[^/]/%d/%d%n", parent, &gi, &ci, &used) != 3 || e[4 + used])
            return -1;
        struct gpu *g = gpu_by_uuid(parent);
        for (int i = 0; g && !g->lost && i < g->nmig; i++)
            if (g->migs[i].gi == gi && g->migs[i].ci == ci)
                return add(g->migs[i].uuid, g->name);
        return -1;
    }
    if (!strncmp(e, "MIG-", 4))
        for (int i = 0; i < ngpus; i++)
            for (int k = 0; k < gpus[i].nmig; k++)
                if (!strcmp(gpus[i].migs[k].uuid, e))
                    return gpus[i].lost ? -1 : add(e, gpus[i].name);
    return -1;
}

static void strip(char *s) {
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = 0;
    memmove(s, s + strspn(s, " \t\r\n"), strlen(s + strspn(s, " \t\r\n")) + 1);
}

static void resolve(const char *cvd) {
    const struct gpu *order[MAX_GPUS];
    cuda_order(order);
    if (!cvd) {
        for (int i = 0; i < ngpus; i++)
            if (!order[i]->lost)
                add_gpu(order[i]);
    } else {
        char buf[8192], *p = buf;
        snprintf(buf, sizeof buf, "%s", cvd);
        strip(buf);
        while (*buf) {
            char *comma = strchr(p, ',');
            if (comma)
                *comma = 0;
            strip(p);
            if (add_entry(p, order) || !comma)
                break;
            p = comma + 1;
        }
    }
    if (driver_major < MULTI_MIG_DRIVER) { /* one MIG instance per process: the first stays */
        int seen = 0, k = 0;
        for (int i = 0; i < ndevs; i++) {
            int mig = !strncmp(devs[i].uuid, "MIG-", 4);
            if (mig && seen++)
                continue;
            devs[k++] = devs[i];
        }
        ndevs = k;
    }
}

/* An MPS client: connected to the control daemon for the process's lifetime; its devices
 * are the server's, renumbered from 0 and narrowed by its own CUDA_VISIBLE_DEVICES. */
static CUresult mps_client(const char *pipe_dir, const char *cvd) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    char line[8192], *d, *save = NULL;
    struct device served[MAX_DEVS];
    int nserved = 0;
    size_t len = 0;

    snprintf(addr.sun_path, sizeof addr.sun_path, "%s/control", pipe_dir);
    mps_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (mps_fd < 0 || connect(mps_fd, (struct sockaddr *)&addr, sizeof addr) != 0)
        return CUDA_ERROR_DEVICES_UNAVAILABLE; /* no daemon: a context without the share's limits */
    dprintf(mps_fd, "CLIENT %d\n", (int)getpid());
    for (;;) { /* WAIT lines while another user's server still has clients */
        char c;
        ssize_t got = read(mps_fd, &c, 1);
        if (got <= 0)
            return CUDA_ERROR_DEVICES_UNAVAILABLE;
        if (c != '\n') {
            if (len + 1 < sizeof line)
                line[len++] = c;
            continue;
        }
        line[len] = 0;
        len = 0;
        if (strcmp(line, "WAIT"))
            break;
    }
    if (strncmp(line, "GO ", 3) || !(d = strstr(line, "devices=")))
        return CUDA_ERROR_DEVICES_UNAVAILABLE;
    d += strlen("devices=");
    d[strcspn(d, " ")] = 0;
    for (char *u = strtok_r(d, ",", &save); u && nserved < MAX_DEVS; u = strtok_r(NULL, ",", &save))
        snprintf(served[nserved++].uuid, UUID_LEN, "%s", u);
    if (!cvd) {
        for (int i = 0; i < nserved; i++)
            add(served[i].uuid, "NVIDIA GPU (MPS)");
        return CUDA_SUCCESS;
    }
    char buf[8192], *p = buf;
    snprintf(buf, sizeof buf, "%s", cvd);
    for (;;) {
        char *comma = strchr(p, ',');
        const char *found = NULL;
        if (comma)
            *comma = 0;
        strip(p);
        if (*p && strspn(p, "0123456789") == strlen(p)) {
            long n = strtol(p, NULL, 10);
            found = n < nserved ? served[n].uuid : NULL;
        } else {
            for (int i = 0, hits = 0; *p && i < nserved; i++)
                if (!strncmp(served[i].uuid, p, strlen(p)) && (p[0] == 'G' || !strcmp(served[i].uuid, p)))
                    found = hits++ ? NULL : served[i].uuid;
        }
        if (!found || add(found, "NVIDIA GPU (MPS)") || !comma)
            break;
        p = comma + 1;
    }
    return CUDA_SUCCESS;
}

/* ---- registration with the fake NVML ---- */

static void register_process(void) {
    const char *state = getenv("FAKENVML_STATE");
    char tmp[4096], body[MAX_DEVS * (UUID_LEN + 24)];
    size_t len = 0;
    if (!state || !*state)
        return;
    snprintf(reg_path, sizeof reg_path, "%s/procs/%d", state, (int)getpid());
    snprintf(tmp, sizeof tmp, "%s/procs/.%d.tmp", state, (int)getpid());
    for (int i = 0; i < ndevs; i++)
        if (devs[i].retained)
            len += (size_t)snprintf(body + len, sizeof body - len, "%s %lld\n", devs[i].uuid, devs[i].mib);
    if (!len) {
        unlink(reg_path);
        return;
    }
    FILE *f = fopen(tmp, "w");
    if (!f)
        return;
    fwrite(body, 1, len, f);
    if (fclose(f) == 0)
        rename(tmp, reg_path); /* the library never sees half a file */
}

__attribute__((destructor)) static void at_exit(void) {
    if (reg_path[0])
        unlink(reg_path); /* a normal exit tears the contexts down */
}

/* ---- the API ---- */

CUresult cuInit(unsigned int flags) {
    if (flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (initialised)
        return ndevs ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
    initialised = 1;
    if (read_topology() != 0 || not_loaded)
        return CUDA_ERROR_NO_DEVICE;
    const char *pipe_dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    if (pipe_dir && *pipe_dir) {
        CUresult rc = mps_client(pipe_dir, cvd);
        if (rc)
            return rc;
    } else {
        resolve(cvd);
    }
    return ndevs ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = 12080;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    if (!initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    *count = ndevs;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    if (!initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= ndevs)
        return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

static CUresult check(CUdevice dev) {
    if (!initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    return dev < 0 || dev >= ndevs ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    CUresult rc = check(dev);
    if (rc)
        return rc;
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", devs[dev].name);
    return CUDA_SUCCESS;
}

static CUresult uuid_of(CUuuid *uuid, const char *text) {
    const char *p = strchr(text, '-');
    int n = 0;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    memset(uuid, 0, sizeof *uuid);
    for (p = p ? p + 1 : text; *p && n < 32; p++) {
        if (!isxdigit((unsigned char)*p))
            continue;
        int v = isdigit((unsigned char)*p) ? *p - '0' : tolower((unsigned char)*p) - 'a' + 10;
        uuid->bytes[n / 2] = (char)(uuid->bytes[n / 2] | (n % 2 ? v : v << 4));
        n++;
    }
    return CUDA_SUCCESS;
}

/* A MIG instance's own UUID (the old call gives its parent GPU's, as the real driver does). */
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    CUresult rc = check(dev);
    return rc ? rc : uuid_of(uuid, devs[dev].uuid);
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    CUresult rc = check(dev);
    if (rc)
        return rc;
    for (int i = 0; i < ngpus; i++)
        for (int k = 0; k < gpus[i].nmig; k++)
            if (!strcmp(gpus[i].migs[k].uuid, devs[dev].uuid))
                return uuid_of(uuid, gpus[i].uuid);
    return uuid_of(uuid, devs[dev].uuid);
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
    CUresult rc = check(dev);
    if (rc)
        return rc;
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (devs[dev].retained++ == 0) {
        devs[dev].mib = CONTEXT_MIB;
        register_process();
    }
    *ctx = (CUcontext)&devs[dev]; /* opaque to the caller, as the real driver's */
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    CUresult rc = check(dev);
    if (rc)
        return rc;
    if (!devs[dev].retained)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (--devs[dev].retained == 0) {
        devs[dev].mib = 0;
        register_process();
    }
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { return cuDevicePrimaryCtxRelease(dev); }
CUresult cuDevicePrimaryCtxRetain_v2(CUcontext *ctx, CUdevice dev) { return cuDevicePrimaryCtxRetain(ctx, dev); }

CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (!initialised)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx) {
        current = -1;
        return CUDA_SUCCESS;
    }
    struct device *d = (struct device *)ctx;
    if (d < devs || d >= devs + ndevs || !d->retained)
        return CUDA_ERROR_INVALID_CONTEXT;
    current = (int)(d - devs);
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes) {
    if (!ptr || !bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (current < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (!allocs[i].ptr) {
            allocs[i].ptr = *ptr = next_ptr;
            next_ptr += (bytes + 0xfffff) & ~(CUdeviceptr)0xfffff;
            allocs[i].dev = current;
            allocs[i].mib = (long long)((bytes + (1 << 20) - 1) >> 20);
            devs[current].mib += allocs[i].mib;
            register_process();
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    for (int i = 0; ptr && i < MAX_ALLOCS; i++)
        if (allocs[i].ptr == ptr) {
            devs[allocs[i].dev].mib -= allocs[i].mib;
            allocs[i].ptr = 0;
            register_process();
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult rc, const char **text) {
    static const struct { CUresult rc; const char *text; } names[] = {
        {CUDA_SUCCESS, "no error"},
        {CUDA_ERROR_INVALID_VALUE, "invalid argument"},
        {CUDA_ERROR_NOT_INITIALIZED, "initialization error"},
        {CUDA_ERROR_DEVICES_UNAVAILABLE, "CUDA-capable device(s) is/are busy or unavailable"},
        {CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"},
        {CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"},
        {CUDA_ERROR_INVALID_CONTEXT, "invalid device context"},
    };
    if (!text)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (names[i].rc == rc) {
            *text = names[i].text;
            return CUDA_SUCCESS;
        }
    *text = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}
