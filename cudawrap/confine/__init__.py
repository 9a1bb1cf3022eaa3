"""[confine]: the service's runs in cgroups of their own, and the device nodes closed to all but their lessees."""
