"""Running the server: status, cancel, ledger, usage, metrics, monitor, MPS, sync."""
