/*
 * fakenvml.c - a stand-in for libnvidia-ml.so.1 that describes a machine
 * written down in a text file (see FORMAT.md next to this file).
 *
 * Build: cc -shared -fPIC -O2 -Wall -Wextra -Werror \
 *            -o DIR/libnvidia-ml.so.1 -Wl,-soname,libnvidia-ml.so.1 fakenvml.c
 *
 * Only the entry points cudawrap and its tools need are exported, under
 * their real names, with the real return codes and struct layouts.  Any
 * other symbol is absent on purpose: pynvml then raises
 * NVMLError_FunctionNotFound, exactly as it does against an old driver.
 *
 * The topology file is parsed again on every call.  That keeps the library
 * free of shared mutable state (each call works on its own heap copy, so
 * concurrent callers need no lock), and it lets a test rewrite the machine
 * under a running program.  A parse is a few microseconds for the largest
 * ready topology.
 *
 * Calls cost what they cost on real hardware (an NVIDIA H200 by default; see
 * "What calls cost" in FORMAT.md): each sleeps that long before answering.
 * FAKENVML_TIMING changes the costs, "none" removes them.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* ---- the slice of nvml.h we implement --------------------------------- */

typedef enum nvmlReturn_enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

typedef struct nvmlDevice_st {
    char opaque; /* only the address matters; see handle_of() */
} *nvmlDevice_t;

/* Layout behind nvmlDeviceGetPciInfo and _v2 (busId in the 16-byte legacy form). */
typedef struct {
    char busId[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int reserved0, reserved1, reserved2, reserved3;
} nvmlPciInfoLegacy_t;

/* nvmlPciInfo_t as used by nvmlDeviceGetPciInfo_v3. */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define NVML_STRUCT_VERSION(size, ver) ((unsigned int)(size) | ((unsigned int)(ver) << 24))
#define nvmlMemory_v2 NVML_STRUCT_VERSION(sizeof(nvmlMemory_v2_t), 2)

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* The unversioned nvmlDeviceGetComputeRunningProcesses keeps the R418 layout. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* _v2 and _v3 share this layout (nvmlProcessInfo_t in nvml.h). */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

#define NVML_DEVICE_MIG_DISABLE 0u
#define NVML_DEVICE_MIG_ENABLE 1u
#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu

/* ---- the machine, as read from the topology file ----------------------- */

#define MAX_GPUS 32
#define MAX_SLOTS 8        /* real parts top out at 7; one spare for odd topologies */
#define MAX_PROCS 1024
#define MAX_FILE (1 << 20) /* a topology beyond 1 MiB is a mistake, not a machine */
#define MAX_TOKENS 24
#define MAX_MIB (1ULL << 40)
#define UUID_BUF 96   /* NVML_DEVICE_UUID_V2_BUFFER_SIZE */
#define NAME_BUF 96   /* NVML_DEVICE_NAME_V2_BUFFER_SIZE */
#define VERSION_BUF 80
#define PROFILE_BUF 32
#define MIB 1048576ULL

enum mig_mode { MIG_UNSUPPORTED = -1, MIG_OFF = 0, MIG_ON = 1 };
enum perm_scope { PERM_OK = 0, PERM_DENY_PARENT = 1, PERM_DENY_ALL = 2 };
enum util_scope { UTIL_DENY_MIG = 0, UTIL_DENY_ALL = 1 };

struct fake_mig {
    int present;
    char uuid[UUID_BUF];
    char profile[PROFILE_BUF];
    unsigned int gi, ci;
    unsigned long long memory_mib, used_mib;
};

struct fake_gpu {
    char uuid[UUID_BUF];
    char name[NAME_BUF];
    unsigned long long memory_mib, used_mib, reserved_mib;
    int mig;
    unsigned int max_mig;
    unsigned int domain, bus, dev, fn;
    unsigned int pci_device_id, pci_subsystem_id;
    unsigned int util, mem_util;
    unsigned int cc_major, cc_minor; /* CUDA compute capability */
    unsigned int temp_c, power_mw, power_limit_mw, pstate; /* status readings */
    unsigned int minor; /* of its node /dev/nvidiaN (major 195) */
    int lost;
    int persistence_off; /* the driver lets go of the GPU when its last client leaves */
    struct fake_mig slot[MAX_SLOTS];
};

struct fake_proc {
    unsigned int pid;
    int gpu, slot; /* slot -1: the whole GPU */
    unsigned long long memory_mib;
};

/* What a `health` line sets for one GPU (health block at the end of this file). */
struct fake_health {
    unsigned int remapped_corr, remapped_unc, remap_pending, remap_failed;
    unsigned long long clocks_event_reasons;
    int set; /* 0: defaults (no remapped rows; clock reasons "idle") */
};

#define FAILS_DRIVER_VERSION 1
#define FAILS_DEVICE_COUNT 2

struct machine {
    char driver[VERSION_BUF];
    int cuda;
    int driver_not_loaded;
    int version_mismatch;
    int fails; /* FAILS_* bits: calls that answer NVML_ERROR_UNKNOWN after a good init */
    int perm;
    int util;
    int readings_not_supported;
    unsigned long slow_init_ms;
    int ngpus;
    struct fake_gpu gpu[MAX_GPUS];
    int nprocs;
    struct fake_proc procs[MAX_PROCS];
    struct fake_health health[MAX_GPUS]; /* `health` lines (health block at the end) */
    char error[512]; /* non-empty: the topology could not be used */
};

/* ---- handles ----------------------------------------------------------- */

/*
 * A handle is the address of a cell in this table: row = GPU index, column 0
 * = the GPU itself, column 1 + s = MIG slot s.  Addresses never move, so a
 * handle stays valid across re-reads and means "whatever is at that position
 * now", the same as a real handle after the driver reconfigures.
 */
static struct nvmlDevice_st handle_table[MAX_GPUS][MAX_SLOTS + 1];

static nvmlDevice_t handle_of(int gpu, int slot)
{
    return &handle_table[gpu][slot + 1];
}

static int position_of(nvmlDevice_t device, int *gpu, int *slot)
{
    const char *base = (const char *)&handle_table[0][0];
    const char *p = (const char *)device;
    if (p < base || p >= base + sizeof handle_table)
        return -1;
    size_t cell = (size_t)(p - base) / sizeof handle_table[0][0];
    if ((size_t)(p - base) % sizeof handle_table[0][0] != 0)
        return -1;
    *gpu = (int)(cell / (MAX_SLOTS + 1));
    *slot = (int)(cell % (MAX_SLOTS + 1)) - 1;
    return 0;
}

/* ---- library state ----------------------------------------------------- */

static int init_refcount; /* touched only through __atomic builtins */
static int warned;

static void warn_once(const char *why)
{
    if (__atomic_exchange_n(&warned, 1, __ATOMIC_SEQ_CST) == 0)
        fprintf(stderr, "fakenvml: %s\n", why);
}

/* ---- topology parser --------------------------------------------------- */

struct token {
    char *key;
    char *value; /* NULL for a bare word */
};

static int is_blank(char c)
{
    return c == ' ' || c == '\t' || c == '\r';
}

/* Cuts the token off at *p; returns 1 when a comment starts there. */
static int cut(char **p)
{
    char c = **p;
    if (c == '\0')
        return 0;
    **p = '\0';
    (*p)++;
    return c == '#';
}

/* Splits a line in place into words and key=value pairs; '#' starts a comment outside quotes. */
static int tokenize(char *line, struct token *tok, const char **why)
{
    int n = 0;
    char *p = line;
    for (;;) {
        while (is_blank(*p))
            p++;
        if (*p == '\0' || *p == '#')
            return n;
        if (n == MAX_TOKENS) {
            *why = "too many fields";
            return -1;
        }
        tok[n].key = p;
        tok[n].value = NULL;
        while (*p && *p != '=' && !is_blank(*p) && *p != '#')
            p++;
        if (p == tok[n].key) {
            *why = "a field has no name";
            return -1;
        }
        if (*p != '=') {
            n++;
            if (cut(&p))
                return n;
            continue;
        }
        *p++ = '\0';
        if (*p == '"') {
            char *close = strchr(p + 1, '"');
            if (!close) {
                *why = "unterminated quote";
                return -1;
            }
            tok[n].value = p + 1;
            *close = '\0';
            p = close + 1;
            if (*p && !is_blank(*p) && *p != '#') {
                *why = "text right after a closing quote";
                return -1;
            }
        } else {
            tok[n].value = p;
            while (*p && !is_blank(*p) && *p != '#')
                p++;
        }
        n++;
        if (cut(&p))
            return n;
    }
}

static int parse_u64(const char *s, int base, unsigned long long max, unsigned long long *out)
{
    if (!s || !*s || *s == '-' || *s == '+' || is_blank(*s))
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, base);
    if (errno || *end || v > max)
        return -1;
    *out = v;
    return 0;
}

