"""The ledger: its files, root's looks at the kernel that fill it, the service's writer, the estimates read from it."""
