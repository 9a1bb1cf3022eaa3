"""What the machine has: the device model, NVML (pynvml and the lean ctypes binding), the snapshot, the inventory cache, Slurm's view."""
