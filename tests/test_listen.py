"""The service's socket: a root deep enough that its path passes the kernel's limit for a unix
socket is refused in one line that says what to do (it died with a traceback before), and
one just under the limit binds (the temporary name it binds first is no longer than it)."""
import os
import socket

import pytest

from cudawrap.errors import SetupError
from cudawrap.service.connection import UNIX_PATH_MAX, listen


def deep_dir(base, length: int) -> str:
    """A directory under BASE whose path plus "/cudawrap.sock" is LENGTH bytes."""
    want = length - len("/cudawrap.sock")
    path = str(base)
    while len(path) < want:
        path = os.path.join(path, "d" * min(50, want - len(path) - 1))
    assert len(path) == want, (len(path), want)
    os.makedirs(path, exist_ok=True)
    return path


def test_a_socket_path_over_the_kernels_limit_is_refused_in_one_line(tmp_path):
    path = os.path.join(deep_dir(tmp_path, UNIX_PATH_MAX + 1), "cudawrap.sock")
    with pytest.raises(SetupError) as caught:
        listen(path)
    assert f"over the kernel's {UNIX_PATH_MAX}" in str(caught.value)
    assert "shorter root" in (caught.value.hint or "")
    assert not os.listdir(os.path.dirname(path))  # nothing left behind


def test_a_socket_path_at_the_kernels_limit_listens(tmp_path):
    path = os.path.join(deep_dir(tmp_path, UNIX_PATH_MAX), "cudawrap.sock")
    sock = listen(path)
    try:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(path)
        client.close()
        assert os.listdir(os.path.dirname(path)) == ["cudawrap.sock"]
    finally:
        sock.close()
