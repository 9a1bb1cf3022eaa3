from support.admin import admin, shared_tmp  # noqa: F401
from support.installed import installed  # noqa: F401
from support.installsh import wheelhouse  # noqa: F401
from support.machine import fakenvml_lib, machine  # noqa: F401
from support.procs import spawned  # noqa: F401
from support.users import mu, mu_world  # noqa: F401
