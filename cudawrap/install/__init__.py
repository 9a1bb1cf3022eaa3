"""Installing cudawrap into a root: the shim, runtime directories, the manifest, units (install.sh's Python half)."""
