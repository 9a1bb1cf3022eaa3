"""What is allowed: the configuration, the effective policy, the registry of wraps, defaults, limits, what a user sees of others' runs."""