static int copy_str(char *dst, size_t size, const char *src)
{
    size_t len = strlen(src);
    if (len == 0 || len >= size)
        return -1;
    memcpy(dst, src, len + 1);
    return 0;
}

/* Accepts 0000:07:00.0 and 00000000:07:00.0, the two forms NVML prints. */
static int parse_pci(const char *s, struct fake_gpu *g)
{
    unsigned long long domain, bus, dev, fn;
    char buf[40];
    if (strlen(s) >= sizeof buf)
        return -1;
    strcpy(buf, s);
    char *c1 = strchr(buf, ':');
    char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    char *dot = c2 ? strchr(c2 + 1, '.') : NULL;
    if (!dot)
        return -1;
    *c1 = *c2 = *dot = '\0';
    if (parse_u64(buf, 16, 0xFFFFFFFFULL, &domain) || parse_u64(c1 + 1, 16, 0xFF, &bus) ||
        parse_u64(c2 + 1, 16, 0x1F, &dev) || parse_u64(dot + 1, 16, 0x7, &fn))
        return -1;
    g->domain = (unsigned int)domain;
    g->bus = (unsigned int)bus;
    g->dev = (unsigned int)dev;
    g->fn = (unsigned int)fn;
    return 0;
}

/* Checks that every field is allowed for this line kind and appears once. */
static const char *check_fields(struct token *tok, int n, const char *const *allowed)
{
    for (int i = 1; i < n; i++) {
        int known = 0;
        for (const char *const *a = allowed; *a; a++)
            if (strcmp(tok[i].key, *a) == 0)
                known = 1;
        if (!known || !tok[i].value)
            return tok[i].key;
        for (int j = 1; j < i; j++)
            if (strcmp(tok[i].key, tok[j].key) == 0)
                return tok[i].key;
    }
    return NULL;
}

static const char *field(struct token *tok, int n, const char *key)
{
    for (int i = 1; i < n; i++)
        if (strcmp(tok[i].key, key) == 0)
            return tok[i].value;
    return NULL;
}

/* An optional number; base 0 (for ids: 0x...) or 10 (for amounts: a leading 0 is not octal). */
static int opt_u64(struct token *tok, int n, const char *key, int base, unsigned long long max,
                   unsigned long long dflt, unsigned long long *out)
{
    const char *s = field(tok, n, key);
    *out = dflt;
    return s ? parse_u64(s, base, max, out) : 0;
}

static int opt_uint(struct token *tok, int n, const char *key, int base, unsigned long long max,
                    unsigned long long dflt, unsigned int *out)
{
    unsigned long long v;
    if (opt_u64(tok, n, key, base, max, dflt, &v))
        return -1;
    *out = (unsigned int)v;
    return 0;
}

/* Finds a GPU or MIG device by exact UUID; slot -1 means the GPU itself. */
static int find_uuid(const struct machine *m, const char *uuid, int *gpu, int *slot)
{
    for (int g = 0; g < m->ngpus; g++) {
        if (strcmp(m->gpu[g].uuid, uuid) == 0) {
            *gpu = g;
            *slot = -1;
            return 0;
        }
        for (int s = 0; s < MAX_SLOTS; s++) {
            if (m->gpu[g].slot[s].present && strcmp(m->gpu[g].slot[s].uuid, uuid) == 0) {
                *gpu = g;
                *slot = s;
                return 0;
            }
        }
    }
    return -1;
}

static const char *parse_health(struct machine *m, struct token *tok, int n);

#define FAIL(...)                                                  \
    do {                                                           \
        snprintf(why, sizeof why, __VA_ARGS__);                    \
        return why;                                                \
    } while (0)

