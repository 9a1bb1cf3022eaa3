from fakemachine import fakenvml_lib, machine  # noqa: F401
from corefix import installed  # noqa: F401
from adminfix import admin, shared_tmp  # noqa: F401
from installfix import wheelhouse  # noqa: F401
from userfix import admin_root, mu, mu_world  # noqa: F401
