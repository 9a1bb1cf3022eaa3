"""The service's wire format (cudawrap/wire.py): round trips, bounds, and the large answer."""
from __future__ import annotations

import pytest

from cudawrap import wire


def test_a_message_round_trips_with_newlines_and_backslashes() -> None:
    fields = {"text": "line one\nline two \\ end", "count": "2"}
    (got,) = wire.Reader().feed(wire.encode(wire.REQUEST, fields))
    assert got == (wire.REQUEST, fields)


def test_messages_split_anywhere_are_read_whole() -> None:
    data = wire.encode(wire.REQUEST, {"count": "1"}) + wire.encode(wire.HELD, {"devices": "GPU-x"})
    reader = wire.Reader()
    out = []
    for i in range(len(data)):
        out += reader.feed(data[i:i + 1])
    assert [verb for verb, _ in out] == [wire.REQUEST, wire.HELD]


def test_a_request_over_the_bound_is_refused_both_ways() -> None:
    with pytest.raises(ValueError):
        wire.encode(wire.REQUEST, {"visible": "x" * wire.MAX_MESSAGE})
    with pytest.raises(wire.WireError):
        wire.Reader().feed(wire.MAGIC + b"request\nvisible=" + b"x" * (wire.MAX_MESSAGE + 1))


def test_an_answer_may_be_far_larger_than_a_request_and_only_its_reader_takes_it() -> None:
    """status with hundreds of waiters: the answer is hundreds of KiB (before, encoding it
    raised inside the service)."""
    big = {"json": "[" + ",".join(['{"user": "alice", "pid": 12345}'] * 20000) + "]"}
    data = wire.encode(wire.ANSWER, big)
    assert len(data) > 20 * wire.MAX_MESSAGE
    reader = wire.Reader(wire.MAX_ANSWER)
    out = []
    for start in range(0, len(data), wire.MAX_MESSAGE):
        out += reader.feed(data[start:start + wire.MAX_MESSAGE])
    assert out == [(wire.ANSWER, big)]
    with pytest.raises(wire.WireError):
        wire.Reader().feed(data)


def test_a_grants_descriptors_are_described_in_order_and_a_wrong_one_voids_the_grant() -> None:
    share = {"devices": "GPU-a,GPU-b", "fds": "lease:GPU-a:ex,lease:GPU-b:sh,slot:GPU-b:ex"}
    assert wire.described(share) == [("GPU-a", wire.LEASE, True), ("GPU-b", wire.LEASE, False),
                                      ("GPU-b", wire.SLOT, True)]
    assert wire.described({"devices": "GPU-a"}) == [("GPU-a", wire.LEASE, True)]  # an older service's grant
    for fds in ("lease:GPU-c:ex", "lease:GPU-a:rw", "file:GPU-a:ex", "slot:GPU-a:ex", ""):
        assert wire.described({"devices": "GPU-a", "fds": fds}) is None, fds


def test_an_errors_exit_status_is_its_code_when_that_is_one() -> None:
    assert wire.exit_status({"code": "75"}, 70) == 75
    for code in ("", "0", "256", "-1", "7x", "٧"):
        assert wire.exit_status({"code": code}, 70) == 70, code
