from support.admin import admin, shared_tmp  # noqa: F401
from support.installed import installed  # noqa: F401
from support.installsh import wheelhouse  # noqa: F401
from support.machine import fakenvml_lib, machine  # noqa: F401
from support.procs import spawned  # noqa: F401
from support.users import mu, mu_world  # noqa: F401


# `make test` runs the suite as two halves side by side (pytest-xdist: -n 2 --dist loadgroup,
# one worker per group). One half is the tests that chain installs, package builds and strace
# sweeps: each is a long line of busy processes, one after another, with nothing to share
# with each other half. The other half is the rest, which mostly waits on its processes. Side
# by side on 2 cores each half ran about as fast as alone (test_install.py 195 s beside 127 s
# of service, scheduling and wrap tests; alone 190 s and 124 s). Those chains must stay in one
# group: the system installs of test_install.py and test_deb.py change the same paths.
CHAINED = frozenset({
    "test_install.py", "test_deb.py", "test_crash.py", "test_bench.py", "test_gpukit.py", "test_dpkg.py",
    "test_client.py",
})


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    if not config.pluginmanager.hasplugin("xdist"):
        return
    import pytest

    for item in items:
        item.add_marker(pytest.mark.xdist_group("chained" if item.path.name in CHAINED else "rest"))
