"""What is allowed: the configuration, the effective policy, the registry of wraps, defaults, limits."""
