"""What the commands run: status (and its table), cancel, usage, sync, MPS, the service's view."""
