"""The service, `cudawrap serve`: the one authority for leases on a machine.

start.py takes its lock, starts the monitor in a child and runs loop.py, the socket's poll
loop; connection.py is one client, peer.py who it is (the kernel's word only), slurmjob.py in
which Slurm job and with which GPUs; requests.py turns a request into a waiter under the policy
the service reads itself; waitline.py decides for the service's waiters and the file queue's
together; grants.py follows each grant from the descriptors sent to the lock taken and released,
bookkeeping.py writes them to the ledger; tickets.py and restart.py keep a waiter's place across
a restart. Its client is cudawrap/launch/client.py.
"""
