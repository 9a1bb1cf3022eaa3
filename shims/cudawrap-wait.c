/* cudawrap-wait: a run's wait for the cudawrap service, without the interpreter.
 *
 * The shim (cudawrap/__init__.py) asks the service for devices. When the answer is "wait",
 * it execs this program on the same connection, so that the run waits as a process of a few
 * hundred kilobytes instead of a Python interpreter of ~13 MB. Why: once a device is freed,
 * everything between the service's grant and the program's start is the hand-over every
 * waiting user feels, and exec from Python spends ~1 ms there tearing down the interpreter's
 * memory (measured: execve from python3.11 1.1 ms, from a small C process 0.17 ms). Here
 * that teardown happens when the wait starts, where nobody waits on it.
 *
 * It does what the shim's fast path does with the rest of the conversation (wire.py has the
 * format): prints the service's WAIT lines, takes the locks on the descriptors of a GRANT
 * (or sends LOST if one was taken past the service, and waits on) and prints the GRANT's line
 * (what the run got after waiting), for a share sends HELD
 * and waits for DONE, sets the variables as the shim's _become sets them, and execs the
 * program. A whole grant says nothing more: its connection closes as it execs, and the
 * service checks the locks then, one wake-up of the service less in the hand-over.
 * Anything else goes back to the shim, exec'd again with CUDAWRAP_RESUME saying why:
 *   "T" TICKET                  the service went away before granting: the general way asks
 *                               again (or decides alone), keeping the place in line;
 *   "E" CODE US TEXT US HINT    the service refused (US: the byte 0x1f): the shim reports it as
 *                               it reports its own refusals;
 * and an exec that fails goes back to the shim with the lease held (CUDAWRAP_LEASE): its
 * general way finds the program where an unwrap put it back, or says why it cannot run it.
 *
 * Usage (the shim's, not a person's; the first word pins the argument list's layout):
 *   cudawrap-wait cudawrap-wait/1 FD PROG REAL MPS_DIR TICKET PYTHON SHIM -- ARGV0 ARGS...
 * The environment is the run's own, exactly as the shim was given it. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define LAYOUT "cudawrap-wait/1"
#define MAGIC "cudawrap/1 "
#define MAX_MESSAGE (16 << 10) /* wire.MAX_MESSAGE */
#define MAX_FDS 64             /* wire.MAX_FDS */
#define MAX_FIELDS 64
#define LOCK_TRIES 4           /* wire.LOCK_TRIES */
#define LOCK_GAP_NS 300000L    /* wire.LOCK_GAP_S */
#define EX_SOFTWARE 70

extern char **environ;

static const char *prog, *real, *mps_dir, *python, *shim;
static char **program_argv;
static int sock, nprogram_argv;
static char ticket[MAX_MESSAGE];

/* One line on stderr in one write, as the shim's say(). */
static void say(const char *text) {
    size_t n = strlen(prog) + strlen(text) + 4;
    char *line = malloc(n);
    if (!line) return;
    int len = snprintf(line, n, "%s: %s\n", prog, text);
    if (len > 0) {
        ssize_t ignored = write(2, line, (size_t)len < n ? (size_t)len : n - 1);
        (void)ignored;
    }
    free(line);
}

/* ---- the environment ------------------------------------------------------------------ */

static char **env;
static size_t nenv, capenv;

static int env_find(const char *name, size_t len) {
    for (size_t i = 0; i < nenv; i++)
        if (strncmp(env[i], name, len) == 0 && env[i][len] == '=') return (int)i;
    return -1;
}

static const char *env_get(const char *name) {
    int i = env_find(name, strlen(name));
    return i < 0 ? NULL : env[i] + strlen(name) + 1;
}

static void env_remove(const char *name) {
    int i = env_find(name, strlen(name));
    if (i >= 0) memmove(env + i, env + i + 1, (nenv-- - (size_t)i) * sizeof *env);
}

/* NAME=VALUE (LEN bytes of ITEM) replacing NAME, or only where NAME is unset if !REPLACE. */
static int env_put(const char *item, size_t len, int replace) {
    const char *eq = memchr(item, '=', len);
    if (!eq || eq == item) return 0; /* a line without a name is no variable (wire.unpairs) */
    int i = env_find(item, (size_t)(eq - item));
    if (i >= 0 && !replace) return 0;
    char *copy = strndup(item, len);
    if (!copy) return -1;
    if (i >= 0) {
        env[i] = copy;
        return 0;
    }
    if (nenv + 2 > capenv) {
        size_t cap = capenv ? capenv * 2 : 64;
        char **grown = realloc(env, cap * sizeof *env);
        if (!grown) return -1;
        env = grown, capenv = cap;
    }
    env[nenv++] = copy;
    env[nenv] = NULL;
    return 0;
}

