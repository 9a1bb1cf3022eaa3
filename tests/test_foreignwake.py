"""A waiter kept off a device only by a process cudawrap did not start wakes as it leaves.

The waiter's own timer (waiting.WATCH_S) is set to an hour here, so a run granted within the
test was woken by the process's exit (a pidfd) or by the monitor rewriting its snapshot.
"""
import importlib
import os
import select
import subprocess
import threading
from typing import Callable, Dict, List, Union

import pytest

from cudawrap.sched.request import Request
from cudawrap.sched.run import acquire
from cudawrap.devices import nvml, snapshot
from cudawrap.sched.acquirer import Acquirer
from cudawrap.sched.machine import ViewOptions
from cudawrap.sched.decision import Decision
from cudawrap.sched.foreignwake import ForeignWake
from cudawrap.devices.model import Device
from cudawrap.lease.files import Lease, LeaseFiles
from cudawrap.monitor.loop import refresh_once
from cudawrap.sched.queue import WaitQueue
from support.installed import ready_line
from support.procs import wait_for
from support.machine import FAKECUDA

# No process here can have this pid (above the largest pid_max): one NVML names from another
# pid namespace, which neither the monitor nor a waiter can see or wait for.
UNSEEN_PID = (1 << 22) + 1


@pytest.fixture(autouse=True)
def no_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.import_module("cudawrap.sched.waiting"), "WATCH_S", 3600.0)


