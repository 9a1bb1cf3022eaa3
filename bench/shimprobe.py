"""Run the shim's own code in a fresh interpreter and say where its time went.

    python -IS shimprobe.py phases|cprofile LINK [ARGS...]
    python -IS shimprobe.py import-cost LINK ctypes|pynvml|pynvml-no-util

LINK is a wrapped program (a symlink to the installed shim). The probe does what the
shim does -- the shim's baked ``sys.path`` and root, ``sys.argv[0] = LINK``,
``cudawrap.launch.main(root)`` -- but ``posix.execve`` is replaced by a stop: the probe
prints one JSON line on stdout and exits, which also releases the lease.

* ``phases``: wall time of each step of a launch, by wrapping a few functions
  (``perf_counter`` around them; the wrappers cost microseconds).
* ``cprofile``: the whole launch under cProfile; the top functions by own and
  cumulative time.

Imports only ``posix``, ``sys`` and ``time`` before the measurement (not ``os``, which a
launch with the monitor's snapshot never loads), so nothing the shim needs is loaded in
advance except where said ("import cudawrap lazy modules").
"""
import time

T0 = time.perf_counter()

import posix  # noqa: E402
import sys  # noqa: E402

perf = time.perf_counter


def _shim_settings(link):
    """(sys.path entries, root) baked into the shim LINK points at."""
    syspath = root = None
    with open(link, encoding="utf-8") as f:  # the shim it links to
        for line in f:
            if line.startswith("sys.path[:0] = "):
                syspath = eval(line.split("=", 1)[1])  # a list literal we generated
            elif line.startswith("main("):
                # main(ROOT) or main(ROOT, LINK): literals we generated; the root is first
                root = eval("(" + line[len("main("):line.rindex(")")] + ",)")[0]
    if syspath is None or root is None:
        raise SystemExit(f"shimprobe: {link} does not lead to a cudawrap shim")
    return syspath, root


def _emit(record):
    import json

    posix.write(1, (json.dumps(record) + "\n").encode())
    posix._exit(0)


