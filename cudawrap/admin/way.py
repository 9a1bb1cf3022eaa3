"""`cudawrap way service|daemonless`: switch an installed server between its two ways
(docs/admin/ways.md), safely while runs hold leases and runs wait.

Runs holding leases keep them either way: a lease is its flock, which neither the service's
start nor its stop touches; the service, once it runs, counts every lock it finds and
replaces each lease file the first time it finds it free, so a descriptor opened before it
made the directories root's is worth nothing after. Runs waiting keep their turn because the
switch refuses while any wait on the side it leaves, and says so in one line:

* to the service: a daemonless waiter waits in the queue directory, taking its lease itself
  when its turn comes; once the directories are root's it could never take one (it cannot
  open a lease file), and the service cannot hand it one (no connection). So the switch
  refuses while the queue directory holds a live entry. It checks again once the directories
  are root's: an entry that came meanwhile (its run read the old way) undoes the switch.
* to daemonless: a run waiting in the service's line has a connection and a place that the
  queue directory has no word for (the service's tickets are its own); dropped, it would
  queue again behind runs that came after it. So the switch refuses while the service has
  waiters. A run that comes between that look and the service's stop finds the way
  daemonless and the directories open, and queues there (its turn is its arrival then).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable, List, Optional

from .. import locations as loc
from ..errors import RunsWaiting, SetupError
from ..install.runtime import prepare_runtime
from ..install.way import DAEMONLESS, SERVICE, read_way, write_way
from ..paths import Layout

# How long a started service has to answer, and a stopped one to end.
START_WITHIN_S = 30.0
STOP_WITHIN_S = 15.0


def switch(layout: Layout, way: str, say: Callable[[str], None]) -> None:
    """Switch LAYOUT's install to WAY (SERVICE or DAEMONLESS); see the module's docstring."""
    (_to_service if way == SERVICE else _to_daemonless)(layout, say)


def service_pid(layout: Layout) -> Optional[int]:
    from ..base.daemon import running

    return running(loc.under(str(layout.root), loc.SERVICE_LOCK))


def _queued(layout: Layout) -> List[int]:
    """The pids of the live runs waiting in the queue directory (daemonless waiters)."""
    from ..sched.queue import WaitQueue

    return [w.pid for w in WaitQueue(str(layout.queue_dir)).scan(bounded=False).waiters]


def _to_service(layout: Layout, say: Callable[[str], None]) -> None:
    if read_way(layout) == SERVICE and service_pid(layout) is not None:
        say(f"this install runs with the service already (pid {service_pid(layout)})")
        return
    waiting = _queued(layout)
    if waiting:
        raise _busy_daemonless(layout, waiting)
    before = read_way(layout) or DAEMONLESS
    write_way(layout, SERVICE)  # runs deciding from now on ask the service (and wait for its start)
    prepare_runtime(layout, True)  # no user opens a lease file, nor queues, from now on
    waiting = _queued(layout)
    if waiting:  # a run that read the old way queued meanwhile: it keeps waiting as it was
        write_way(layout, before)
        prepare_runtime(layout, False)
        raise _busy_daemonless(layout, waiting)
    _start_service(layout, say)
    say(f"this install runs with the service now, its only arbiter ({layout.way_file}); runs holding "
        f"leases keep them")


def _busy_daemonless(layout: Layout, waiting: List[int]) -> RunsWaiting:
    return RunsWaiting(f"{len(waiting)} run(s) wait in {layout.queue_dir} (pid {', '.join(map(str, waiting[:5]))}"
                f"{', …' if len(waiting) > 5 else ''}): under the service they could never take their turn; "
                f"nothing changed", hint="switch once none waits (`cudawrap status` lists them)")


def _to_daemonless(layout: Layout, say: Callable[[str], None]) -> None:
    pid = service_pid(layout)
    if read_way(layout) == DAEMONLESS and pid is None:
        prepare_runtime(layout, False)
        say("this install runs daemonless already")
        return
    if pid is not None:
        waiting = _service_waiters(layout)
        if waiting:
            raise RunsWaiting(f"{len(waiting)} run(s) wait in the service's line (pid "
                       f"{', '.join(map(str, waiting[:5]))}{', …' if len(waiting) > 5 else ''}): stopping it "
                       f"would send them to the back of the queue; nothing changed",
                       hint="switch once none waits (`cudawrap status` lists them)")
    write_way(layout, DAEMONLESS)
    # Open before the service stops: a run it drops, or one that comes meanwhile, decides
    # for itself at once (the flock still says who holds what; the service's grants are held).
    prepare_runtime(layout, False)
    if pid is not None:
        _stop_service(layout, pid, say)
    restore_confined_nodes(layout, say)
    say(f"this install runs daemonless now ({layout.way_file}): runs decide for themselves; runs holding "
        f"leases keep them")


def restore_confined_nodes(layout: Layout, say: Callable[[str], None]) -> None:
    """[confine]'s device nodes as they were before the service ran: what `nodes = "leased"`
    closed (recorded at the service's start, confine/nodes.py) is put back exactly, since
    runs deciding for themselves need the nodes as the driver made them."""
    import os

    from ..confine.nodes import put_back, state_file

    if os.path.exists(state_file(str(layout.state_dir))):
        put_back(str(layout.state_dir), say)


def _service_waiters(layout: Layout) -> List[int]:
    """The pids of the runs waiting in the service's line (its whole status, as root reads it)."""
    from ..launch import client
    from .. import wire

    reply = client.question(str(layout.root), wire.STATUS, {"whole": "1"})
    if reply is None or "status" not in reply:
        return []  # it went away meanwhile: nobody waits in it
    return [int(w.get("pid") or 0) for w in json.loads(reply["status"]).get("waiting", [])]


def _systemd_unit(layout: Layout) -> bool:
    from ..install.installation import systemd_running
    from ..install.units import SERVICE_UNIT, unit_file

    return systemd_running(layout) and unit_file(layout, SERVICE_UNIT).exists()


def _systemctl(*args: str) -> None:
    done = subprocess.run(["systemctl", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise SetupError(f"systemctl {' '.join(args)} failed: {' '.join(done.stdout.split())[:300]}",
                         hint="see `systemctl status cudawrap`")


def _start_service(layout: Layout, say: Callable[[str], None]) -> None:
    """The service started as this install starts it (its unit, else `serve --daemon`), and
    answering."""
    from ..install.units import SERVICE_UNIT

    root = str(layout.root)
    if service_pid(layout) is None:
        if _systemd_unit(layout):
            _systemctl("enable", "--now", SERVICE_UNIT)
        else:
            # This interpreter, with the module path this command runs with (the install's venv).
            code = (f"import sys; sys.path[:0] = {sys.path!r}; "
                    "from cudawrap.cli import main; main(['cudawrap', 'serve', '--daemon'])")
            done = subprocess.run([sys.executable, "-I", "-c", code], env=dict(os.environ, CUDAWRAP_ROOT=root),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode != 0:
                raise SetupError(f"the service did not start: {' '.join(done.stdout.split())[-300:]}",
                                 hint="the way is recorded: start it yourself (cudawrap serve --daemon)")
            say(done.stdout.strip())
    from ..launch import client

    deadline = time.monotonic() + START_WITHIN_S
    while True:
        sock = client.connect(root)
        if sock is not None:
            sock.close()
            return
        if time.monotonic() > deadline:
            raise SetupError(f"the service does not answer on {client.socket_path(root)} after "
                             f"{START_WITHIN_S:g} s", hint=f"see {loc.under(root, loc.SERVICE_LOG)}")
        time.sleep(0.05)


def _stop_service(layout: Layout, pid: int, say: Callable[[str], None]) -> None:
    """The service (PID) stopped as it was started: its unit disabled, else signalled."""
    from ..base.daemon import stop
    from ..install.units import SERVICE_UNIT

    if _systemd_unit(layout):
        _systemctl("disable", "--now", SERVICE_UNIT)
    else:
        try:
            stop(loc.under(str(layout.root), loc.SERVICE_LOCK), STOP_WITHIN_S)
        except (OSError, TimeoutError) as exc:
            raise SetupError(f"cannot stop the service (pid {pid}): {exc}",
                             hint="the way is recorded: stop it yourself (cudawrap serve --stop)") from None
    say(f"stopped the service (pid {pid})")
