"""The acquisition algorithm on real lease files and a real queue, with NVML data injected."""
import os
import threading
from pathlib import Path

import pytest

from cudawrap.acquire import Acquirer
from cudawrap.devices import Device
from cudawrap.errors import NoDeviceError
from cudawrap.installation import prepare_runtime
from cudawrap.leases import LeaseFiles, sync_lease_files
from cudawrap.paths import Layout
from cudawrap.waitqueue import WaitQueue

UUID = "GPU-00000000-aaaa-bbbb-cccc-000000000001"


@pytest.fixture
def runtime(tmp_path: Path) -> Layout:
    layout = Layout(tmp_path)
    prepare_runtime(layout)
    sync_lease_files(str(layout.lease_dir), [UUID])
    return layout


def test_a_waiter_rereads_what_aged_while_it_slept(runtime: Layout) -> None:
    """The job seen on the device when the waiter queued has ended by its turn: no stale wait."""
    queue = WaitQueue(str(runtime.queue_dir))
    ahead = queue.enqueue(1, "spread", None, 300.0, b"pid=1\n")  # someone queued before us
    seen_busy = Device(UUID, "H100", UUID, 0, None, 80000, 4000, (4242,))
    now_free = Device(UUID, "H100", UUID, 0, None, 80000, 0, ())
    reads = []

    def refresh(device: Device) -> Device:
        reads.append(device.uuid)
        return now_free

    acquirer = Acquirer(LeaseFiles(str(runtime.lease_dir)), queue, [seen_busy], [seen_busy], 1,
                        refresh=refresh)
    leave = threading.Timer(0.1, queue.leave, args=(ahead,))
    leave.start()
    # Well under FOREIGN_RECHECK_S: only an immediate re-read once the line moved grants it.
    lease = acquirer.acquire(0.5, b"pid=2\n")
    leave.join()
    assert lease.uuids == [UUID] and reads == [UUID]
    lease.release()


def test_taking_several_is_all_or_nothing(runtime: Layout) -> None:
    other = "GPU-00000000-aaaa-bbbb-cccc-000000000002"
    sync_lease_files(str(runtime.lease_dir), [UUID, other])
    devices = [Device(u, "H100", u, i, None, 80000, 0, ()) for i, u in enumerate((UUID, other))]
    queue = WaitQueue(str(runtime.queue_dir))
    holder = LeaseFiles(str(runtime.lease_dir))
    assert holder.try_lock(other)
    acquirer = Acquirer(LeaseFiles(str(runtime.lease_dir)), queue, devices, devices, 2)
    with pytest.raises(NoDeviceError, match="1 usable device free, 1 more needed"):
        acquirer.acquire(0, b"pid=2\n")
    # The free one was not kept: someone else can take it now.
    assert LeaseFiles(str(runtime.lease_dir)).try_lock(UUID)
    holder.close()
