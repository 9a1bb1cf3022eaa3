"""A process that opens device nodes and says how each open went, from wherever it was moved.

    python devprobe.py [--go] MODE PATH...

--go: first wait for a line on stdin (the test moves this process into a cgroup meanwhile);
--after FILE: first wait until FILE exists (a run started where its stdin is not the test's).
MODE: here (open now), fork (a child opens), daemon (setsid and a double fork: a grandchild
whose parent is gone opens), exec (exec a fresh interpreter that opens). Each open prints
one line "PATH RESULT", RESULT being OK or the errno's name (ENXIO: the kernel let the open
through to a driver that is not there; EPERM: a cgroup refused it; EACCES: the mode or ACL).
"""
import errno
import os
import sys


def here(paths):
    out = []
    for path in paths:
        try:
            os.close(os.open(path, os.O_RDWR))
            out.append(f"{path} OK")
        except OSError as e:
            out.append(f"{path} {errno.errorcode[e.errno]}")
    os.write(1, ("\n".join(out) + "\n").encode())


def main(argv):
    if argv[0] == "--go":
        sys.stdin.readline()
        argv = argv[1:]
    elif argv[0] == "--after":
        import time

        deadline = time.monotonic() + 60
        while not os.path.exists(argv[1]) and time.monotonic() < deadline:
            time.sleep(0.01)
        argv = argv[2:]
    mode, paths = argv[0], argv[1:]
    if mode == "here":
        here(paths)
    elif mode == "fork":
        pid = os.fork()
        if pid == 0:
            here(paths)
            os._exit(0)
        os.waitpid(pid, 0)
    elif mode == "daemon":
        pid = os.fork()
        if pid == 0:
            os.setsid()
            if os.fork() == 0:
                here(paths)  # its stdout is the pipe the test reads to its end
            os._exit(0)
        os.waitpid(pid, 0)
    elif mode == "exec":
        os.execv(sys.executable, [sys.executable, "-I", __file__, "here", *paths])
    else:
        sys.exit(f"devprobe: unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
