"""Device memory per run: the limits' config, the rule, the read of the machine, the snapshot, the monitor's watch."""
