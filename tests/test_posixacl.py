"""The POSIX ACL codec (cudawrap/base/posixacl.py) against the kernel: what it encodes the
kernel takes and gives back, and sets the mode bits from."""
from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import pytest

from cudawrap.base import posixacl
from cudawrap.base.posixacl import GROUP_OBJ, MASK, OTHER, RWX, USER, USER_OBJ, Entry


def test_entries_are_written_in_the_kernels_order_after_a_version_2_header() -> None:
    data = posixacl.owner_and_users(RWX, [2001, 1000, 2001])
    assert data[:4] == struct.pack("<I", 2)
    assert [struct.unpack_from("<HHI", data, o) for o in range(4, len(data), 8)] == [
        (USER_OBJ, 7, 0xFFFFFFFF), (USER, 7, 1000), (USER, 7, 2001),
        (GROUP_OBJ, 0, 0xFFFFFFFF), (MASK, 7, 0xFFFFFFFF), (OTHER, 0, 0xFFFFFFFF)]
    assert posixacl.users(data) == [1000, 2001]


def test_no_named_user_is_the_owners_bits_alone_without_a_mask() -> None:
    assert posixacl.decode(posixacl.owner_and_users(RWX, [])) == [
        Entry(USER_OBJ, 7), Entry(GROUP_OBJ, 0), Entry(OTHER, 0)]


@pytest.mark.parametrize("data", [b"", b"\x02\x00\x00", b"\x01\x00\x00\x00", b"\x02\x00\x00\x00\x01\x00",
                                  struct.pack("<IHHI", 2, 0x40, 7, 0)], ids=["empty", "short", "v1", "torn", "tag"])
def test_anything_but_a_version_2_acl_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        posixacl.decode(data)


def test_the_kernel_takes_it_and_sets_the_mode_from_it(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    directory.mkdir(mode=0o755)
    data = posixacl.owner_and_users(RWX, [4242])
    try:
        os.setxattr(directory, posixacl.XATTR, data)
    except OSError as exc:
        pytest.skip(f"no POSIX ACLs under {tmp_path}: {exc.strerror}")
    assert os.getxattr(directory, posixacl.XATTR) == data
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o770  # the group bits show the mask
    os.setxattr(directory, posixacl.XATTR, posixacl.owner_and_users(RWX, []))
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    with pytest.raises(OSError):  # the kernel keeps an ACL that says no more than the mode as the mode
        os.getxattr(directory, posixacl.XATTR)


def test_a_filesystem_without_acls_gets_one_warning_and_its_directory_left_as_it_is(tmp_path: Path) -> None:
    """The service's side (lease/mpsaccess.PipeAccess) where setxattr says EOPNOTSUPP: a ramfs."""
    import subprocess

    from cudawrap.lease.sharing import mps_pipe_dir
    from cudawrap.lease.mpsaccess import PipeAccess
    from cudawrap.paths import Layout

    layout = Layout(tmp_path / "root")
    uuid = "GPU-00000000-0000-0000-0000-000000000001"
    pipe = Path(mps_pipe_dir(str(layout.root), uuid))
    pipe.parent.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "ramfs", "cudawrap-test", str(pipe.parent)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {mounted.stderr.strip()}")
    try:
        pipe.mkdir(mode=0o755)
        pipe.chmod(0o755)
        said: list = []
        access = PipeAccess(layout, said.append)
        access.set(uuid, {4242})
        access.set(uuid, set())
        access.rebuild({uuid: {4242, 4343}})
        assert len(said) == 1 and str(pipe) in said[0] and "no POSIX ACLs" in said[0], said
        assert stat.S_IMODE(os.stat(pipe).st_mode) == 0o755
    finally:
        subprocess.run(["umount", "-l", str(pipe.parent)], check=False)
