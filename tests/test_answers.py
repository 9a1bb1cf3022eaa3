"""service/answers.py with a real account's connections: an answer goes out as its client reads
it, never waited on, and what one user may leave unread is bounded (root's is not)."""
from __future__ import annotations

import os
import select
import socket
import time
from pathlib import Path

from cudawrap.service import peer
from cudawrap.service.answers import MAX_UNSENT, Answers
from cudawrap.service.connection import ANSWER_S, Client
from support.procs import root_only

pytestmark = [root_only]

# Connects N times to the socket, says so, then reads nothing until told to (a line on its
# stdin), then everything, printing how many bytes each connection brought.
READER = r"""
import socket, sys
socks = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    socks.append(s)
print("connected", flush=True)
sys.stdin.readline()
for s in socks:
    s.settimeout(10)
    n = 0
    while True:
        data = s.recv(1 << 20)
        if not data:
            break
        n += len(data)
    print(n, flush=True)
"""


def _clients(mu_world, tmp_dir: Path, n: int, user=None):  # type: ignore[no-untyped-def]
    """N connections from a process of USER's (alice's by default), as the service accepts
    them; and the process."""
    import subprocess

    path = str(tmp_dir / f"answers-{n}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o666)
    listener.listen(n)
    user = user or mu_world.alice
    proc = subprocess.Popen(user.argv([mu_world.python, "-I", "-c", READER, path, str(n)]),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"connected\n"
    clients = []
    for _ in range(n):
        sock, _addr = listener.accept()
        sock.setblocking(False)
        who = peer.identify(sock)
        assert who is not None and who.uid == user.uid
        clients.append(Client(sock, who))
    listener.close()
    return proc, clients


def _directory(mu_world) -> Path:  # type: ignore[no-untyped-def]
    directory = Path(mu_world.base) / f"answers-{os.getpid()}-{time.monotonic_ns()}"
    directory.mkdir()
    directory.chmod(0o755)
    return directory


def test_users_asking_questions_take_turns(mu_world) -> None:
    """Alice asks on three connections, then bob on one: bob's is answered second, not last."""
    directory = _directory(mu_world)
    alices, mine = _clients(mu_world, directory, 3)
    bobs, (his,) = _clients(mu_world, directory, 1, mu_world.bob)
    try:
        answers = Answers()
        for client in mine + [his]:
            answers.ask(client, "status", {})
        answers.forget(mine[2])  # gone before its turn: skipped
        assert [answers.next() for _ in range(4)] == [mine[0], his, mine[1], None]
    finally:
        for proc in (alices, bobs):
            proc.kill()
            proc.wait()
        for c in mine + [his]:
            c.sock.close()
            c.peer.close()


def test_an_answer_is_sent_as_its_client_reads_and_one_users_unread_answers_are_bounded(mu_world) -> None:
    directory = _directory(mu_world)
    proc, (first, second, third) = _clients(mu_world, directory, 3)
    try:
        answers = Answers()
        big = b"x" * (MAX_UNSENT * 3 // 4)
        started = time.monotonic()
        assert answers.over(first.peer.uid, len(big)) is None  # nothing unread yet: any answer fits
        assert answers.send(first, big) is False  # the socket took what it could; nothing waited
        assert time.monotonic() - started < 0.5
        left = answers.unsent[first.peer.uid]
        assert 0 < left == len(first.unsent) < len(big)
        # The next answer of that size would pass the bound: refused, before it is worked out.
        refusal = answers.over(second.peer.uid)
        assert refusal is not None and "unread" in refusal and str(left) in refusal
        assert answers.over(second.peer.uid, MAX_UNSENT - left) is None  # one that fits is not
        assert answers.over(0) is None  # root's are not bounded
        # An answer nobody reads goes stale after ANSWER_S, and forgetting it frees its bytes.
        assert answers.stale(first.stalled_at + ANSWER_S - 0.01) == []
        assert answers.stale(first.stalled_at + ANSWER_S) == [first]
        assert answers.send(second, b"y" * 1000) is True  # small: taken whole at once
        assert answers.send(third, big) is False
        answers.forget(third)
        assert answers.unsent[first.peer.uid] == left
        third.sock.close()
        # Read now: the rest goes out as the socket becomes writable, to the last byte.
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 20
        while answers.sent(first) is False:
            assert time.monotonic() < deadline, "the answer did not go out"
            select.select([], [first.sock], [], 1.0)
        assert first.peer.uid not in answers.unsent and answers.sending == {}
        first.sock.close()
        second.sock.close()
        got = [int(n) for n in proc.stdout.read().split()]
        assert got[:2] == [len(big), 1000] and got[2] < len(big)  # the third: only what was sent before
    finally:
        proc.kill()
        proc.wait()
        for c in (first, second, third):
            c.sock.close()
            c.peer.close()