static int env_set(const char *name, const char *value) {
    size_t n = strlen(name) + strlen(value) + 2;
    char *item = malloc(n);
    if (!item) return -1;
    snprintf(item, n, "%s=%s", name, value);
    int r = env_put(item, n - 1, 1);
    free(item);
    return r;
}

/* The variables of a ``pairs`` value (NAME=VALUE lines): set, or set where unset. */
static int env_pairs(const char *text, int replace) {
    while (text && *text) {
        const char *end = strchr(text, '\n');
        size_t len = end ? (size_t)(end - text) : strlen(text);
        if (env_put(text, len, replace) != 0) return -1;
        text = end ? end + 1 : NULL;
    }
    return 0;
}

/* ---- messages (wire.py) ----------------------------------------------------------------- */

struct message {
    char verb[33];
    int n;
    char *key[MAX_FIELDS], *value[MAX_FIELDS];
};

static const char *field(const struct message *m, const char *key) {
    for (int i = 0; i < m->n; i++)
        if (strcmp(m->key[i], key) == 0) return m->value[i];
    return NULL;
}

/* Undo wire._escape in place: "\\n" is a newline, "\\" + c is c. */
static void unescape(char *s) {
    char *out = s;
    for (; *s; s++) {
        if (*s == '\\' && s[1]) {
            s++;
            *out++ = *s == 'n' ? '\n' : *s;
        } else {
            *out++ = *s;
        }
    }
    *out = '\0';
}

/* FRAME (NUL-terminated, without its final empty line) into M, pointing into FRAME; -1 if malformed. */
static int parse(char *frame, struct message *m) {
    if (strncmp(frame, MAGIC, strlen(MAGIC)) != 0) return -1;
    char *line = frame + strlen(MAGIC), *next;
    next = strchr(line, '\n');
    if (next) *next++ = '\0';
    if (!*line || strlen(line) >= sizeof m->verb) return -1;
    strcpy(m->verb, line);
    m->n = 0;
    for (line = next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        char *eq = strchr(line, '=');
        if (!eq || eq == line || m->n == MAX_FIELDS) return -1;
        *eq = '\0';
        unescape(eq + 1);
        m->key[m->n] = line, m->value[m->n] = eq + 1, m->n++;
    }
    return 0;
}

static char buffer[MAX_MESSAGE + 1];
static size_t buffered;
static int fds[MAX_FDS];
static int nfds;

static void drop_fds(void) {
    for (int i = 0; i < nfds; i++) close(fds[i]);
    nfds = 0;
}

/* The next message into M (its text in FRAME); 0 when the connection ended or broke. */
static int receive(struct message *m, char *frame) {
    for (;;) {
        char *end = buffered ? memmem(buffer, buffered, "\n\n", 2) : NULL;
        if (end) {
            size_t len = (size_t)(end - buffer);
            memcpy(frame, buffer, len);
            frame[len] = '\0';
            buffered -= len + 2;
            memmove(buffer, end + 2, buffered);
            if (memchr(frame, '\0', len) || parse(frame, m) != 0) return 0;
            return 1;
        }
        if (buffered >= MAX_MESSAGE) return 0;
        union { struct cmsghdr align; char space[CMSG_SPACE(MAX_FDS * sizeof(int))]; } control;
        struct iovec iov = {buffer + buffered, MAX_MESSAGE - buffered};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1,
                             .msg_control = control.space, .msg_controllen = sizeof control.space};
        ssize_t got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
        if (got < 0 && errno == EINTR) continue;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); got >= 0 && c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *in = (int *)CMSG_DATA(c);
            for (int i = 0; i < count; i++) {
                if (nfds < MAX_FDS) fds[nfds++] = in[i];
                else close(in[i]);
            }
        }
        if (got <= 0) return 0;
        buffered += (size_t)got;
    }
}

static void send_message(const char *verb, const char *devices) {
    char text[MAX_MESSAGE];
    /* devices are UUIDs and commas: nothing to escape */
    int len = snprintf(text, sizeof text, MAGIC "%s\ndevices=%s\n\n", verb, devices ? devices : "");
    if (len > 0 && (size_t)len < sizeof text) {
        ssize_t ignored = send(sock, text, (size_t)len, MSG_NOSIGNAL);
        (void)ignored;
    }
}

/* ---- back to the shim ------------------------------------------------------------------- */

