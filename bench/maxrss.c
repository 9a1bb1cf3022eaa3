/* maxrss CMD [ARG...]: run CMD with its output sent to /dev/null and print
 * "<peak RSS in KiB> <exit status>" of it on stdout.
 *
 * The peak RSS of a process includes what it inherited at fork, so a big parent (the
 * benchmark's Python) would inflate every figure: this small parent keeps it honest.
 * Exec keeps the process, so for a wrapped program the figure is the shim's peak.
 */
#include <fcntl.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: maxrss CMD [ARG...]\n");
        return 2;
    }
    pid_t pid = fork();
    if (pid < 0) {
        perror("maxrss: fork");
        return 2;
    }
    if (pid == 0) {
        int null = open("/dev/null", O_WRONLY);
        if (null >= 0) {
            dup2(null, 1);
            dup2(null, 2);
        }
        execv(argv[1], argv + 1);
        _exit(127);
    }
    int status;
    struct rusage usage;
    if (wait4(pid, &status, 0, &usage) < 0) {
        perror("maxrss: wait4");
        return 2;
    }
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    printf("%ld %d\n", usage.ru_maxrss, code);
    return 0;
}