/* Parses one line into m; returns NULL or a message that lives until the next call in this thread. */
static const char *parse_line(struct machine *m, char *line)
{
    static __thread char why[256];
    static const char *const gpu_fields[] = {"uuid", "name", "memory_mib", "mig", "pci", "used_mib",
                                             "temp", "power_w", "power_limit_w", "pstate",
                                             "reserved_mib", "util", "mem_util", "max_mig",
                                             "pci_device_id", "pci_subsystem_id", "cc", "persistence",
                                             "minor", NULL};
    static const char *const mig_fields[] = {"parent", "slot", "uuid", "profile", "gi", "ci",
                                             "memory_mib", "used_mib", NULL};
    static const char *const proc_fields[] = {"pid", "device", "memory_mib", NULL};
    struct token tok[MAX_TOKENS];
    const char *err = NULL;
    unsigned long long v;
    int n = tokenize(line, tok, &err);
    if (n < 0)
        FAIL("%s", err);
    if (n == 0)
        return NULL;
    const char *kind = tok[0].key;
    if (tok[0].value)
        FAIL("a line must start with a keyword, not '%s='", kind);

    if (strcmp(kind, "driver") == 0) {
        if (n != 2 || tok[1].value || copy_str(m->driver, sizeof m->driver, tok[1].key))
            FAIL("expected 'driver VERSION', e.g. 'driver 550.54.15'");
        return NULL;
    }
    if (strcmp(kind, "cuda") == 0) {
        if (n != 2 || tok[1].value || parse_u64(tok[1].key, 10, 99999, &v))
            FAIL("expected 'cuda VERSION', e.g. 'cuda 12040'");
        m->cuda = (int)v;
        return NULL;
    }
    if (strcmp(kind, "fault") == 0) {
        const char *name = n >= 2 ? tok[1].key : "";
        const char *arg = n >= 3 ? tok[2].key : NULL;
        if (n < 2 || n > 3 || tok[1].value || (n == 3 && tok[2].value))
            FAIL("expected 'fault NAME [VALUE]'");
        if (strcmp(name, "driver_not_loaded") == 0) {
            if (arg)
                FAIL("fault driver_not_loaded takes no value");
            m->driver_not_loaded = 1;
        } else if (strcmp(name, "version_mismatch") == 0) {
            if (arg)
                FAIL("fault version_mismatch takes no value");
            m->version_mismatch = 1;
        } else if (strcmp(name, "fails") == 0) {
            char list[256];
            if (!arg || strlen(arg) >= sizeof list)
                FAIL("fault fails takes driver_version and/or device_count, separated by commas");
            strcpy(list, arg);
            for (char *save = NULL, *c = strtok_r(list, ",", &save); c; c = strtok_r(NULL, ",", &save)) {
                if (strcmp(c, "driver_version") == 0)
                    m->fails |= FAILS_DRIVER_VERSION;
                else if (strcmp(c, "device_count") == 0)
                    m->fails |= FAILS_DEVICE_COUNT;
                else
                    FAIL("fault fails: unknown call '%s' (driver_version, device_count)", c);
            }
        } else if (strcmp(name, "no_permission") == 0) {
            if (!arg || strcmp(arg, "parent") == 0)
                m->perm = PERM_DENY_PARENT;
            else if (strcmp(arg, "all") == 0)
                m->perm = PERM_DENY_ALL;
            else
                FAIL("fault no_permission takes 'parent' or 'all', not '%s'", arg);
        } else if (strcmp(name, "utilization_not_supported") == 0) {
            if (!arg || strcmp(arg, "all") == 0)
                m->util = UTIL_DENY_ALL;
            else if (strcmp(arg, "mig") == 0)
                m->util = UTIL_DENY_MIG;
            else
                FAIL("fault utilization_not_supported takes 'mig' or 'all', not '%s'", arg);
        } else if (strcmp(name, "readings_not_supported") == 0) {
            if (arg)
                FAIL("fault readings_not_supported takes no value");
            m->readings_not_supported = 1;
        } else if (strcmp(name, "slow_init") == 0) {
            if (!arg || parse_u64(arg, 10, 600000, &v))
                FAIL("fault slow_init takes milliseconds (0..600000)");
            m->slow_init_ms = (unsigned long)v;
        } else if (strcmp(name, "gpu_lost") == 0) {
            char list[1024];
            if (!arg || strlen(arg) >= sizeof list)
                FAIL("fault gpu_lost takes GPU UUIDs separated by commas");
            strcpy(list, arg);
            for (char *save = NULL, *u = strtok_r(list, ",", &save); u; u = strtok_r(NULL, ",", &save)) {
                int g, s;
                if (find_uuid(m, u, &g, &s) || s != -1)
                    FAIL("fault gpu_lost: '%s' is not a GPU declared above", u);
                m->gpu[g].lost = 1;
            }
        } else {
            FAIL("unknown fault '%s'", name);
        }
        return NULL;
    }
    if (strcmp(kind, "gpu") == 0) {
        const char *bad = check_fields(tok, n, gpu_fields);
        if (bad)
            FAIL("gpu: unknown, repeated or empty field '%s'", bad);
        if (m->ngpus == MAX_GPUS)
            FAIL("more than %d GPUs", MAX_GPUS);
        struct fake_gpu *g = &m->gpu[m->ngpus];
        const char *s;
        int dg, ds;
        if (!(s = field(tok, n, "uuid")) || strncmp(s, "GPU-", 4) || copy_str(g->uuid, sizeof g->uuid, s))
            FAIL("gpu: uuid=GPU-... is required");
        if (find_uuid(m, s, &dg, &ds) == 0)
            FAIL("gpu: duplicate uuid %s", s);
        if (!(s = field(tok, n, "name")) || copy_str(g->name, sizeof g->name, s))
            FAIL("gpu: name=\"...\" is required (at most %d bytes)", NAME_BUF - 1);
        if (parse_u64(field(tok, n, "memory_mib"), 10, MAX_MIB, &g->memory_mib))
            FAIL("gpu: memory_mib=N is required");
        s = field(tok, n, "mig");
        if (!s || strcmp(s, "off") == 0)
            g->mig = MIG_OFF;
        else if (strcmp(s, "on") == 0)
            g->mig = MIG_ON;
        else if (strcmp(s, "unsupported") == 0)
            g->mig = MIG_UNSUPPORTED;
        else
            FAIL("gpu: mig= takes on, off or unsupported");
        s = field(tok, n, "pci");
        if (s) {
            if (parse_pci(s, g))
                FAIL("gpu: pci= wants DOMAIN:BUS:DEVICE.FUNCTION in hex, e.g. 0000:07:00.0");
        } else {
            g->bus = (unsigned int)m->ngpus + 1;
        }
        if (opt_u64(tok, n, "used_mib", 10, MAX_MIB, 0, &g->used_mib) ||
            opt_u64(tok, n, "reserved_mib", 10, MAX_MIB, 0, &g->reserved_mib))
            FAIL("gpu: used_mib= and reserved_mib= want a number of MiB");
        if (opt_uint(tok, n, "util", 10, 100, 0, &g->util) || opt_uint(tok, n, "mem_util", 10, 100, 0, &g->mem_util))
            FAIL("gpu: util= and mem_util= want a percentage, 0..100");
        if (opt_uint(tok, n, "temp", 10, 200, 34, &g->temp_c) || opt_uint(tok, n, "pstate", 10, 15, 0, &g->pstate))
            FAIL("gpu: temp= wants degrees C (0..200), pstate= a performance state 0..15");
        if (opt_uint(tok, n, "power_w", 10, 4000, 70, &g->power_mw) ||
            opt_uint(tok, n, "power_limit_w", 10, 4000, 700, &g->power_limit_mw))
            FAIL("gpu: power_w= and power_limit_w= want watts (0..4000)");
        g->power_mw *= 1000;
        g->power_limit_mw *= 1000;
        /* The driver numbers its nodes in its own probe order, not NVML's: by default they agree. */
        if (opt_uint(tok, n, "minor", 10, 253, (unsigned long long)m->ngpus, &g->minor))
            FAIL("gpu: minor= wants the minor number of its node, 0..253");
        if (opt_uint(tok, n, "max_mig", 10, MAX_SLOTS, g->mig == MIG_UNSUPPORTED ? 0 : 7, &g->max_mig))
            FAIL("gpu: max_mig= wants 0..%d", MAX_SLOTS);
        /* NVML packs the vendor (NVIDIA, 0x10DE) into the low half of the device id. */
        if (opt_uint(tok, n, "pci_device_id", 0, 0xFFFFFFFFULL, 0x10DE, &g->pci_device_id) ||
            opt_uint(tok, n, "pci_subsystem_id", 0, 0xFFFFFFFFULL, 0, &g->pci_subsystem_id))
            FAIL("gpu: pci_device_id= and pci_subsystem_id= want a 32-bit number, e.g. 0x20B210DE");
        g->cc_major = 8;
        g->cc_minor = 0;
        if ((s = field(tok, n, "cc"))) {
            char *dot;
            unsigned long long major, minor;
            if (strlen(s) >= 16 || !(dot = strchr(s, '.')))
                FAIL("gpu: cc= wants MAJOR.MINOR, e.g. 9.0");
            char head[16];
            memcpy(head, s, (size_t)(dot - s));
            head[dot - s] = '\0';
            if (parse_u64(head, 10, 99, &major) || parse_u64(dot + 1, 10, 9, &minor))
                FAIL("gpu: cc= wants MAJOR.MINOR, e.g. 9.0");
            g->cc_major = (unsigned int)major;
            g->cc_minor = (unsigned int)minor;
        }
        s = field(tok, n, "persistence");
        if (s && strcmp(s, "on") != 0 && strcmp(s, "off") != 0)
            FAIL("gpu: persistence= takes on or off");
        g->persistence_off = s && strcmp(s, "off") == 0;
        m->ngpus++;
        return NULL;
    }
    if (strcmp(kind, "mig") == 0) {
        const char *bad = check_fields(tok, n, mig_fields);
        const char *s;
        int g, slot, dg, ds;
        if (bad)
            FAIL("mig: unknown, repeated or empty field '%s'", bad);
        if (!(s = field(tok, n, "parent")) || find_uuid(m, s, &g, &slot) || slot != -1)
            FAIL("mig: parent= must name a GPU declared above");
        if (m->gpu[g].mig != MIG_ON)
            FAIL("mig: parent %s is not in MIG mode (mig=on)", s);
        if (parse_u64(field(tok, n, "slot"), 10, MAX_SLOTS - 1, &v) || v >= m->gpu[g].max_mig)
            FAIL("mig: slot= must be below the parent's max_mig (%u)", m->gpu[g].max_mig);
        struct fake_mig *mi = &m->gpu[g].slot[v];
        if (mi->present)
            FAIL("mig: slot %llu of %s is taken twice", v, m->gpu[g].uuid);
        if (!(s = field(tok, n, "uuid")) || strncmp(s, "MIG-", 4) || copy_str(mi->uuid, sizeof mi->uuid, s))
            FAIL("mig: uuid=MIG-... is required");
        if (find_uuid(m, s, &dg, &ds) == 0)
            FAIL("mig: duplicate uuid %s", s);
        if (!(s = field(tok, n, "profile")) || copy_str(mi->profile, sizeof mi->profile, s))
            FAIL("mig: profile= is required, e.g. profile=1g.10gb");
        if (parse_u64(field(tok, n, "gi"), 10, 0xFFFF, &v))
            FAIL("mig: gi=N is required");
        mi->gi = (unsigned int)v;
        if (parse_u64(field(tok, n, "ci"), 10, 0xFFFF, &v))
            FAIL("mig: ci=N is required");
        mi->ci = (unsigned int)v;
        if (parse_u64(field(tok, n, "memory_mib"), 10, MAX_MIB, &mi->memory_mib))
            FAIL("mig: memory_mib=N is required");
        s = field(tok, n, "used_mib");
        if (s && parse_u64(s, 10, MAX_MIB, &mi->used_mib))
            FAIL("mig: used_mib= wants a number");
        mi->present = 1;
        return NULL;
    }
    if (strcmp(kind, "process") == 0) {
        const char *bad = check_fields(tok, n, proc_fields);
        const char *s;
        if (bad)
            FAIL("process: unknown, repeated or empty field '%s'", bad);
        if (m->nprocs == MAX_PROCS)
            FAIL("more than %d processes", MAX_PROCS);
        struct fake_proc *p = &m->procs[m->nprocs];
        if (parse_u64(field(tok, n, "pid"), 10, 0x7FFFFFFF, &v) || v == 0)
            FAIL("process: pid=N is required");
        p->pid = (unsigned int)v;
        if (!(s = field(tok, n, "device")) || find_uuid(m, s, &p->gpu, &p->slot))
            FAIL("process: device= must name a GPU or MIG device declared above");
        if (parse_u64(field(tok, n, "memory_mib"), 10, MAX_MIB, &p->memory_mib))
            FAIL("process: memory_mib=N is required");
        m->nprocs++;
        return NULL;
    }
    if (strcmp(kind, "health") == 0)
        return parse_health(m, tok, n);
    FAIL("unknown keyword '%s'", kind);
}

