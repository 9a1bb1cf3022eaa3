"""The shim is invisible: argv, environment, exit codes, signals and pipes pass through."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.installed import ready_line
from support.machine import read_environ_file
from support.procs import sh_program

ARGV_C = r"""
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    printf("%s\n", cvd ? cvd : "(unset)");
    for (int i = 0; i < argc; i++) printf("%s\n", argv[i]);
    return 0;
}
"""


@pytest.fixture(scope="module")
def argv_printer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("argv")
    src = out / "argv.c"
    src.write_text(ARGV_C)
    subprocess.run(["cc", "-O", "-o", str(out / "argv"), str(src)], check=True)
    return out / "argv"


def test_gets_one_free_device_by_uuid(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    r = inst.run("recon")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[0])
    assert out["cvd"] in inst.machine.leaf_uuids()  # a UUID, never an index
    assert out["devices"] == [out["cvd"]]
    assert r.stderr == b""  # nothing to say, so nothing said


def test_argv_is_invoked_path_and_args(installed, argv_printer):
    inst = installed("four-gpus")
    link = inst.wrap("argv", argv_printer)
    args = ["--flag", "two words", "ünï", ""]
    r = inst.run(str(link), *args)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode().split("\n")
    assert lines[0].startswith("GPU-")
    assert lines[1:1 + 1 + len(args)] == [str(link)] + args


def test_found_through_a_symlink_elsewhere(installed, argv_printer, tmp_path):
    inst = installed("four-gpus")
    link = inst.wrap("argv", argv_printer)
    alias = tmp_path / "alias-dir"
    alias.mkdir()
    (alias / "argv").symlink_to(link)
    r = inst.run(str(alias / "argv"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().split("\n")[1] == str(alias / "argv")


def test_environment_is_byte_identical_but_for_the_device(installed, tmp_path):
    inst = installed("four-gpus")
    inst.wrap("recon")
    env = {k.encode(): v.encode() for k, v in inst.environ().items()}
    # A C locale makes Python add LC_CTYPE (PEP 538); odd bytes must survive untouched.
    for key in (b"LC_ALL", b"LC_CTYPE", b"LANG"):
        env.pop(key, None)
    env[b"LANG"] = b"C"
    env[b"ODD"] = b"\xff\xfe not utf-8 = really"
    env[b"EMPTY"] = b""
    env[b"PYTHONPATH"] = b"/nonexistent"  # the shim must ignore it (-I) and pass it on
    out = tmp_path / "env.out"
    r = subprocess.run(["recon", "--env-out", str(out)], env=env, capture_output=True,
                       cwd=inst.bindir, timeout=30)
    assert r.returncode == 0, r.stderr
    got = read_environ_file(out)
    granted = json.loads(r.stdout.splitlines()[0])["cvd"]
    expected = dict(env)
    expected[b"CUDA_VISIBLE_DEVICES"] = granted.encode()
    lease = got.pop(b"CUDAWRAP_LEASE")
    assert lease.endswith(b":" + granted.encode())
    assert got.pop(b"CUDAWRAP_PROGRAM") == b"recon"  # the wrapped name, for status and the ledger
    assert got == expected


def test_exit_code_passes_through(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    assert inst.run("recon", "--exit", "42").returncode == 42
    assert inst.run("recon", "--exit", "0").returncode == 0


def test_death_by_signal_passes_through(installed, tmp_path):
    inst = installed("four-gpus")
    prog = sh_program(tmp_path / "selfkill", "kill -USR1 $$\n")
    inst.wrap("selfkill", prog)
    assert inst.run("selfkill").returncode == -signal.SIGUSR1


def test_signals_reach_the_program_at_the_same_pid(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    proc = inst.start("recon", "--hold", "30")
    info = ready_line(proc)
    assert info["pid"] == proc.pid  # exec, not a child: the caller's pid is the program's
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM


def test_wrapped_pipe_to_head_behaves_like_the_real_program(installed, tmp_path):
    inst = installed("four-gpus")
    prog = sh_program(tmp_path / "spew", "exec yes cudawrap\n")
    inst.wrap("spew", prog)
    script = "set -o pipefail; {} | head -n 2; echo status=$?"
    wrapped = subprocess.run(["bash", "-c", script.format("spew")], env=inst.environ(),
                             capture_output=True, timeout=30, cwd=inst.bindir)
    direct = subprocess.run(["bash", "-c", script.format(str(prog))], env=inst.environ(),
                            capture_output=True, timeout=30)
    assert wrapped.stdout == direct.stdout == b"cudawrap\ncudawrap\nstatus=141\n"
    assert wrapped.stderr == direct.stderr == b""  # no "Broken pipe" noise


def test_verbose_says_what_it_did(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    r = inst.run("recon", CUDAWRAP_VERBOSE="1")
    assert r.returncode == 0
    assert b"CUDA_VISIBLE_DEVICES=GPU-" in r.stderr


def test_missing_real_program_reads_like_the_shell(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    (inst.bindir / "CUDAWRAP_recon").unlink()
    r = inst.run("recon")
    assert r.returncode == 127
    assert r.stderr.decode().splitlines()[0].startswith("recon: the real program")


@pytest.mark.parametrize("how", ["its own shim", "another program's shim, by a relative link",
                                 "the prototype, through two links", "a hard link of the prototype"])
def test_a_real_program_that_leads_back_to_a_shim_is_refused(installed, how):
    inst = installed("four-gpus")
    link = inst.wrap("recon")
    other = inst.wrap("other")
    real = inst.bindir / "CUDAWRAP_recon"
    real.unlink()
    if how == "its own shim":
        real.symlink_to(inst.layout.program_shim(str(link)))
    elif how.startswith("another"):
        real.symlink_to(os.path.relpath(inst.layout.program_shim(str(other)), inst.bindir))
    elif how.startswith("the prototype"):
        (inst.bindir / "hop").symlink_to(inst.layout.shim)
        real.symlink_to("hop")
    else:
        os.link(inst.layout.shim, real)
    r = inst.run("recon")
    assert r.returncode == 127, r.stderr
    assert r.stderr.decode().splitlines()[0] == f"recon: {real} leads back to the shim itself"


def test_a_real_program_that_is_a_link_runs(installed, tmp_path):
    inst = installed("four-gpus")
    inst.wrap("recon")
    real = inst.bindir / "CUDAWRAP_recon"
    os.replace(real, tmp_path / "recon-1.2")
    (tmp_path / "current").symlink_to("recon-1.2")  # a link to a link, the last one relative
    real.symlink_to(tmp_path / "current")
    r = inst.run("recon")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["devices"]


def test_running_the_shim_directly_is_refused(installed):
    inst = installed("four-gpus")
    r = inst.run(str(inst.layout.shim))
    assert r.returncode == os.EX_USAGE
    assert b"run a wrapped program by its own name" in r.stderr


# __future__ too: the one stdlib module a launch would read from disk (~0.1 ms); the modules on
# the shim's path write the annotations that need it as strings instead.
HEAVY = {"plumbum", "pathlib", "typing", "dataclasses", "json", "tomllib", "tomli", "filelock",
         "logging", "re", "enum", "subprocess", "inspect", "argparse", "threading", "__future__"}
# And with the monitor's snapshot, os (and os.path, which imports it): ~1 ms, a tenth of a bare
# interpreter's start, for its _collections_abc; base/posixos.py has what the launch needs.
NO_OS = {"os", "posixpath", "_collections_abc"}


def shim_imports(inst, *argv: str, **env: str) -> set:  # type: ignore[no-untyped-def]
    """Top-level modules the real shim imports on a real launch of ARGV, up to its exec."""
    return {name.split(".")[0] for name in shim_modules(inst, *argv, **env)}


def shim_modules(inst, *argv: str, **env: str) -> set:  # type: ignore[no-untyped-def]
    """Modules (full dotted names) the real shim imports on a real launch of ARGV, up to its exec.

    The shim runs by its own shebang line (interpreter and flags) plus `-X importtime`, which
    makes the interpreter list every import on stderr before the exec replaces it.
    """
    shebang = inst.layout.shim.read_text().split("\n", 1)[0][2:].split()
    r = inst.run(shebang[0], "-X", "importtime", *shebang[1:], *argv, **env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["devices"]  # it got through to the program
    lines = [x for x in r.stderr.decode().splitlines() if x.startswith("import time:")][1:]
    assert lines, r.stderr  # the header line, then one line per import
    return {x.rsplit("|", 1)[1].strip() for x in lines}


def test_the_shim_imports_only_what_it_needs(installed):
    from cudawrap.monitor.loop import refresh_once

    inst = installed("four-gpus")
    link = inst.wrap("recon")
    # With `cudawrap monitor`'s snapshot fresh: not even NVML.
    assert refresh_once(inst.layout) is None
    loaded = shim_imports(inst, str(link))
    assert "cudawrap" in loaded
    assert not loaded & (HEAVY | NO_OS | {"pynvml", "ctypes"}), sorted(loaded & (HEAVY | NO_OS | {"pynvml", "ctypes"}))
    # Without it, NVML through cudawrap's own ctypes binding (nvmldirect), not pynvml, which
    # would bring subprocess, threading, re and enum; nothing heavy comes from our side.
    inst.layout.usage_snapshot.unlink()
    loaded = shim_imports(inst, str(link))
    assert "ctypes" in loaded
    assert not loaded & (HEAVY | {"pynvml"}), sorted(loaded & (HEAVY | {"pynvml"}))


# cudawrap's modules on a launch, exactly: a new import on the shim's path shows here first.
LAUNCH_MODULES = {
    "cudawrap", "cudawrap.errors", "cudawrap.locations", "cudawrap.base.users",
    # The general way: the package's door (which defines what it grants) and its body.
    "cudawrap.launch", "cudawrap.launch.general",
    "cudawrap.base", "cudawrap.base.audit", "cudawrap.base.rootfile", "cudawrap.base.posixos",
    "cudawrap.devices", "cudawrap.devices.model", "cudawrap.devices.snapshot",
    "cudawrap.lease", "cudawrap.lease.files", "cudawrap.lease.sharing",
    "cudawrap.policy", "cudawrap.policy.effective",
    "cudawrap.sched", "cudawrap.sched.acquirer", "cudawrap.sched.machine",
    "cudawrap.sched.request", "cudawrap.sched.queue",
    # launch.obtain split: the device sources' interface, and the narrowing to a run's candidates.
    "cudawrap.devices.source", "cudawrap.sched.candidates",
    # Not sched.run: it is for runs that wait.
}
# With the monitor's snapshot of an idle machine: nothing more (/proc, for whether the processes
# it names have exited since, only once it names one).
LAUNCH_MODULES_SNAPSHOT = LAUNCH_MODULES
# Without the monitor's snapshot: NVML through the lean binding, and the inventory cache.
LAUNCH_MODULES_NVML = LAUNCH_MODULES | {
    "cudawrap.devices.invcache", "cudawrap.devices.nvml", "cudawrap.devices.nvmldirect",
}


def test_a_launch_imports_exactly_these_cudawrap_modules(installed):
    from cudawrap.monitor.loop import refresh_once

    inst = installed("four-gpus")
    link = inst.wrap("recon")
    assert refresh_once(inst.layout) is None  # the monitor's snapshot: no NVML
    ours = sorted(m for m in shim_modules(inst, str(link)) if m.split(".")[0] == "cudawrap")
    assert ours == sorted(LAUNCH_MODULES_SNAPSHOT)
    inst.layout.usage_snapshot.unlink()
    ours = sorted(m for m in shim_modules(inst, str(link)) if m.split(".")[0] == "cudawrap")
    assert ours == sorted(LAUNCH_MODULES_NVML)


def test_a_snapshot_naming_a_process_brings_in_proc(installed):
    from cudawrap.monitor.loop import refresh_once

    inst = installed("four-gpus")
    link = inst.wrap("recon")
    foreign = subprocess.Popen(["sleep", "60"])  # alive: the monitor records when it started
    try:
        inst.machine.add_process(foreign.pid, inst.machine.leaf_uuids()[0])
        assert refresh_once(inst.layout) is None
        ours = {m for m in shim_modules(inst, str(link)) if m.split(".")[0] == "cudawrap"}
    finally:
        foreign.kill()
        foreign.wait()
    assert ours == LAUNCH_MODULES | {"cudawrap.base.proc"}


# Runs the shim at SHIM (argv[1]) as its #! line would, writing a line on stderr for each
# collection of the cyclic garbage collector once the general way (cudawrap.launch) loads.
GC_WATCH = """
import gc, sys
def seen(phase, info):
    if phase == "start" and "cudawrap.launch" in sys.modules:
        sys.stderr.write("collection of generation %d\\n" % info["generation"])
