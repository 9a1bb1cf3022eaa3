"""Running the server: status, cancel, ledger, usage, metrics, monitor, MPS, sync.

The service, `cudawrap serve`, the one authority for leases on a machine: serve.py runs the
socket; peer.py says who is asking (the kernel's word only), slurmjob.py in which Slurm job
and with which GPUs (its cgroup, then Slurm's word); asks.py turns a request into a
waiter under the policy the service reads itself; line.py decides for the service's waiters
and the file queue's together; grants.py follows each grant from the descriptors sent to the
lock taken and released. Its client is cudawrap/client.py.
"""