/* Reads a whole text file at dirfd/path; NULL with a message in err on failure. */
static char *slurp(int dirfd, const char *path, size_t limit, char *err, size_t errlen)
{
    int fd = openat(dirfd, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = malloc(limit + 1);
    size_t len = 0;
    int failed = !buf;
    while (!failed && len <= limit) {
        ssize_t got = read(fd, buf + len, limit + 1 - len);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            failed = 1;
        if (got <= 0)
            break;
        len += (size_t)got;
    }
    close(fd);
    if (failed || len > limit) {
        snprintf(err, errlen, "%s: %s", path, failed ? "cannot read" : "too large");
        free(buf);
        return NULL;
    }
    buf[len] = '\0';
    if (memchr(buf, '\0', len)) {
        snprintf(err, errlen, "%s: contains a NUL byte", path);
        free(buf);
        return NULL;
    }
    return buf;
}

static void parse_topology(struct machine *m, const char *path)
{
    char *text = slurp(AT_FDCWD, path, MAX_FILE, m->error, sizeof m->error);
    if (!text)
        return;
    int lineno = 0;
    for (char *line = text; line && !m->error[0];) {
        char *next = strchr(line, '\n');
        if (next)
            *next++ = '\0';
        lineno++;
        const char *why = parse_line(m, line);
        if (why)
            snprintf(m->error, sizeof m->error, "%s:%d: %s", path, lineno, why);
        line = next;
    }
    free(text);
    if (!m->error[0] && !m->driver[0])
        snprintf(m->error, sizeof m->error, "%s: no 'driver VERSION' line", path);
}

/* ---- live registrations of the stand-in CUDA program ------------------- */

/*
 * The driver forgets a context when its process dies, even if nobody cleaned
 * up, so a registration only counts while its pid lives.  EPERM from kill()
 * means the pid belongs to someone else and is alive.  A zombie has already
 * released its contexts.
 */
static int pid_alive(pid_t pid)
{
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return errno != ENOENT;
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = '\0';
    const char *paren = strrchr(buf, ')');
    if (!paren || paren[1] != ' ')
        return 1;
    return paren[2] != 'Z' && paren[2] != 'X';
}

static int by_pid(const void *a, const void *b)
{
    const struct fake_proc *x = a, *y = b;
    if (x->pid != y->pid)
        return x->pid < y->pid ? -1 : 1;
    if (x->gpu != y->gpu)
        return x->gpu < y->gpu ? -1 : 1;
    return x->slot < y->slot ? -1 : (x->slot > y->slot);
}

static void add_registration(struct machine *m, unsigned int pid, int dirfd, const char *name)
{
    char err[320];
    char *text = slurp(dirfd, name, 64 * 1024, err, sizeof err);
    if (!text)
        return; /* vanished between readdir and open: the program just exited */
    for (char *save = NULL, *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char uuid[UUID_BUF];
        unsigned long long mib;
        int g, s, used;
        if (m->nprocs == MAX_PROCS)
            break;
        if (sscanf(line, "%95s %llu %n", uuid, &mib, &used) != 2 || line[used] != '\0')
            continue;
        /* A device that is gone from the topology takes its contexts with it. */
        if (find_uuid(m, uuid, &g, &s))
            continue;
        m->procs[m->nprocs++] = (struct fake_proc){pid, g, s, mib > MAX_MIB ? MAX_MIB : mib};
    }
    free(text);
}

static void read_registrations(struct machine *m)
{
    const char *state = getenv("FAKENVML_STATE");
    char dir[4096];
    if (!state || !*state || snprintf(dir, sizeof dir, "%s/procs", state) >= (int)sizeof dir)
        return;
    DIR *d = opendir(dir);
    if (!d)
        return;
    int first = m->nprocs;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        unsigned long long pid;
        /* Only plain pids: the writer's temporary files start with a dot. */
        if (parse_u64(e->d_name, 10, 0x7FFFFFFF, &pid) || pid == 0)
            continue;
        if (!pid_alive((pid_t)pid))
            continue;
        add_registration(m, (unsigned int)pid, dirfd(d), e->d_name);
    }
    closedir(d);
    qsort(&m->procs[first], (size_t)(m->nprocs - first), sizeof m->procs[0], by_pid);
}

/* A fresh copy of the machine; check ->error before use.  NULL only when out of memory. */
static struct machine *load_machine(void)
{
    struct machine *m = calloc(1, sizeof *m);
    if (!m)
        return NULL;
    const char *path = getenv("FAKENVML_TOPOLOGY");
    if (!path || !*path) {
        snprintf(m->error, sizeof m->error, "FAKENVML_TOPOLOGY is not set");
        return m;
    }
    parse_topology(m, path);
    if (!m->error[0])
        read_registrations(m);
    return m;
}

/* ---- what calls cost ---------------------------------------------------- */