static void resume(const char *why) {
    if (why) {
        env_remove("CUDAWRAP_RESUME");
        if (env_set("CUDAWRAP_RESUME", why) != 0) why = NULL;
    }
    char **argv = calloc((size_t)nprogram_argv + 4, sizeof *argv);
    if (argv) {
        argv[0] = (char *)python, argv[1] = "-IS", argv[2] = (char *)shim;
        for (int i = 1; i < nprogram_argv; i++) argv[i + 2] = program_argv[i];
        execve(python, argv, env);
    }
    char text[512];
    snprintf(text, sizeof text, "cannot run %s again to finish: %s", python, strerror(errno));
    say(text);
    _exit(EX_SOFTWARE);
}

static void refused(const struct message *m) {
    const char *code = field(m, "code"), *text = field(m, "text"), *hint = field(m, "hint");
    size_t n = strlen(code ? code : "") + strlen(text ? text : "") + strlen(hint ? hint : "") + 8;
    char *why = malloc(n);
    if (!why) resume(NULL);
    snprintf(why, n, "E%s\x1f%s\x1f%s", code ? code : "", text ? text : "", hint ? hint : "");
    resume(why);
}

static void gone(void) {
    size_t n = strlen(ticket) + 2;
    char *why = malloc(n);
    if (!why) resume(NULL);
    snprintf(why, n, "T%s", ticket);
    resume(why);
}

/* ---- the grant --------------------------------------------------------------------------- */

struct described {
    char uuid[256];
    int lease, exclusive;
};

static int in_list(const char *list, const char *item) {
    size_t len = strlen(item);
    for (const char *p = list; p && *p;) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == len && strncmp(p, item, n) == 0) return 1;
        p = end ? end + 1 : NULL;
    }
    return 0;
}

/* wire.described: each descriptor's device, whether it is a lease (else a slot), and its
 * lock; the count, or -1 for a grant that names its files wrongly. */
static int describe(const struct message *m, struct described *out) {
    const char *devices = field(m, "devices"), *fdlist = field(m, "fds");
    int n = 0, leases = 0;
    char copy[MAX_MESSAGE];
    snprintf(copy, sizeof copy, "%s", fdlist ? fdlist : (devices ? devices : ""));
    for (char *save = NULL, *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        if (n == MAX_FDS) return -1;
        struct described *d = &out[n];
        if (!fdlist) { /* a service that grants whole devices only */
            snprintf(d->uuid, sizeof d->uuid, "%s", item);
            d->lease = 1, d->exclusive = 1;
        } else {
            char *colon = strchr(item, ':'), *last = strrchr(item, ':');
            if (!colon || colon == last) return -1;
            *colon = '\0', *last = '\0';
            d->lease = strcmp(item, "lease") == 0;
            if (!d->lease && strcmp(item, "slot") != 0) return -1;
            if (strcmp(last + 1, "ex") != 0 && strcmp(last + 1, "sh") != 0) return -1;
            d->exclusive = strcmp(last + 1, "ex") == 0;
            if (strlen(colon + 1) >= sizeof d->uuid || !in_list(devices, colon + 1)) return -1;
            strcpy(d->uuid, colon + 1);
        }
        leases += d->lease;
        n++;
    }
    return leases ? n : -1;
}

