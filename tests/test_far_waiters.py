"""Hundreds of waiters: only those near the head hold an inotify instance; the rest still run.

Linux gives a user 128 inotify instances by default; a batch of one user's runs must leave
them to the runs at the head of the line (which would otherwise poll), and the runs further
back must still be served in turn once they move up.
"""
import os
import time

from corefix import ready_line, wait_for

from cudawrap.acquire import NEAR


def inotify_holders(pids):  # type: ignore[no-untyped-def]
    """Those of PIDS that have an inotify instance open now."""
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify":
                    found.add(pid)
                    break
            except OSError:
                pass
    return found


def test_far_waiters_give_their_inotify_instance_back_and_are_still_served(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    d0 = inst.machine.leaf_uuids()[0]
    inst.write_config('[devices]\nallow = ["%s"]\n' % d0)
    holder = inst.start("recon", "--hold", "600")
    waiters = []
    try:
        ready_line(holder)
        n = NEAR + 12
        waiters += [inst.start("recon", "--hold", "0", "--log", str(inst.log)) for _ in range(n)]

        def entries():  # type: ignore[no-untyped-def]
            return sorted(name for name in os.listdir(inst.layout.queue_dir) if name.endswith(".wait"))

        wait_for(lambda: len(entries()) == n, timeout=60)
        arrival = [int(name.split(".")[1]) for name in entries()]
        time.sleep(1.5)  # every waiter has made its first decision and settled
        watching = inotify_holders([p.pid for p in waiters])
        assert NEAR - 4 <= len(watching) <= NEAR, len(watching)
        holder.kill()
        holder.wait()
        assert [p.wait(timeout=120) for p in waiters] == [0] * n
        starts = [j["pid"] for j in inst.jobs() if j["event"] == "start"]
        assert starts == arrival  # one user: served in arrival order, the far ones too
    finally:
        for p in [holder] + waiters:
            if p.poll() is None:
                p.kill()
            p.wait()