/*
 * Medians of 9 fresh processes on an NVIDIA H200, driver 580.159.04, persistence
 * mode on (FORMAT.md).  "attach" is the first handle of each GPU after init (the
 * measured GetCount + GetHandleByIndex on a one-GPU machine); "cold" is what init
 * adds per GPU in persistence mode off that no client keeps initialised (NVIDIA:
 * "order of 1-3 second" per GPU, the low end here).  "context" and "leave" are the
 * stand-in CUDA program's (fakecuda.py), accepted here so one variable sets both.
 */
enum cost { COST_INIT, COST_ATTACH, COST_UUID, COST_MEMORY, COST_PROCS, COST_BY_UUID, COST_SHUTDOWN,
            COST_COLD, COST_CONTEXT, COST_LEAVE, NCOSTS };
static const char *const cost_names[NCOSTS] = {"init", "attach", "uuid", "memory", "procs", "by_uuid",
                                               "shutdown", "cold", "context", "leave"};
static const double h200_ms[NCOSTS] = {9.8, 6.0, 0.09, 0.05, 0.3, 0.01, 2.4, 1000.0, 135.0, 28.0};
#define MAX_COST_MS 600000.0

/* FAKENVML_TIMING into ms: unset or empty, the H200's; "none" zeroes them all; then
 * KEY=MS items, comma-separated, override one each.  0, or -1 with the reason in why. */
static int read_timing(double *ms, char *why, size_t whylen)
{
    memcpy(ms, h200_ms, sizeof h200_ms);
    const char *env = getenv("FAKENVML_TIMING");
    char buf[512];
    if (!env || !*env)
        return 0;
    if (strlen(env) >= sizeof buf) {
        snprintf(why, whylen, "FAKENVML_TIMING: longer than %zu bytes", sizeof buf - 1);
        return -1;
    }
    strcpy(buf, env);
    for (char *save = NULL, *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        if (strcmp(item, "none") == 0) {
            for (int i = 0; i < NCOSTS; i++)
                ms[i] = 0.0;
            continue;
        }
        char *eq = strchr(item, '='), *end = NULL;
        int i = 0;
        if (eq) {
            *eq = '\0';
            while (i < NCOSTS && strcmp(cost_names[i], item) != 0)
                i++;
        }
        double v = eq && i < NCOSTS ? strtod(eq + 1, &end) : -1.0;
        if (!eq || i == NCOSTS || end == eq + 1 || *end || !(v >= 0.0 && v <= MAX_COST_MS)) {
            snprintf(why, whylen, "FAKENVML_TIMING: '%.100s%s' is not none or KEY=MS with KEY one of init, "
                     "attach, uuid, memory, procs, by_uuid, shutdown, cold, context, leave and MS 0..600000",
                     item, eq ? "=..." : "");
            return -1;
        }
        ms[i] = v;
    }
    return 0;
}

static void sleep_ms(double ms)
{
    if (ms <= 0.0)
        return;
    long long ns = (long long)(ms * 1e6);
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* Sleep what WHAT costs (nothing when FAKENVML_TIMING is invalid: init refused it). */
static void pay(enum cost what)
{
    double ms[NCOSTS];
    char why[8];
    if (read_timing(ms, why, sizeof why) == 0)
        sleep_ms(ms[what]);
}

/* GPUs this process has had a handle of since init: the first one costs COST_ATTACH. */
static unsigned int attached; /* bit per GPU index; touched only through __atomic builtins */

static void attach(int gpu)
{
    unsigned int bit = 1u << gpu;
    if (!(__atomic_fetch_or(&attached, bit, __ATOMIC_SEQ_CST) & bit))
        pay(COST_ATTACH);
}

/*
 * Processes with NVML initialised register in $FAKENVML_STATE/clients/<pid>, as the
 * CUDA programs in procs/: a GPU in persistence mode off stays initialised while any
 * live client, or a process on it, is there.
 */
static int clients_path(char *out, size_t size, pid_t pid)
{
    const char *state = getenv("FAKENVML_STATE");
    if (!state || !*state)
        return -1;
    int n = pid ? snprintf(out, size, "%s/clients/%d", state, (int)pid) : snprintf(out, size, "%s/clients", state);
    return n < 0 || (size_t)n >= size ? -1 : 0;
}

static void register_client(int on)
{
    char path[4096];
    if (clients_path(path, sizeof path, getpid()))
        return;
    if (!on) {
        unlink(path);
        return;
    }
    char dir[4096];
    if (clients_path(dir, sizeof dir, 0) == 0 && mkdir(dir, 01777) == 0)
        chmod(dir, 01777); /* other users' programs register here too */
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0)
        close(fd);
}

static int other_client_alive(void)
{
    char dir[4096];
    if (clients_path(dir, sizeof dir, 0))
        return 0;
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    int found = 0;
    struct dirent *e;
    while (!found && (e = readdir(d)) != NULL) {
        unsigned long long pid;
        found = !parse_u64(e->d_name, 10, 0x7FFFFFFF, &pid) && pid && (pid_t)pid != getpid() && pid_alive((pid_t)pid);
    }
    closedir(d);
    return found;
}

/* What init costs on M: its own, and bringing up each GPU nobody keeps initialised. */
static void pay_init(const struct machine *m, const double *ms)
{
    double total = ms[COST_INIT];
    int others = -1;
    for (int g = 0; g < m->ngpus; g++) {
        int held = 0;
        if (!m->gpu[g].persistence_off)
            continue;
        for (int i = 0; i < m->nprocs && !held; i++)
            held = m->procs[i].gpu == g;
        if (!held && others < 0)
            others = other_client_alive();
        if (!held && !others)
            total += ms[COST_COLD];
    }
    sleep_ms(total);
}

/* ---- common call plumbing ---------------------------------------------- */

static int initialized(void)
{
    return __atomic_load_n(&init_refcount, __ATOMIC_SEQ_CST) > 0;
}

/* The machine for a query, or NULL with *ret set. */
static struct machine *begin(nvmlReturn_t *ret)
{
    if (!initialized()) {
        *ret = NVML_ERROR_UNINITIALIZED;
        return NULL;
    }
    struct machine *m = load_machine();
    if (!m) {
        *ret = NVML_ERROR_MEMORY;
        return NULL;
    }
    if (m->error[0]) {
        warn_once(m->error);
        free(m);
        *ret = NVML_ERROR_UNKNOWN;
        return NULL;
    }
    *ret = NVML_SUCCESS;
    return m;
}

static nvmlReturn_t finish(struct machine *m, nvmlReturn_t ret)
{
    free(m);
    return ret;
}

struct target {
    int g, slot;
    struct fake_gpu *gpu;
    struct fake_mig *mig; /* NULL for a whole GPU */
};

enum { ASK_GPU = 0, LOOKUP_ONLY = 1 };

/*
 * Maps a handle to what sits at its position now.  A GPU that fell off the
 * bus still has its handles (the caller got them earlier) but every question
 * put to it fails, so only pure handle bookkeeping passes LOOKUP_ONLY.
 */