def phases(link, args):
    syspath, root = _shim_settings(link)
    sys.path[:0] = syspath
    sys.argv = [link] + args
    acc = {}
    start = perf()
    import cudawrap.launch as launch

    general = launch  # the general way (the shim's fast path, the package, found no service)
    acc["import cudawrap.launch (errors, audit, leases, locations)"] = perf() - start
    start = perf()
    import cudawrap.sched.acquirer
    import cudawrap.policy.effective
    import cudawrap.devices.snapshot
    import cudawrap.sched.queue  # noqa: F401

    # Through sys.modules: the package's __init__ exports a function named `acquire`.
    acquire, policy, snapshot = (sys.modules[f"cudawrap.{m}"] for m in ("sched.acquirer", "policy.effective", "devices.snapshot"))
    acc["import cudawrap lazy modules (policy, snapshot, acquire, waitqueue)"] = perf() - start
    # nvml only where the launch imports it: without a fresh snapshot (no monitor).
    nvml = None
    if snapshot.read_fresh(root) is None:
        start = perf()
        import cudawrap.devices.nvml

        nvml = sys.modules["cudawrap.devices.nvml"]
        acc["import cudawrap.devices.nvml"] = perf() - start

    missing = []

    def timed(owner, name, label):
        real = getattr(owner, name, None)
        if real is None:  # the launch path changed: say so instead of failing
            missing.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return

        def wrapper(*a, **k):
            t = perf()
            try:
                return real(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + perf() - t

        setattr(owner, name, wrapper)

    timed(policy, "effective", "policy.effective (config cache)")
    timed(general, "find_link", "find_link + real_program")
    timed(general, "real_program", "find_link + real_program")
    if nvml is not None:
        timed(nvml, "_binding", "_import binding")
        timed(nvml, "init", "_nvml.init")
        timed(nvml, "inventory", "_nvml.inventory")
        timed(nvml, "matches", "_nvml.matches")
        timed(nvml, "refresh", "_nvml.refresh")
        refresh = nvml.refresh

        def refresh_noting_init(*a, **k):  # the init() inside refresh() belongs to refresh
            before = acc.get("_nvml.init", 0.0)
            try:
                return refresh(*a, **k)
            finally:
                acc["_init in refresh"] = acc.get("_init in refresh", 0.0) + acc.get("_nvml.init", 0.0) - before

        nvml.refresh = refresh_noting_init
    timed(acquire.Acquirer, "arrive", "acquire (queue mutex, flock leases)")
    timed(general, "obtain", "_obtain")
    timed(general, "original_environ", "original_environ (/proc/self/environ)")

    def stop(path, argv, env):
        end = perf()
        out = dict(acc)
        # Split the nested timers into exclusive parts.
        pyimp = out.pop("_import binding", 0.0)
        init = out.pop("_nvml.init", 0.0) - out.pop("_init in refresh", 0.0)
        inv = out.pop("_nvml.inventory", 0.0)
        cur = out.pop("_nvml.matches", 0.0)
        ref = out.pop("_nvml.refresh", 0.0)
        obtain = out.pop("_obtain", 0.0)
        out["import the NVML binding (nvmldirect: ctypes)"] = pyimp
        out["nvmlInit"] = init - pyimp
        # matches() or inventory() includes the first init(); at most one of the two runs.
        # refresh() (with the init() it calls for a device not read yet) is its own row.
        out["NVML: sync's layout still the machine's (nvml.matches minus init)"] = cur - (init if cur else 0.0)
        out["NVML: the devices taken, by UUID (nvml.refresh)"] = ref
        out["NVML enumeration (nvml.inventory minus init)"] = inv - (init if inv and not cur else 0.0)
        # refresh() runs inside acquire(): taken out of that phase, as it is its own row.
        if ref:
            out["acquire (queue mutex, flock leases)"] = out.get("acquire (queue mutex, flock leases)", 0.0) - ref
        out["rest of obtain (selection, lease dir, queue)"] = (obtain - inv - cur - ref
                                                               - out.get("acquire (queue mutex, flock leases)", 0.0))
        out["other (exec preparation, glue)"] = (end - T0) - sum(out.values())
        _emit({"mode": "phases", "total_s": end - T0, "phases_s": out, "not_timed": missing,
               "modules": len(sys.modules), "devices": env.get(b"CUDA_VISIBLE_DEVICES", b"").decode()})

    posix.execve = stop  # what the launch calls (os.execve is the same function)
    launch.main(root)


def cprofile(link, args):
    import cProfile

    syspath, root = _shim_settings(link)
    sys.path[:0] = syspath
    sys.argv = [link] + args
    prof = cProfile.Profile()

    def stop(path, argv, env):
        prof.disable()
        import pstats

        stats = pstats.Stats(prof).stats
        rows = []
        for (filename, line, func), (cc, nc, tt, ct, _callers) in stats.items():
            short = filename
            for marker in ("site-packages/", "/cudawrap/", "/lib/python"):
                if marker in filename:
                    short = filename.split(marker, 1)[1]
                    if marker == "/cudawrap/":
                        short = "cudawrap/" + short
                    break
            rows.append({"function": f"{short}:{line}({func})", "calls": nc, "own_s": tt, "cum_s": ct})
        rows.sort(key=lambda r: r["own_s"], reverse=True)
        by_own = rows[:20]
        rows.sort(key=lambda r: r["cum_s"], reverse=True)
        _emit({"mode": "cprofile", "by_own": by_own, "by_cumulative": rows[:30]})

    posix.execve = stop
    prof.enable()
    import cudawrap.launch as launch

    launch.main(root)


def import_cost(link, args):
    """What-if: the cost of importing pynvml in other ways, in this fresh interpreter.

    ARGS[0] is "ctypes" (ctypes alone), "nvmldirect" (the shim's ctypes binding), "pynvml"
    (as sync and the monitor import it) or "pynvml-no-util"
    (pynvml with ``ctypes.util`` stubbed out: pynvml imports find_library from it but
    never calls it on Linux, and ctypes.util drags in shutil, subprocess, tempfile, re).
    """
    syspath, _root = _shim_settings(link)
    sys.path[:0] = syspath
    variant = args[0]
    start = perf()
    if variant == "ctypes":
        import ctypes  # noqa: F401
    elif variant == "pynvml":
        import pynvml  # noqa: F401
    elif variant == "nvmldirect":
        import cudawrap.devices.nvmldirect  # noqa: F401  (what the shim imports instead of pynvml)
    elif variant == "pynvml-no-util":
        import ctypes  # noqa: F401

        stub = type(sys)("ctypes.util")
        stub.find_library = lambda name: None
        sys.modules["ctypes.util"] = stub
        import pynvml  # noqa: F401,F811
    else:
        raise SystemExit(f"shimprobe: unknown import variant {variant}")
    _emit({"mode": "import-cost", "variant": variant, "seconds": perf() - start, "modules": len(sys.modules)})


if __name__ == "__main__":
    mode, link_arg, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    {"phases": phases, "cprofile": cprofile, "import-cost": import_cost}[mode](link_arg, rest)