gc.callbacks.append(seen)
shim = sys.argv[1]
sys.argv = sys.argv[1:]
exec(compile(open(shim).read(), shim, "exec"), {"__name__": "__main__"})
"""


@pytest.mark.parametrize("monitor", [True, False])
def test_a_launch_runs_no_garbage_collection(installed, monitor):
    # ~24 modules' objects are loaded by the general way: at the default threshold (700) the
    # collector ran ~10 times a launch, one of them over every object (generation 1, ~1 ms).
    from cudawrap.monitor.loop import refresh_once

    inst = installed("four-gpus")
    link = inst.wrap("recon")
    if monitor:
        assert refresh_once(inst.layout) is None
    shebang = inst.layout.shim.read_text().split("\n", 1)[0][2:].split()
    r = inst.run(*shebang, "-c", GC_WATCH, str(link))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["devices"]
    assert b"collection of generation" not in r.stderr, r.stderr.decode()


def test_own_modules_finds_what_the_path_finder_finds():
    # The shim's general way finds cudawrap's submodules with OwnModules: the same spec
    # (file, bytecode cache, package path, loader) as the path finder's, so loading is unchanged.
    import importlib
    from importlib.machinery import PathFinder, SourceFileLoader

    from cudawrap import OwnModules

    others = {"cudawrap.base.proc", "cudawrap.launch.inherited", "cudawrap.launch.client", "cudawrap.sched.run",
              "cudawrap.launch.failures", "cudawrap.launch.links"}
    for name in sorted(LAUNCH_MODULES_NVML | others):
        if name == "cudawrap":
            continue
        parent = importlib.import_module(name.rpartition(".")[0])
        ours, theirs = OwnModules.find_spec(name, parent.__path__), PathFinder.find_spec(name, parent.__path__)
        assert ours is not None and theirs is not None, name
        assert isinstance(ours.loader, SourceFileLoader) and type(theirs.loader) is SourceFileLoader, name
        assert (ours.name, ours.origin, ours.cached, ours.submodule_search_locations, ours.parent, ours.has_location) == (
            theirs.name, theirs.origin, theirs.cached, theirs.submodule_search_locations, theirs.parent,
            theirs.has_location), name
    # Anything else is left to the finders after it.
    assert OwnModules.find_spec("json", None) is None
    assert OwnModules.find_spec("cudawrap.no_such_module", importlib.import_module("cudawrap").__path__) is None


def _own_module(tmp_path: Path, text: str, **compile_args) -> tuple:  # type: ignore[no-untyped-def]
    """A module cudawrap.own_probe of TEXT in a directory of TMP_PATH, its pyc written by
    py_compile (COMPILE_ARGS); (its OwnModules spec, its source path)."""
    import py_compile

    from cudawrap import OwnModules

    pkg = tmp_path / "pkg"
    pkg.mkdir(exist_ok=True)
    source = pkg / "own_probe.py"
    source.write_text(text)
    py_compile.compile(str(source), doraise=True, **compile_args)
    return (lambda: OwnModules.find_spec("cudawrap.own_probe", [str(pkg)])), source


def test_own_modules_loads_a_current_pyc_itself_and_as_the_loader_would(tmp_path, monkeypatch):
    # The shim's general way reads each of its ~24 modules' pyc with one open and read, checked
    # with the stat that found the source, not through the loader's layers (~20 us a module).
    from importlib.machinery import SourceFileLoader

    spec, source = _own_module(tmp_path, "X = 1\n", dfile="/elsewhere/own_probe.py")
    theirs = SourceFileLoader("cudawrap.own_probe", str(source)).get_code("cudawrap.own_probe")
    monkeypatch.setattr(SourceFileLoader, "get_code", lambda self, name: pytest.fail("the loader's own way"))
    ours = spec().loader.get_code("cudawrap.own_probe")
    assert ours == theirs and ours.co_filename == str(source)  # the source's path, as the loader fixes it
    module = {}
    exec(ours, module)
    assert module["X"] == 1


@pytest.mark.parametrize("change", ["newer source", "same time, other size", "hash-based pyc"])
def test_own_modules_leaves_any_other_pyc_to_the_loader(tmp_path, change):
    # A pyc its source no longer matches (by time, by size, or a hash-based one) is the loader's
    # to check, and here to recompile: the module is the source's as it is now.
    import importlib.util
    import py_compile

    hashed = {"invalidation_mode": py_compile.PycInvalidationMode.CHECKED_HASH} if change == "hash-based pyc" else {}
    spec, source = _own_module(tmp_path, "X = 1\n", **hashed)
    st = source.stat()
    source.write_text("X = 22\n" if change == "same time, other size" else "X = 2\n")
    if change == "newer source":
        os.utime(source, (st.st_atime + 10, st.st_mtime + 10))
    else:
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    module = importlib.util.module_from_spec(spec())
    module.__spec__.loader.exec_module(module)
    assert module.X == (22 if change == "same time, other size" else 2)


def test_real_program_not_executable_reads_like_the_shell(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    (inst.bindir / "CUDAWRAP_recon").chmod(0o644)
    r = inst.run("recon")
    assert r.returncode == 126
    assert r.stderr.decode().splitlines() == [f"recon: {inst.bindir / 'CUDAWRAP_recon'}: permission denied"]