static nvmlReturn_t resolve(struct machine *m, nvmlDevice_t device, struct target *t, int mode)
{
    if (!device || position_of(device, &t->g, &t->slot))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (t->g >= m->ngpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    t->gpu = &m->gpu[t->g];
    t->mig = NULL;
    if (t->slot >= 0) {
        t->mig = &t->gpu->slot[t->slot];
        /* A destroyed instance leaves a dangling handle, as with the real driver. */
        if (!t->mig->present || t->gpu->mig != MIG_ON)
            return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (t->gpu->lost && mode == ASK_GPU)
        return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

static nvmlReturn_t put_string(char *dst, unsigned int length, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t need = strlen(src) + 1;
    if (length < need)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, need);
    return NVML_SUCCESS;
}

/* ---- initialisation ---------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    struct machine *m = load_machine();
    if (!m)
        return NVML_ERROR_MEMORY;
    if (m->error[0]) {
        warn_once(m->error);
        return finish(m, NVML_ERROR_UNKNOWN);
    }
    double ms[NCOSTS];
    char why[320];
    if (read_timing(ms, why, sizeof why)) {
        warn_once(why);
        return finish(m, NVML_ERROR_UNKNOWN);
    }
    sleep_ms((double)m->slow_init_ms);
    if (m->driver_not_loaded)
        return finish(m, NVML_ERROR_DRIVER_NOT_LOADED);
    pay_init(m, ms);
    if (m->version_mismatch)
        return finish(m, NVML_ERROR_LIB_RM_VERSION_MISMATCH);
    if (__atomic_add_fetch(&init_refcount, 1, __ATOMIC_SEQ_CST) == 1)
        register_client(1);
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlShutdown(void)
{
    int n = __atomic_load_n(&init_refcount, __ATOMIC_SEQ_CST);
    while (n > 0) {
        if (__atomic_compare_exchange_n(&init_refcount, &n, n - 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            if (n == 1) { /* the last reference: the next init attaches the GPUs again */
                __atomic_store_n(&attached, 0u, __ATOMIC_SEQ_CST);
                register_client(0);
            }
            pay(COST_SHUTDOWN);
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_UNINITIALIZED;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

/* ---- system queries ---------------------------------------------------- */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    if (!m)
        return ret;
    if (m->fails & FAILS_DRIVER_VERSION)
        return finish(m, NVML_ERROR_UNKNOWN);
    return finish(m, put_string(version, length, m->driver));
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    if (!m)
        return ret;
    /* Real NVML reports "<CUDA major>.<driver version>", e.g. 12.550.54.15. */
    char buf[VERSION_BUF + 16];
    snprintf(buf, sizeof buf, "%d.%s", m->cuda / 1000, m->driver);
    return finish(m, put_string(version, length, buf));
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    if (!m)
        return ret;
    if (!cudaDriverVersion)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    *cudaDriverVersion = m->cuda;
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

/* ---- enumeration ------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    if (!m)
        return ret;
    if (!deviceCount)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    if (m->fails & FAILS_DEVICE_COUNT)
        return finish(m, NVML_ERROR_UNKNOWN);
    *deviceCount = (unsigned int)m->ngpus;
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    if (!m)
        return ret;
    if (!device || index >= (unsigned int)m->ngpus)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    attach((int)index);
    *device = handle_of((int)index, -1);
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    int g, s;
    if (!m)
        return ret;
    if (!uuid || !device)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    pay(COST_BY_UUID);
    if (find_uuid(m, uuid, &g, &s))
        return finish(m, NVML_ERROR_NOT_FOUND);
    attach(g);
    *device = handle_of(g, s);
    return finish(m, NVML_SUCCESS);
}

/* A whole GPU's number: its NVML index, or the minor of its node (MINOR). MIG devices live
   outside the NVML index space and have no node of their own (they are reached through their
   parent's node and their capability nodes), so NVML refuses both questions for them. */
static nvmlReturn_t gpu_number(nvmlDevice_t device, unsigned int *out, int minor)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) != NVML_SUCCESS)
        return finish(m, ret);
    if (t.mig)
        return finish(m, NVML_ERROR_NOT_SUPPORTED);
    if (!out)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    *out = minor ? t.gpu->minor : (unsigned int)t.g;
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    return gpu_number(device, index, 0);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    return gpu_number(device, minorNumber, 1);
}

/* ---- identity ---------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) != NVML_SUCCESS)
        return finish(m, ret);
    pay(COST_UUID);
    return finish(m, put_string(uuid, length, t.mig ? t.mig->uuid : t.gpu->uuid));
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    char buf[NAME_BUF + PROFILE_BUF + 8];
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) != NVML_SUCCESS)
        return finish(m, ret);
    if (t.mig)
        snprintf(buf, sizeof buf, "%s MIG %s", t.gpu->name, t.mig->profile);
    else
        snprintf(buf, sizeof buf, "%s", t.gpu->name);
    return finish(m, put_string(name, length, buf));
}

/* MIG devices share their parent's PCI function, so they report the parent's. */
static nvmlReturn_t pci_of(nvmlDevice_t device, struct fake_gpu *out)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) == NVML_SUCCESS)
        *out = *t.gpu;
    return finish(m, ret);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) != NVML_SUCCESS)
        return finish(m, ret);
    if (!major || !minor)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    *major = (int)t.gpu->cc_major;
    *minor = (int)t.gpu->cc_minor;
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    struct fake_gpu g;
    nvmlReturn_t ret = pci_of(device, &g);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", g.domain & 0xFFFF, g.bus, g.dev, g.fn);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", g.domain, g.bus, g.dev, g.fn);
    pci->domain = g.domain;
    pci->bus = g.bus;
    pci->device = g.dev;
    pci->pciDeviceId = g.pci_device_id;
    pci->pciSubSystemId = g.pci_subsystem_id;
    return NVML_SUCCESS;
}

static nvmlReturn_t pci_legacy(nvmlDevice_t device, nvmlPciInfoLegacy_t *pci)
{
    struct fake_gpu g;
    nvmlReturn_t ret = pci_of(device, &g);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%04X:%02X:%02X.%X", g.domain & 0xFFFF, g.bus, g.dev, g.fn);
    pci->domain = g.domain;
    pci->bus = g.bus;
    pci->device = g.dev;
    pci->pciDeviceId = g.pci_device_id;
    pci->pciSubSystemId = g.pci_subsystem_id;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfoLegacy_t *pci)
{
    return pci_legacy(device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfoLegacy_t *pci)
{
    return pci_legacy(device, pci);
}

/* ---- memory, utilisation ----------------------------------------------- */

static int proc_on(const struct fake_proc *p, const struct target *t)
{
    if (p->gpu != t->g)
        return 0;
    /* A MIG parent answers for everything running on its instances. */
    return t->mig ? p->slot == t->slot : 1;
}

struct usage {
    unsigned long long total, reserved, used;
};

static nvmlReturn_t usage_of(nvmlDevice_t device, struct usage *u)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) != NVML_SUCCESS)
        return finish(m, ret);
    unsigned long long used_mib;
    if (t.mig) {
        u->total = t.mig->memory_mib * MIB;
        u->reserved = 0;
        used_mib = t.mig->used_mib;
    } else {
        u->total = t.gpu->memory_mib * MIB;
        u->reserved = t.gpu->reserved_mib * MIB;
        used_mib = t.gpu->used_mib;
        for (int s = 0; s < MAX_SLOTS; s++)
            if (t.gpu->slot[s].present)
                used_mib += t.gpu->slot[s].used_mib;
    }
    for (int i = 0; i < m->nprocs; i++)
        if (proc_on(&m->procs[i], &t))
            used_mib += m->procs[i].memory_mib;
    u->used = used_mib * MIB;
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    struct usage u;
    nvmlReturn_t ret = usage_of(device, &u);
    pay(COST_MEMORY);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* Version 1 has no reserved field and counts it as used. */
    memory->total = u.total;
    memory->used = u.used + u.reserved;
    memory->free = memory->used < u.total ? u.total - memory->used : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    struct usage u;
    nvmlReturn_t ret = usage_of(device, &u);
    pay(COST_MEMORY);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = u.total;
    memory->reserved = u.reserved;
    memory->used = u.used;
    memory->free = u.used + u.reserved < u.total ? u.total - u.used - u.reserved : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) != NVML_SUCCESS)
        return finish(m, ret);
    /* The driver has no per-instance counters, and none for a GPU split into instances. */
    if (t.mig || t.gpu->mig == MIG_ON || m->util == UTIL_DENY_ALL)
        return finish(m, NVML_ERROR_NOT_SUPPORTED);
    if (!utilization)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    utilization->gpu = t.gpu->util;
    utilization->memory = t.gpu->mem_util;
    return finish(m, NVML_SUCCESS);
}

