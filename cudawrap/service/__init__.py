"""The service, `cudawrap serve`: the one authority for leases on a machine.

start.py takes its lock, starts the monitor in a child and runs loop.py, the socket's poll
loop, whose Service is made of parts: clients.py (a connection and its request), answering.py
(status, cancel, revoke), granting.py (the decisions and the grants they send), releases.py
(grants ending: the files' news, runs' exits); connection.py is one client, peer.py who it is
(the kernel's word only), slurmjob.py in which Slurm job and with which GPUs; requests.py turns
a request into a waiter under the policy the service reads itself; waitline.py decides for the
service's waiters and the file queue's together (knownlocks.py: the locks without
/proc/locks); grants.py follows each grant (granted.py) from the descriptors sent to the lock
taken and released, renewals.py replaces the files whose descriptors are out there,
adoption.py follows a predecessor's grants again; bookkeeping.py writes them to the ledger,
in the loop's turns (ledgerturn.py); tickets.py and restart.py keep a waiter's place across
a restart; journal.py is its log's lines. Its client is cudawrap/launch/client.py.
"""