def foreign(inst, uuid: str) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    """An unwrapped CUDA program on UUID, ready (listed by NVML)."""
    proc = inst.spawned([str(FAKECUDA), "--hold", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        env=inst.machine.environ(CUDA_VISIBLE_DEVICES=uuid))
    ready_line(proc)
    return proc


def inotify_watching(directory: str) -> bool:
    """Whether an inotify instance of this process watches DIRECTORY (its fdinfo lists the inode)."""
    ino = f"ino:{os.stat(directory).st_ino:x} "
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify":
                with open(f"/proc/self/fdinfo/{fd}") as f:
                    if ino in f.read():
                        return True
        except OSError:
            pass
    return False


class Waiter:
    """A run waiting for DEVICE (or the first free of a list) in a thread of this process, its
    re-reads of the devices counted."""

    def __init__(self, inst, device: Union[Device, List[Device]], refresh: Callable[[Device], Device], watched: str = "",  # type: ignore[no-untyped-def]
                 on_look: Callable[[], None] = lambda: None) -> None:
        self.reads: List[str] = []
        self.queue = WaitQueue(str(inst.layout.queue_dir))
        self.outcome: Dict[str, object] = {}

        def counted(d: Device) -> Device:
            self.reads.append(d.uuid)
            return refresh(d)

        self.looks: List[object] = []

        def looked(decision: Decision) -> None:
            if decision.cause == decision.LOOK:
                on_look()  # in the waiter's thread, between its look and what it follows
                self.looks.append(decision)

        devices = device if isinstance(device, list) else [device]
        self.acquirer = Acquirer(LeaseFiles(str(inst.layout.lease_dir)), self.queue, devices, devices, Request(1),
                                 ViewOptions(refresh=counted), snapshot=watched or None,
                                 observe=looked)
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        # It waits, and has looked from its place in line: it follows the foreign processes
        # (and the snapshot) right after, so what changes from here on is what it wakes on.
        wait_for(lambda: self.looks, 10, "the waiter's first look")
        if watched:  # a rewrite between its look and its watch would wake it only at its timer
            wait_for(lambda: inotify_watching(os.path.dirname(watched)), 10, "the waiter's watch on the snapshot")

    def _run(self) -> None:
        try:
            self.outcome["lease"] = acquire(self.acquirer, 60, b"pid=0\n")
        except Exception as exc:  # the test says what went wrong
            self.outcome["error"] = exc

    def granted(self) -> Lease:
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "still waiting: nothing woke it"
        assert "lease" in self.outcome, self.outcome
        return self.outcome["lease"]  # type: ignore[return-value]


def test_a_waiter_wakes_as_the_foreign_process_exits(installed) -> None:  # type: ignore[no-untyped-def]
    """No monitor: the waiter follows the process's exit through a pidfd, then asks NVML."""
    inst = installed("four-gpus")
    gpus = inst.machine.leaf_uuids()
    job = foreign(inst, gpus[0])
    device = nvml.inventory().by_uuid(gpus[0])
    assert device.pids == (job.pid,)
    waiter = Waiter(inst, device, nvml.refresh)
    job.kill()
    job.wait()
    lease = waiter.granted()
    assert lease.uuids == [gpus[0]]
    lease.release()


@pytest.mark.parametrize("others", [0, 1], ids=["re-read-free", "no-pidfd"])
def test_a_process_gone_between_the_look_and_its_pidfd_wakes_the_waiter(installed, others: int) -> None:  # type: ignore[no-untyped-def]
    """The process exits after the waiter's look named it and before the waiter opens its
    pidfd, so no pidfd will ever wake it (CI saw this race leave a waiter asleep until its
    timer). Alone, the waiter's warm-up re-reads its device and finds it free since the look;
    behind another busy device (warmed instead), the pidfd it cannot open is the wake."""
    inst = installed("four-gpus")
    gpus = inst.machine.leaf_uuids()
    stays = [foreign(inst, gpu) for gpu in gpus[1:1 + others]]
    job = foreign(inst, gpus[0])
    devices = [nvml.inventory().by_uuid(gpu) for gpu in gpus[1:1 + others] + gpus[:1]]
    assert devices[-1].pids == (job.pid,)

    def exit_now() -> None:
        if job.poll() is None:
            job.kill()
            job.wait()

    lease = Waiter(inst, devices, nvml.refresh, on_look=exit_now).granted()
    assert lease.uuids == [gpus[0]]
    lease.release()
    for proc in stays:
        proc.kill()
        proc.wait()


def test_a_pid_gone_before_it_is_followed_is_one_wake_and_never_followed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An exited pid (or one from another pid namespace: the same ESRCH) wakes once, and is
    not tried again: an unseen process costs one re-read, not one per look."""
    child = subprocess.Popen(["true"])
    child.wait()
    alive = subprocess.Popen(["sleep", "30"])
    try:
        wake = ForeignWake(select.poll(), None)
        assert wake.follow([child.pid, alive.pid]) is True
        assert set(wake.pidfds) == {alive.pid}
        assert wake.follow([child.pid, alive.pid]) is False
        assert wake.follow([alive.pid]) is False
        wake.close()
    finally:
        alive.kill()
        alive.wait()


def test_a_waiter_wakes_as_the_snapshot_drops_an_unseen_process_and_not_before(installed) -> None:  # type: ignore[no-untyped-def]
    """With the monitor: a process in another pid namespace has no pidfd; the snapshot's
    rewrite wakes the waiter, which waits on while the process is listed."""
    inst = installed("four-gpus")
    gpus = inst.machine.leaf_uuids()
    root = str(inst.layout.root)
    inst.machine.add_process(UNSEEN_PID, gpus[1], 2048)
    refresh_once(inst.layout)
    device = snapshot.read_fresh(root).by_uuid(gpus[1])
    assert device.pids == (UNSEEN_PID,)
    waiter = Waiter(inst, device, snapshot.SnapshotRefresh(root), str(inst.layout.usage_snapshot))
    before = len(waiter.reads)
    refresh_once(inst.layout)  # rewritten, the unseen process still listed: it still counts
    wait_for(lambda: len(waiter.reads) > before)
    waiter.thread.join(timeout=0.3)
    assert waiter.thread.is_alive() and LeaseFiles(str(inst.layout.lease_dir)).free_now(gpus[1])
    inst.machine.remove_process(UNSEEN_PID)
    refresh_once(inst.layout)
    lease = waiter.granted()
    assert lease.uuids == [gpus[1]]
    lease.release()