/* ---- processes --------------------------------------------------------- */

static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos, int v1)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) != NVML_SUCCESS)
        return finish(m, ret);
    pay(COST_PROCS);
    /* What a user without CAP_SYS_ADMIN sees on a partitioned GPU. */
    if ((m->perm == PERM_DENY_PARENT && !t.mig && t.gpu->mig == MIG_ON) ||
        (m->perm == PERM_DENY_ALL && (t.mig || t.gpu->mig == MIG_ON)))
        return finish(m, NVML_ERROR_NO_PERMISSION);
    if (!infoCount)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    unsigned int n = 0;
    for (int i = 0; i < m->nprocs; i++)
        n += (unsigned int)proc_on(&m->procs[i], &t);
    if (n > *infoCount) {
        *infoCount = n;
        return finish(m, NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if (n > 0 && !infos)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    unsigned int k = 0;
    for (int i = 0; i < m->nprocs; i++) {
        const struct fake_proc *p = &m->procs[i];
        if (!proc_on(p, &t))
            continue;
        unsigned int gi = NVML_VALUE_NOT_AVAILABLE_UINT, ci = NVML_VALUE_NOT_AVAILABLE_UINT;
        if (p->slot >= 0) {
            gi = t.gpu->slot[p->slot].gi;
            ci = t.gpu->slot[p->slot].ci;
        }
        if (v1) {
            nvmlProcessInfo_v1_t *out = (nvmlProcessInfo_v1_t *)infos + k;
            out->pid = p->pid;
            out->usedGpuMemory = p->memory_mib * MIB;
        } else {
            nvmlProcessInfo_t *out = (nvmlProcessInfo_t *)infos + k;
            out->pid = p->pid;
            out->usedGpuMemory = p->memory_mib * MIB;
            out->gpuInstanceId = gi;
            out->computeInstanceId = ci;
        }
        k++;
    }
    *infoCount = n;
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos)
{
    return running_processes(device, infoCount, infos, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos)
{
    return running_processes(device, infoCount, infos, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_v1_t *infos)
{
    return running_processes(device, infoCount, infos, 1);
}

/* ---- MIG --------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) != NVML_SUCCESS)
        return finish(m, ret);
    if (t.mig || t.gpu->mig == MIG_UNSUPPORTED)
        return finish(m, NVML_ERROR_NOT_SUPPORTED);
    if (!currentMode || !pendingMode)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    *currentMode = *pendingMode = t.gpu->mig == MIG_ON ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) != NVML_SUCCESS)
        return finish(m, ret);
    if (t.mig || !count)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    /* nvml.h: zero when MIG is unsupported or disabled. */
    *count = t.gpu->mig == MIG_ON ? t.gpu->max_mig : 0;
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *migDevice)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) != NVML_SUCCESS)
        return finish(m, ret);
    if (t.mig || !migDevice)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    if (t.gpu->mig != MIG_ON)
        return finish(m, NVML_ERROR_NOT_SUPPORTED);
    if (index >= t.gpu->max_mig)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    /* Empty slots are normal on a partitioned GPU; callers skip them. */
    if (!t.gpu->slot[index].present)
        return finish(m, NVML_ERROR_NOT_FOUND);
    *migDevice = handle_of(t.g, (int)index);
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, LOOKUP_ONLY)) != NVML_SUCCESS)
        return finish(m, ret);
    if (!isMigDevice)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    *isMigDevice = t.mig != NULL;
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, migDevice, &t, LOOKUP_ONLY)) != NVML_SUCCESS)
        return finish(m, ret);
    if (!t.mig || !device)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    *device = handle_of(t.g, -1);
    return finish(m, NVML_SUCCESS);
}

static nvmlReturn_t instance_id(nvmlDevice_t device, unsigned int *id, int compute)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) != NVML_SUCCESS)
        return finish(m, ret);
    if (!t.mig)
        return finish(m, NVML_ERROR_NOT_SUPPORTED);
    if (!id)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    *id = compute ? t.mig->ci : t.mig->gi;
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return instance_id(device, id, 0);
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return instance_id(device, id, 1);
}

/* ---- status readings: temperature, power, performance state ------------- */

#define READING_TEMPERATURE 0
#define READING_POWER 1
#define READING_POWER_LIMIT 2
#define READING_PSTATE 3

/*
 * Board sensors answer for whole GPUs (MIG mode or not); a MIG device handle
 * gets NOT_SUPPORTED, as do all boards under `fault readings_not_supported`.
 */
static nvmlReturn_t reading(nvmlDevice_t device, int what, unsigned int *out)
{
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    struct target t;
    if (!m)
        return ret;
    if ((ret = resolve(m, device, &t, ASK_GPU)) != NVML_SUCCESS)
        return finish(m, ret);
    if (t.mig || m->readings_not_supported)
        return finish(m, NVML_ERROR_NOT_SUPPORTED);
    if (!out)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    switch (what) {
    case READING_TEMPERATURE: *out = t.gpu->temp_c; break;
    case READING_POWER: *out = t.gpu->power_mw; break;
    case READING_POWER_LIMIT: *out = t.gpu->power_limit_mw; break;
    default: *out = t.gpu->pstate; break;
    }
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensorType, unsigned int *temp)
{
    if (sensorType != 0) /* NVML_TEMPERATURE_GPU is the only sensor there is */
        return NVML_ERROR_INVALID_ARGUMENT;
    return reading(device, READING_TEMPERATURE, temp);
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    return reading(device, READING_POWER, power);
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit)
{
    return reading(device, READING_POWER_LIMIT, limit);
}

nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t device, int *pState)
{
    return reading(device, READING_PSTATE, (unsigned int *)pState);
}

/* ==== health: events, remapped rows, clock event reasons ===================
 *
 * Events are lines appended to $FAKENVML_STATE/events by whoever injects them
 * (a test): `UUID TYPE DATA`, TYPE one of xid, dbe, sbe (or a number, the
 * nvmlEventType bit), DATA the XID number (0 for ECC).  An event set sees the
 * lines appended after it was created, once each, for the GPUs and types
 * registered on it, as a real event set gets each event once.  A line naming a
 * MIG device is delivered on its GPU's handle with the instance's ids, as the
 * driver reports an XID in a GPU instance.
 */

#define EVENT_SBE 0x1ULL
#define EVENT_DBE 0x2ULL
#define EVENT_XID 0x8ULL
/* What an H200 reports for nvmlDeviceGetSupportedEventTypes (0xFF9F). */
#define SUPPORTED_EVENTS 65439ULL
#define MAX_EVENT_SETS 16
#define EVENT_LINE 256

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

struct fake_event_set {
    int used;
    off_t offset; /* how far into the events file this set has read */
    char uuid[MAX_GPUS][UUID_BUF]; /* registered GPUs, by UUID: indexes may change */
    unsigned long long mask[MAX_GPUS];
    int nregistered;
};
typedef struct fake_event_set *nvmlEventSet_t;

static struct fake_event_set event_sets[MAX_EVENT_SETS];