/* Each lock, taken without blocking as the shim's lock_granted takes it; 0 if one was taken past the service. */
static int lock_all(const struct described *d, int n) {
    for (int i = 0; i < n; i++) {
        int how = (d[i].exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB, tries = 0;
        while (flock(fds[i], how) != 0) {
            if (++tries == LOCK_TRIES) return 0;
            struct timespec gap = {0, LOCK_GAP_NS};
            nanosleep(&gap, NULL);
        }
    }
    return 1;
}

static void append(char *out, size_t size, const char *text) {
    size_t used = strlen(out), len = strlen(text);
    if (used + len < size) memcpy(out + used, text, len + 1);
}

static const char *const MPS_VARIABLES[] = {"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                                            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                                            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"};

/* The shim's _become: the run's variables, its descriptors kept across exec, the exec. */
static void become(const struct message *grant, const struct described *d, int n, int shared) {
    if (!shared) { /* a whole device bypasses MPS (the shim's MPS_VARIABLES) */
        const char *pipe = env_get("CUDA_MPS_PIPE_DIRECTORY");
        size_t len = strlen(mps_dir);
        if (pipe && strncmp(pipe, mps_dir, len) == 0 && pipe[len] == '/')
            for (size_t i = 0; i < sizeof MPS_VARIABLES / sizeof *MPS_VARIABLES; i++) env_remove(MPS_VARIABLES[i]);
    }
    static char visible[MAX_MESSAGE], marker[MAX_MESSAGE];
    visible[0] = marker[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (!d[i].lease) continue;
        /* lease_marker: "fd:uuid" for a whole device, "fd:uuid:slotfd" for a share */
        char number[16];
        int slot = -1;
        for (int j = 0; j < n; j++)
            if (!d[j].lease && strcmp(d[j].uuid, d[i].uuid) == 0) slot = fds[j];
        snprintf(number, sizeof number, "%s%d:", *marker ? "," : "", fds[i]);
        append(marker, sizeof marker, number);
        append(marker, sizeof marker, d[i].uuid);
        if (slot >= 0) {
            snprintf(number, sizeof number, ":%d", slot);
            append(marker, sizeof marker, number);
        }
        append(visible, sizeof visible, *visible ? "," : "");
        append(visible, sizeof visible, d[i].uuid);
    }
    if (env_pairs(field(grant, "env"), 1) != 0 || env_pairs(field(grant, "defaults"), 0) != 0 ||
        env_set("CUDA_VISIBLE_DEVICES", visible) != 0 || env_set("CUDAWRAP_LEASE", marker) != 0 ||
        env_set("CUDAWRAP_PROGRAM", prog) != 0) {
        say("out of memory while starting the program");
        _exit(EX_SOFTWARE);
    }
    for (int i = 0; i < n; i++) fcntl(fds[i], F_SETFD, 0); /* the lease goes along */
    close(sock);
    const char *verbose = env_get("CUDAWRAP_VERBOSE");
    if (verbose && *verbose) {
        char text[MAX_MESSAGE + 1024];
        snprintf(text, sizeof text, "CUDA_VISIBLE_DEVICES=%s -> %s", visible, real);
        say(text);
    }
    /* The shim ignores SIGPIPE and SIGXFSZ (Python does), and ignored signals survive exec. */
    signal(SIGPIPE, SIG_DFL);
    signal(SIGXFSZ, SIG_DFL);
    execve(real, program_argv, env);
    /* The general way, with the lease inherited, finds the program where an unwrap put it
     * back, or says why it cannot run. */
    signal(SIGPIPE, SIG_IGN);
    resume(NULL);
}

/* Ctrl-C while waiting: 130, as the shim exits on KeyboardInterrupt (the service sees the
 * connection close and drops the waiter). */
static void interrupted(int signum) {
    (void)signum;
    _exit(130);
}

int main(int argc, char **argv) {
    signal(SIGINT, interrupted);
    if (argc < 11 || strcmp(argv[1], LAYOUT) != 0 || strcmp(argv[9], "--") != 0) {
        fprintf(stderr, "cudawrap-wait: started by something other than the cudawrap shim of this version\n");
        return 64; /* EX_USAGE */
    }
    sock = atoi(argv[2]);
    prog = argv[3], real = argv[4], mps_dir = argv[5], python = argv[7], shim = argv[8];
    snprintf(ticket, sizeof ticket, "%s", argv[6]);
    program_argv = argv + 10, nprogram_argv = argc - 10;
    fcntl(sock, F_SETFD, FD_CLOEXEC); /* inherited for us, not for the program */
    for (char **e = environ; *e; e++)
        if (env_put(*e, strlen(*e), 1) != 0) return EX_SOFTWARE;
    if (!env && !(env = calloc(1, sizeof *env))) return EX_SOFTWARE;
    signal(SIGPIPE, SIG_IGN); /* as in the shim: a closed stderr is an error, not a death */

    static char frame[MAX_MESSAGE + 1];
    static struct described described[MAX_FDS];
    struct message m;
    for (;;) {
        if (!receive(&m, frame)) {
            drop_fds();
            gone();
        }
        if (strcmp(m.verb, "wait") == 0) {
            const char *t = field(&m, "ticket"), *text = field(&m, "text");
            if (t) snprintf(ticket, sizeof ticket, "%s", t);
            if (text && *text) say(text);
        } else if (strcmp(m.verb, "error") == 0) {
            drop_fds();
            refused(&m);
        } else if (strcmp(m.verb, "grant") == 0) {
            int n = describe(&m, described);
            if (n < 0 || n != nfds || !lock_all(described, n)) {
                drop_fds();
                send_message("lost", field(&m, "devices"));
                continue;
            }
            const char *got = field(&m, "text"); /* what it got after waiting */
            if (got && *got) say(got);
            int shared = 0;
            for (int i = 0; i < n; i++) shared |= !described[i].lease;
            /* Whole devices: nothing to say; the connection closes in become(), before the
             * exec, and the service checks the locks then. A share says HELD (below). */
            if (shared) send_message("held", field(&m, "devices"));
            /* A share waits for DONE: under enforce the service opens the device's MPS pipe
             * directory to this user then, before the program may connect to it. The locks
             * are ours either way: a connection that ends means the kernel's word stands. */
            static char later[MAX_MESSAGE + 1];
            struct message next;
            while (shared && receive(&next, later) && strcmp(next.verb, "done") != 0) {}
            become(&m, described, n, shared);
        }
    }
}
