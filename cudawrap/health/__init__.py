"""Device health: the rule, NVML's events, the keeper and its state file, leftovers of ended runs, idle leases, the report."""
