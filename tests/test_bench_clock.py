"""The benchmark's hand-over clock (bench/watch.py): the kernel's process events.

A hand-over is clocked as issue 30 defines it, from the release's exit to the waiter's
exec, with the kernel's own times for both (the proc connector). The parser is held to the
layout of linux/cn_proc.h; the clock, as root (as CI runs), to a real child's exec and exit.
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import watch  # noqa: E402
from stats import Job, crowding, dispatch_latencies, dispatch_pairs  # noqa: E402


def _datagram(what: int, pid: int, tgid: int, ns: int) -> bytes:
    event = struct.pack("IIQii", what, 0, ns, pid, tgid) + b"\0" * 8  # exit_code, exit_signal...
    cn = struct.pack("IIIIHH", 1, 1, 0, 0, len(event), 0) + event
    size = 16 + len(cn)
    return struct.pack("IHHII", size, 3, 0, 0, 0) + cn + b"\0" * ((4 - size % 4) % 4)


def test_the_parser_reads_execs_and_process_exits_and_leaves_threads_out() -> None:
    data = (_datagram(watch.PROC_EVENT_EXEC, 41, 41, 5_000)
            + _datagram(watch.PROC_EVENT_EXIT, 43, 42, 6_000)  # a thread of 42
            + _datagram(watch.PROC_EVENT_EXIT, 41, 41, 7_000)
            + _datagram(0x1, 44, 44, 8_000))  # a fork: not clocked
    assert watch.proc_events(data) == [(watch.PROC_EVENT_EXEC, 41, 5_000), (watch.PROC_EVENT_EXIT, 41, 7_000)]
    assert watch.proc_events(b"") == [] and watch.proc_events(b"\0" * 16) == []


def test_the_clock_stamps_a_childs_exec_and_exit_with_the_kernels_times() -> None:
    clock = watch.Clock()
    try:
        if os.geteuid() == 0:
            assert clock.kernel, "root was refused the kernel's process events"
        before = time.time()
        child = subprocess.Popen(["sh", "-c", "exec sleep 0.2"])
        clock.add(child.pid)
        child.wait()
        waited = time.time()
        deadline = time.monotonic() + 5
        while child.pid not in clock.exited and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        clock.stop()
    exited = clock.exited[child.pid]
    assert before < exited <= waited + 0.001
    if not clock.kernel:
        assert clock.execs == {}
        return
    execs = clock.execs.get(child.pid, [])
    assert execs, "the exec of sleep was not clocked"
    last = clock.exec_before(child.pid, exited)
    assert last == execs[-1] and before < last < exited
    assert exited - last >= 0.15  # sleep ran 0.2 s between its exec and its exit
    assert clock.exec_before(child.pid, before) is None


def _until_sleeping(pid: int, deadline: float) -> None:
    """Until PID's sh has exec'd sleep, and the clock has had time to read both execs."""
    while os.readlink(f"/proc/{pid}/exe").rsplit("/", 1)[-1] != "sleep":
        assert time.monotonic() < deadline, "sh never exec'd sleep"
        time.sleep(0.005)
    time.sleep(0.1)  # the clock reads the events meanwhile, before the pid is added


def test_events_before_add_are_taken_over_and_an_earlier_process_with_the_pid_is_left_out() -> None:
    # Popen returns after the child's exec, and sh's exec of sleep can come before add():
    # CI once lost it. Here add() comes only once the clock has surely read both execs.
    clock = watch.Clock()
    try:
        if not clock.kernel:
            assert os.geteuid() != 0, "root was refused the kernel's process events"
            return
        spawned = time.time()
        child = subprocess.Popen(["sh", "-c", "exec sleep 0.5"])
        deadline = time.monotonic() + 5
        _until_sleeping(child.pid, deadline)
        clock.add(child.pid, spawned)
        child.wait()
        while child.pid not in clock.exited and time.monotonic() < deadline:
            time.sleep(0.01)
        execs = clock.execs.get(child.pid, [])
        assert len(execs) == 2 and spawned < execs[0] <= execs[1] < clock.exited[child.pid]
        # An earlier process's events with the same pid (before SPAWNED) are not its own.
        other = subprocess.Popen(["sh", "-c", "exec sleep 0.3"])
        _until_sleeping(other.pid, time.monotonic() + 5)
        clock.add(other.pid, time.time())
        other.wait()
        assert clock.execs.get(other.pid, []) == []
    finally:
        clock.stop()


def test_a_hand_over_is_clocked_to_the_exec_where_there_is_one_else_to_the_start_line() -> None:
    first, second, third = Job(0, 0.0), Job(1, 0.0), Job(2, 0.0)
    first.start, first.end, first.exited, first.devices = 10.0, 11.0, 11.010, ["GPU-1"]
    second.start, second.end, second.devices, second.spawned = 11.020, 12.0, ["GPU-1"], 9.0
    second.execed, second.exited = 11.012, 12.005
    third.start, third.end, third.devices, third.spawned = 12.030, 13.0, ["GPU-1"], 9.0
    exec_ms = [round(x * 1e3, 3) for x in dispatch_latencies([first, second, third], at="exec")]
    line_ms = [round(x * 1e3, 3) for x in dispatch_latencies([first, second, third], at="line")]
    assert exec_ms == [2.0, 25.0]  # the second to its exec; the third has none: its start line
    assert line_ms == [10.0, 25.0]


def test_hand_overs_are_told_apart_by_another_release_close_to_their_own() -> None:
    first, second = Job(0, 0.0), Job(1, 0.0)
    first.start, first.end, first.exited, first.devices = 10.0, 11.0, 11.010, ["GPU-1"]
    second.start, second.end, second.exited, second.devices, second.spawned = 11.013, 12.0, 12.5, ["GPU-1"], 9.0
    second.execed = 11.012
    pairs = dispatch_pairs([first, second], at="exec")
    assert [(r, round(x * 1e3, 3)) for r, x in pairs] == [(11.010, 2.0)]
    # Its own release alone within 5 ms: alone; another 4 ms after it, or 4 ms before: crowded.
    assert crowding(pairs, [11.010, 12.5], 0.005) == ([pairs[0][1]], [])
    assert crowding(pairs, [11.010, 11.014], 0.005) == ([], [pairs[0][1]])
    assert crowding(pairs, [11.006, 11.010], 0.005) == ([], [pairs[0][1]])
    assert crowding(pairs, [11.004, 11.010, 11.016], 0.005) == ([pairs[0][1]], [])
