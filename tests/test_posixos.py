"""base/posixos.py: the launch's os and os.path on posix alone, held to os's own answers."""
import os
import posixpath

import pytest

from cudawrap.base import posixos

PATHS = ["", "/", "//", "///", "a", "/a", "a/", "/a/", "/a/b", "/a/b/", "/a//b", "a/b", "//a", "./a", "../a/b",
         "/a/b//", "a//", "/a/b/c.d", "é/ü"]


@pytest.mark.parametrize("path", PATHS)
def test_basename_and_dirname_answer_as_os_path_does(path):
    assert posixos.basename(path) == posixpath.basename(path)
    assert posixos.dirname(path) == posixpath.dirname(path)


def test_exists_and_lexists_follow_links_as_os_path_does(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "good").symlink_to("file")
    (tmp_path / "dangling").symlink_to("nothing")
    for name in ("file", "good", "dangling", "absent", "file/below", "nul\0byte"):
        path = str(tmp_path / name)
        assert posixos.exists(path) == os.path.exists(path), name
        assert posixos.lexists(path) == os.path.lexists(path), name


def test_link_dir_is_where_the_last_link_leads(tmp_path):
    (tmp_path / "d1" / "d2").mkdir(parents=True)
    (tmp_path / "d1" / "d2" / "target").write_text("x")
    (tmp_path / "first").symlink_to("d1/hop")  # relative, through a second link
    (tmp_path / "d1" / "hop").symlink_to(tmp_path / "d1" / "d2" / "target")
    assert posixos.link_dir(str(tmp_path / "first")) == str(tmp_path / "d1" / "d2")
    assert os.path.samefile(posixos.link_dir(str(tmp_path / "first")), os.path.dirname(os.path.realpath(tmp_path / "first")))
    assert posixos.link_dir(str(tmp_path / "d1" / "d2" / "target")) == str(tmp_path / "d1" / "d2")  # no link
    assert posixos.link_dir("target") == "."
    (tmp_path / "loop").symlink_to("loop")
    assert posixos.link_dir(str(tmp_path / "loop")) == str(tmp_path)  # gives up as the kernel does, and stops


def test_environ_is_os_environ_and_sees_its_changes(monkeypatch):
    monkeypatch.setenv("CUDAWRAP_POSIXOS_TEST", "é \udcff")  # not UTF-8: surrogateescape, as os decodes it
    assert posixos.environ() == dict(os.environ)
    assert posixos.getenv("CUDAWRAP_POSIXOS_TEST") == "é \udcff"
    monkeypatch.delenv("CUDAWRAP_POSIXOS_TEST")
    assert posixos.getenv("CUDAWRAP_POSIXOS_TEST") is None


def test_same_is_samestat(tmp_path):
    (tmp_path / "a").write_text("x")
    os.link(tmp_path / "a", tmp_path / "b")
    (tmp_path / "c").write_text("x")
    a, b, c = (os.stat(tmp_path / n) for n in "abc")
    assert posixos.same(a, b) and os.path.samestat(a, b)
    assert not posixos.same(a, c) and not os.path.samestat(a, c)
