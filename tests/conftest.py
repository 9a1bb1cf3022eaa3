import pytest

from support.admin import admin, shared_tmp  # noqa: F401
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
