/* A one-second run without an interpreter: the makespan section's job.
 *
 * hold SECONDS LOG: appends a start line, holds SECONDS, appends an end line, in the
 * stand-in's format ({"event", "time", "pid", "devices"}), the devices being the entries
 * of CUDA_VISIBLE_DEVICES as cudawrap set them. Without a device it exits 100 without
 * logging, as the stand-in does. Its own start and exit take well under a millisecond, so
 * a burst of these measures the hand-overs, not a Python stand-in's start-up (~40 ms). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int record(const char *path, const char *event, const char *devices) {
    FILE *f = fopen(path, "a");
    if (!f) return -1;
    fprintf(f, "{\"event\": \"%s\", \"time\": %.6f, \"pid\": %d, \"devices\": [", event, now(), (int)getpid());
    char *copy = strdup(devices), *save = NULL;
    int first = 1;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save), first = 0)
        fprintf(f, "%s\"%s\"", first ? "" : ", ", tok);
    free(copy);
    fprintf(f, "]}\n");
    return fclose(f);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: hold SECONDS LOG\n");
        return 2;
    }
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    if (!cvd || !*cvd) {
        fprintf(stderr, "hold: no device (CUDA_VISIBLE_DEVICES unset or empty)\n");
        return 100;
    }
    double secs = atof(argv[1]);
    if (record(argv[2], "start", cvd) != 0) return 1;
    struct timespec ts = {(time_t)secs, (long)((secs - (time_t)secs) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) {}
    return record(argv[2], "end", cvd) != 0;
}