static const char *parse_health(struct machine *m, struct token *tok, int n)
{
    static __thread char why[256];
    static const char *const health_fields[] = {"uuid", "remapped_corr", "remapped_unc", "remap_pending",
                                                "remap_failed", "clocks_event_reasons", NULL};
    const char *bad = check_fields(tok, n, health_fields);
    const char *s;
    int g, slot;
    if (bad)
        FAIL("health: unknown, repeated or empty field '%s'", bad);
    if (!(s = field(tok, n, "uuid")) || find_uuid(m, s, &g, &slot) || slot != -1)
        FAIL("health: uuid= must name a GPU declared above");
    struct fake_health *h = &m->health[g];
    if (h->set)
        FAIL("health: a second line for %s", s);
    if (opt_uint(tok, n, "remapped_corr", 10, 0xFFFF, 0, &h->remapped_corr) ||
        opt_uint(tok, n, "remapped_unc", 10, 0xFFFF, 0, &h->remapped_unc))
        FAIL("health: remapped_corr= and remapped_unc= want a number of rows");
    if (opt_uint(tok, n, "remap_pending", 10, 1, 0, &h->remap_pending) ||
        opt_uint(tok, n, "remap_failed", 10, 1, 0, &h->remap_failed))
        FAIL("health: remap_pending= and remap_failed= want 0 or 1");
    if (opt_u64(tok, n, "clocks_event_reasons", 0, 0xFFFFFFFFFFFFULL, 1, &h->clocks_event_reasons))
        FAIL("health: clocks_event_reasons= wants a bit mask, e.g. 0x40");
    h->set = 1;
    return NULL;
}

/* The GPU a handle names (not a MIG device: events and row remapping are the board's). */
static struct machine *board(nvmlDevice_t device, struct target *t, nvmlReturn_t *ret)
{
    struct machine *m = begin(ret);
    if (!m)
        return NULL;
    if ((*ret = resolve(m, device, t, ASK_GPU)) != NVML_SUCCESS || (t->mig && (*ret = NVML_ERROR_NOT_SUPPORTED))) {
        free(m);
        return NULL;
    }
    return m;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    nvmlReturn_t ret;
    struct target t;
    struct machine *m = board(device, &t, &ret);
    if (!m)
        return ret;
    if (!eventTypes)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    *eventTypes = SUPPORTED_EVENTS;
    return finish(m, NVML_SUCCESS);
}

static int events_path(char *out, size_t size)
{
    const char *state = getenv("FAKENVML_STATE");
    return !state || !*state || snprintf(out, size, "%s/events", state) >= (int)size ? -1 : 0;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    char path[4096];
    struct stat st;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < MAX_EVENT_SETS; i++) {
        if (!__sync_bool_compare_and_swap(&event_sets[i].used, 0, 1))
            continue;
        struct fake_event_set *e = &event_sets[i];
        e->nregistered = 0;
        /* Only what happens from now on: earlier lines are history. */
        e->offset = events_path(path, sizeof path) == 0 && stat(path, &st) == 0 ? st.st_size : 0;
        *set = e;
        return NVML_SUCCESS;
    }
    return NVML_ERROR_MEMORY;
}

static int valid_set(nvmlEventSet_t set)
{
    return set >= &event_sets[0] && set < &event_sets[MAX_EVENT_SETS] && set->used;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    nvmlReturn_t ret;
    struct target t;
    if (!valid_set(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    struct machine *m = board(device, &t, &ret);
    if (!m)
        return ret;
    if (eventTypes & ~SUPPORTED_EVENTS)
        return finish(m, NVML_ERROR_NOT_SUPPORTED);
    for (int i = 0; i < set->nregistered; i++) {
        if (strcmp(set->uuid[i], t.gpu->uuid) == 0) {
            set->mask[i] |= eventTypes;
            return finish(m, NVML_SUCCESS);
        }
    }
    if (set->nregistered == MAX_GPUS)
        return finish(m, NVML_ERROR_INSUFFICIENT_SIZE);
    strcpy(set->uuid[set->nregistered], t.gpu->uuid);
    set->mask[set->nregistered++] = eventTypes;
    return finish(m, NVML_SUCCESS);
}

/* One event line into data, if this set registered for it; 1 delivered, 0 skipped. */
static int deliver(const struct machine *m, const struct fake_event_set *set, char *line, nvmlEventData_t *data)
{
    char uuid[UUID_BUF], type[16];
    unsigned long long xid, bit;
    int g, slot, used;
    if (sscanf(line, "%95s %15s %llu %n", uuid, type, &xid, &used) != 3 || line[used] != '\0')
        return 0;
    if (strcmp(type, "xid") == 0)
        bit = EVENT_XID;
    else if (strcmp(type, "dbe") == 0)
        bit = EVENT_DBE;
    else if (strcmp(type, "sbe") == 0)
        bit = EVENT_SBE;
    else if (parse_u64(type, 0, SUPPORTED_EVENTS, &bit))
        return 0;
    if (find_uuid(m, uuid, &g, &slot))
        return 0;
    for (int i = 0; i < set->nregistered; i++) {
        if (strcmp(set->uuid[i], m->gpu[g].uuid) != 0 || !(set->mask[i] & bit))
            continue;
        data->device = handle_of(g, -1);
        data->eventType = bit;
        data->eventData = xid;
        data->gpuInstanceId = slot >= 0 ? m->gpu[g].slot[slot].gi : NVML_VALUE_NOT_AVAILABLE_UINT;
        data->computeInstanceId = slot >= 0 ? m->gpu[g].slot[slot].ci : NVML_VALUE_NOT_AVAILABLE_UINT;
        return 1;
    }
    return 0;
}

/* The next complete line at set->offset that is for this set; 1 found, 0 none yet. */
static int next_event(struct fake_event_set *set, nvmlEventData_t *data)
{
    char path[4096], buf[64 * EVENT_LINE];
    if (events_path(path, sizeof path))
        return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    nvmlReturn_t ret;
    struct machine *m = begin(&ret);
    int found = 0;
    while (m && !found) {
        ssize_t got = pread(fd, buf, sizeof buf - 1, set->offset);
        if (got <= 0)
            break;
        buf[got] = '\0';
        char *line = buf, *nl;
        while (!found && (nl = strchr(line, '\n')) != NULL) {
            *nl = '\0';
            set->offset += nl - line + 1;
            found = deliver(m, set, line, data);
            line = nl + 1;
        }
        if (line == buf) /* a partial line only: its writer is not done */
            break;
    }
    free(m);
    close(fd);
    return found;
}

/* Waits up to timeoutms for an event, as the real call does (NVML_ERROR_TIMEOUT after it). */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    struct timespec start, now;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!valid_set(set) || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        if (next_event(set, data))
            return NVML_SUCCESS;
        clock_gettime(CLOCK_MONOTONIC, &now);
        double waited = (double)(now.tv_sec - start.tv_sec) * 1e3 + (double)(now.tv_nsec - start.tv_nsec) / 1e6;
        if (waited >= timeoutms)
            return NVML_ERROR_TIMEOUT;
        sleep_ms(timeoutms - waited < 2.0 ? timeoutms - waited : 2.0);
    }
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!valid_set(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    __atomic_store_n(&set->used, 0, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred)
{
    nvmlReturn_t ret;
    struct target t;
    struct machine *m = board(device, &t, &ret);
    if (!m)
        return ret;
    if (!corrRows || !uncRows || !isPending || !failureOccurred)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    const struct fake_health *h = &m->health[t.g];
    *corrRows = h->remapped_corr;
    *uncRows = h->remapped_unc;
    *isPending = h->remap_pending;
    *failureOccurred = h->remap_failed;
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    nvmlReturn_t ret;
    struct target t;
    struct machine *m = board(device, &t, &ret);
    if (!m)
        return ret;
    if (!reasons)
        return finish(m, NVML_ERROR_INVALID_ARGUMENT);
    *reasons = m->health[t.g].set ? m->health[t.g].clocks_event_reasons : 1; /* 1: GPU idle */
    return finish(m, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}
