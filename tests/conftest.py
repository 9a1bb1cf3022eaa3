import pytest

from support.admin import admin, shared_tmp  # noqa: F401
from support.hostclean import HostCheck
from support.installed import installed  # noqa: F401
from support.installsh import wheelhouse  # noqa: F401
from support.machine import fakenvml_lib, machine  # noqa: F401
from support.procs import spawned  # noqa: F401
from support.users import mu, mu_world  # noqa: F401
from support.ways import both  # noqa: F401


# `make test` runs the suite as two halves side by side (pytest-xdist, -n 2: one worker for
# each, pytest_xdist_make_scheduler below). One half is the tests that chain installs, package builds and strace
# sweeps: each is a long line of busy processes, one after another, with nothing to share
# with each other half. The other half is the rest, which mostly waits on its processes. Side
# by side on 2 cores each half ran about as fast as alone (test_install.py 195 s beside 127 s
# of service, scheduling and wrap tests; alone 190 s and 124 s). Those chains must stay in one
# group: the system installs of test_install.py and test_deb.py change the same paths.
CHAINED = frozenset({
    "test_install.py", "test_deb.py", "test_crash.py", "test_bench.py", "test_gpukit.py", "test_dpkg.py",
    "test_client.py",
})


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: absent without it
def pytest_xdist_make_scheduler(config, log):  # type: ignore[no-untyped-def]
    """Two scopes, the chained files and the rest, one to each worker. (xdist's own loadgroup
    would do it from marks, but it names the group in the test id through an attribute that
    pytest 9 no longer reads, and then spreads every test.)"""
    from xdist.scheduler import LoadScopeScheduling

    class TwoHalves(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "chained" if nodeid.split("::", 1)[0].rsplit("/", 1)[-1] in CHAINED else "rest"

    return TwoHalves(config, log)



# The suite leaves the host clean (support/hostclean.py): checked once, at the very end, by
# the process that started the tests (xdist's controller, once every worker is done; its
# workers run nothing of this), never by a worker, whose end is not the others'.
HOST_CHECK = pytest.StashKey["HostCheck"]()


@pytest.hookimpl(tryfirst=True)  # before xdist starts its workers: they are then in its cgroup
def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        check = HostCheck()
        check.start()
        session.config.stash[HOST_CHECK] = check


@pytest.hookimpl(trylast=True)  # after xdist has stopped its workers
def pytest_sessionfinish(session: pytest.Session) -> None:
    check = session.config.stash.get(HOST_CHECK, None)
    if check is not None:
        check.finish()
        if check.left and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    check = config.stash.get(HOST_CHECK, None)
    if check is None:
        return
    for line in check.notes:
        terminalreporter.write_line(f"host check: {line}", yellow=True)
    if check.left:
        terminalreporter.section("left on the host by the tests (the run fails)", sep="!", red=True)
        for line in check.left:
            terminalreporter.write_line(line, red=True)
