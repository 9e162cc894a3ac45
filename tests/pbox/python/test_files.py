"""File operations (blocking API): round trips with checksums, offsets, directory operations,
errors."""

from __future__ import annotations

import hashlib
import io
import os

import pytest

import pbox


@pytest.mark.parametrize("size", [0, 1, 256 * 1024, 1 << 20, 50 << 20])
def test_write_read_round_trip(sandbox: pbox.Sandbox, size: int) -> None:
    data = os.urandom(size)
    info = sandbox.write_file(f"/tmp/rt/{size}.bin", data, mode=0o600)
    assert info.size == size and info.mode == 0o600 and info.is_file
    back = sandbox.read_file(f"/tmp/rt/{size}.bin")
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
    r = sandbox.run(["sha256sum", f"/tmp/rt/{size}.bin"])
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    sandbox.remove(f"/tmp/rt/{size}.bin")


def test_upload_download_files(sandbox: pbox.Sandbox, tmp_path) -> None:
    src = tmp_path / "in.bin"
    data = os.urandom(3 * 1024 * 1024 + 17)
    src.write_bytes(data)
    os.chmod(src, 0o640)
    info = sandbox.upload(src, "/tmp/up/in.bin")
    assert info.size == len(data) and info.mode == 0o640
    dst = tmp_path / "out.bin"
    assert sandbox.download("/tmp/up/in.bin", dst) == len(data)
    assert dst.read_bytes() == data
    with pytest.raises(pbox.NotFound):
        sandbox.download("/tmp/up/missing", tmp_path / "missing")
    assert not (tmp_path / "missing").exists()
    assert not (tmp_path / "missing.pbox-part").exists()


def test_write_from_file_object_and_append(sandbox: pbox.Sandbox) -> None:
    sandbox.write_file("/tmp/fo", io.BytesIO(b"abc" * 100000))
    sandbox.write_file("/tmp/fo", b"END", append=True)
    got = sandbox.read_file("/tmp/fo")
    assert got == b"abc" * 100000 + b"END"
    sandbox.write_file("/tmp/text", "unicodé")
    assert sandbox.read_text("/tmp/text") == "unicodé"


def test_offsets_and_lengths(sandbox: pbox.Sandbox) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    sandbox.write_file("/tmp/off", data)
    assert sandbox.read_file("/tmp/off", offset=1000, length=10) == data[1000:1010]
    assert sandbox.read_file("/tmp/off", offset=len(data) - 5) == data[-5:]
    assert sandbox.read_file("/tmp/off", offset=300000, length=600000) == data[300000:900000]
    assert sandbox.read_file("/tmp/off", offset=len(data) + 10) == b""
    with pytest.raises(ValueError):
        sandbox.read_file("/tmp/off", offset=-1)


def test_directory_operations(sandbox: pbox.Sandbox) -> None:
    d = sandbox.mkdir("/tmp/tree/a/b")
    assert d.is_dir and d.path == "/tmp/tree/a/b"
    sandbox.write_file("/tmp/tree/a/f1", b"1")
    sandbox.write_file("/tmp/tree/a/f2", b"22")
    sandbox.run("ln -s f1 /tmp/tree/a/link").check()
    entries = sandbox.listdir("/tmp/tree/a")
    assert [e.path for e in entries] == ["b", "f1", "f2", "link"]
    by_name = {e.path: e for e in entries}
    assert by_name["b"].is_dir
    assert by_name["f2"].size == 2
    assert by_name["link"].is_symlink and by_name["link"].symlink_target == "f1"
    st = sandbox.stat("/tmp/tree/a/f2")
    assert st.size == 2 and st.is_file and st.mtime_unix_ns > 0
    assert sandbox.exists("/tmp/tree/a/f1") and not sandbox.exists("/tmp/tree/nope")
    moved = sandbox.move("/tmp/tree/a/f1", "/tmp/tree/moved")
    assert moved.path == "/tmp/tree/moved" and moved.size == 1
    assert not sandbox.exists("/tmp/tree/a/f1")
    with pytest.raises(pbox.AlreadyExists):
        sandbox.move("/tmp/tree/a/f2", "/tmp/tree/moved", no_replace=True)
    sandbox.move("/tmp/tree/a/f2", "/tmp/tree/moved")
    assert sandbox.read_file("/tmp/tree/moved") == b"22"
    with pytest.raises(pbox.PboxError):
        sandbox.remove("/tmp/tree/a")  # not empty
    assert sandbox.exists("/tmp/tree/a/b")
    sandbox.remove("/tmp/tree/a", recursive=True)
    assert not sandbox.exists("/tmp/tree/a")
    with pytest.raises(pbox.PboxError):
        sandbox.mkdir("/tmp/tree/x/y", parents=False)


def test_missing_paths_are_not_found(sandbox: pbox.Sandbox) -> None:
    for call in (
        lambda: sandbox.read_file("/tmp/missing"),
        lambda: sandbox.stat("/tmp/missing"),
        lambda: sandbox.listdir("/tmp/missing"),
        lambda: sandbox.remove("/tmp/missing"),
        lambda: sandbox.move("/tmp/missing", "/tmp/other"),
        lambda: sandbox.write_file("/tmp/missing-dir/f", b"x", make_parents=False),
    ):
        with pytest.raises(pbox.NotFound) as e:
            call()
        assert "missing" in str(e.value)


def test_bad_modes_and_readonly_image(sandbox: pbox.Sandbox) -> None:
    with pytest.raises(ValueError, match="mode"):
        sandbox.write_file("/tmp/m", b"", mode=0o10000)
    with pytest.raises(ValueError, match="mode"):
        sandbox.mkdir("/tmp/m", mode=-1)
    with pytest.raises(pbox.PboxError):
        sandbox.write_file("/usr/bin/pbox-should-not-exist", b"x")
    assert not os.path.exists("/usr/bin/pbox-should-not-exist")
    with pytest.raises(pbox.PboxError):
        sandbox.write_file("/proc/self/attr/current", b"x")
