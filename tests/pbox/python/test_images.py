"""Images: import of root filesystem tarballs, docker/podman save archives and OCI image layouts
(archives and directories, nested indexes, --ref), the merged view
of layers inside sandboxes, hostile archives, removal, prune, persistence across restarts.

The test image is busybox (Debian's busybox-static) in a tarball built here with tarfile.
"""

from __future__ import annotations

import fcntl
import gzip
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

import pbox
from conftest import Agent, AgentFactory, _require_root, _find_pboxd

BUSYBOX = "/bin/busybox"
REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(not os.path.exists(BUSYBOX),
                                reason="needs busybox-static (/bin/busybox)")


# ---- building archives ----

def _info(name: str, type_=tarfile.REGTYPE, size: int = 0, mode: int = 0o644,
          linkname: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = type_
    ti.size = size
    ti.mode = mode
    ti.linkname = linkname
    ti.mtime = 1_700_000_000
    return ti


class Layer:
    """A tar built in memory, entry by entry (no normalization: hostile names stay as given)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.GNU_FORMAT)

    def dir(self, name: str, mode: int = 0o755) -> "Layer":
        self.tar.addfile(_info(name, tarfile.DIRTYPE, mode=mode))
        return self

    def file(self, name: str, data: bytes, mode: int = 0o644) -> "Layer":
        self.tar.addfile(_info(name, size=len(data), mode=mode), io.BytesIO(data))
        return self

    def symlink(self, name: str, target: str) -> "Layer":
        self.tar.addfile(_info(name, tarfile.SYMTYPE, mode=0o777, linkname=target))
        return self

    def hardlink(self, name: str, target: str) -> "Layer":
        self.tar.addfile(_info(name, tarfile.LNKTYPE, linkname=target))
        return self

    def device(self, name: str, type_=tarfile.CHRTYPE) -> "Layer":
        ti = _info(name, type_, mode=0o666)
        ti.devmajor, ti.devminor = 1, 3
        self.tar.addfile(ti)
        return self

    def busybox(self) -> "Layer":
        for d in ("bin", "etc", "tmp"):
            self.dir(d)
        with open(BUSYBOX, "rb") as f:
            self.file("bin/busybox", f.read(), 0o755)
        self.symlink("bin/sh", "busybox")
        return self

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buf.getvalue()


def docker_archive(layers: List[bytes], legacy_links: bool = False) -> bytes:
    """A `docker save`-shaped archive: blobs/sha256/<digest> layers, manifest.json naming them
    bottom first (through legacy "<id>/layer.tar" symlinks if asked)."""
    import hashlib

    out = Layer()
    out.dir("blobs").dir("blobs/sha256")
    names = []
    for i, data in enumerate(layers):
        digest = hashlib.sha256(data).hexdigest()
        out.file(f"blobs/sha256/{digest}", data)
        if legacy_links:
            out.dir(f"legacy{i}")
            out.symlink(f"legacy{i}/layer.tar", f"../blobs/sha256/{digest}")
            names.append(f"legacy{i}/layer.tar")
        else:
            names.append(f"blobs/sha256/{digest}")
    manifest = [{"Config": "blobs/sha256/0", "RepoTags": ["test:latest"], "Layers": names}]
    out.file("manifest.json", json.dumps(manifest).encode())
    return out.bytes()


def write(tmp: Path, name: str, data: bytes) -> Path:
    p = tmp / name
    p.write_bytes(data)
    return p


def zstd(path: Path) -> Path:
    out = path.with_suffix(path.suffix + ".zst")
    subprocess.run(["zstd", "-q", "-f", "-o", str(out), str(path)], check=True)
    return out


def run(sb: pbox.Sandbox, *argv: str) -> pbox.RunResult:
    return sb.run([BUSYBOX, *argv], timeout=30)


def store_layers(agent: Agent) -> List[str]:
    d = agent.state_dir / "images" / "store" / "layers"
    return sorted(os.listdir(d)) if d.exists() else []


def scratch_entries(agent: Agent) -> List[str]:
    d = agent.state_dir / "images" / "store" / "tmp"
    return sorted(os.listdir(d)) if d.exists() else []


# ---- fixtures ----

@pytest.fixture(scope="module")
def img_agent() -> Iterator[Agent]:
    _require_root()
    binary = _find_pboxd()
    if binary is None:
        pytest.skip("pboxd binary not found")
    factory = AgentFactory(binary)
    a = factory(extra=["--max-image-bytes", "64M"])
    yield a
    assert a.alive(), a.log()
    factory.cleanup()


@pytest.fixture
def ic(img_agent: Agent) -> Iterator[pbox.Client]:
    c = img_agent.client()
    yield c
    c.close()


# ---- tests ----

@pytest.mark.parametrize("compression", ["plain", "gzip", "zstd"])
def test_import_rootfs_tarball(ic: pbox.Client, img_agent: Agent, tmp_path: Path,
                               compression: str) -> None:
    marker = f"rootfs {compression} {time.time_ns()}\n".encode()
    tar = Layer().busybox().file("etc/marker", marker).bytes()
    path = write(tmp_path, "rootfs.tar", tar)
    if compression == "gzip":
        path = write(tmp_path, "rootfs.tar.gz", gzip.compress(tar))
    elif compression == "zstd":
        path = zstd(path)
    name = f"bb-{compression}"
    info = ic.import_image(name, path)
    assert (info.name, info.kind, info.format, len(info.layers)) == (name, "imported", "rootfs", 1)
    assert info.bytes >= os.path.getsize(BUSYBOX)
    listed = {i.name: i for i in ic.list_images()}
    assert listed[name].layers == info.layers and "host" in listed
    assert name in ic.info().images
    sb = ic.create(image=name, memory="128M", disk="64M")
    try:
        r = run(sb, "cat", "/etc/marker")
        assert r.ok and r.stdout == marker, r
        # The host's files are not there: the root is the image.
        assert not run(sb, "test", "-e", "/usr/bin/python3").ok
        assert sb.refresh().spec.image == name
    finally:
        sb.destroy()


def test_same_layer_unpacked_once(ic: pbox.Client, img_agent: Agent, tmp_path: Path) -> None:
    path = write(tmp_path, "r.tar", Layer().busybox().file("etc/once", b"1").bytes())
    a = ic.import_image("once-a", path)
    before = store_layers(img_agent)
    b = ic.import_image("once-b", path)
    assert a.layers == b.layers
    assert store_layers(img_agent) == before
    layer_root = img_agent.state_dir / "images/store/layers" / a.layers[0] / "root"
    assert (layer_root / "etc/once").read_bytes() == b"1"


def test_docker_archive_layers_merge(ic: pbox.Client, tmp_path: Path) -> None:
    base = (Layer().busybox()
            .file("etc/a", b"one\n").file("etc/b", b"bee\n")
            .dir("data").dir("data/old").file("data/old/x", b"x").file("data/keep", b"k")
            .dir("gone").file("gone/y", b"y")
            .bytes())
    top = (Layer()
           .file("etc/a", b"two\n")              # overwritten
           .file("etc/.wh.b", b"")               # deleted
           .dir("data").file("data/.wh..wh..opq", b"").file("data/new", b"n")  # opaque
           .file(".wh.gone", b"")                # a whole directory deleted
           .bytes())
    for legacy in (False, True):
        path = write(tmp_path, f"save-{legacy}.tar", docker_archive([base, top], legacy))
        name = f"layered-{int(legacy)}"
        info = ic.import_image(name, path)
        assert info.format == "docker-archive" and len(info.layers) == 2
        sb = ic.create(image=name, memory="128M", disk="64M")
        try:
            assert run(sb, "cat", "/etc/a").stdout == b"two\n"
            assert not run(sb, "test", "-e", "/etc/b").ok
            assert run(sb, "ls", "/data").stdout.split() == [b"new"]
            assert not run(sb, "test", "-e", "/gone").ok
            assert run(sb, "sh", "-c", "echo mine > /etc/a && cat /etc/a").stdout == b"mine\n"
        finally:
            sb.destroy()
        # A sandbox's writes never reach the shared layers.
        sb = ic.create(image=name, memory="128M", disk="64M")
        try:
            assert run(sb, "cat", "/etc/a").stdout == b"two\n"
        finally:
            sb.destroy()


def _hostile_cases(outside: Path) -> Dict[str, Tuple[bytes, str]]:
    """name -> (archive, a piece of the expected error message)."""
    t = str(outside)
    return {
        "absolute": (Layer().busybox().file(f"{t}/abs", b"x").bytes(), "absolute path"),
        "dotdot": (Layer().busybox().file("../../../../../../../" + t + "/dd", b"x").bytes(),
                   '".." component'),
        "inner-dotdot": (Layer().busybox().dir("a").file("a/../../x", b"x").bytes(),
                         '".." component'),
        "write-through-symlink": (Layer().busybox().symlink("evil", t)
                                  .file("evil/through", b"x").bytes(), "symlink"),
        "symlink-dir-then-dir": (Layer().busybox().symlink("sub", t).dir("sub/d").bytes(),
                                 "symlink"),
        "relative-symlink-out": (Layer().busybox().symlink("etc/up", "../../../..").bytes(),
                                 "points out of the layer"),
        "hardlink-absolute": (Layer().busybox().hardlink("pw", "/etc/passwd").bytes(),
                              "absolute path"),
        "hardlink-dotdot": (Layer().busybox().hardlink("pw", "../../etc/passwd").bytes(),
                            '".." component'),
        "hardlink-missing": (Layer().busybox().hardlink("pw", "etc/passwd").bytes(),
                             "not an earlier entry"),
        "hardlink-through-symlink": (Layer().busybox().symlink("e", "/etc")
                                     .hardlink("pw", "e/passwd").bytes(), "symlink"),
        "char-device": (Layer().busybox().device("dev-null").bytes(), "device nodes"),
        "block-device": (Layer().busybox().device("sda", tarfile.BLKTYPE).bytes(),
                         "device nodes"),
        "not-a-tar": (b"this is not an archive at all\n" * 40, "not a tar archive"),
        "manifest-escapes": (
            Layer().file("manifest.json", json.dumps([{"Layers": ["../x.tar"]}]).encode())
            .bytes(), "leaves the archive"),
        "manifest-missing-layer": (
            Layer().file("manifest.json", json.dumps([{"Layers": ["nope.tar"]}]).encode())
            .bytes(), "does not hold"),
    }


def test_hostile_archives_rejected_and_leave_nothing(ic: pbox.Client, img_agent: Agent,
                                                     tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    before_layers = store_layers(img_agent)
    before_images = {i.name for i in ic.list_images()}
    for case, (data, why) in _hostile_cases(outside).items():
        path = write(tmp_path, f"{case}.tar", data)
        with pytest.raises(pbox.InvalidArgument) as exc:
            ic.import_image(f"hostile-{case}", path)
        assert why in exc.value.message, (case, exc.value.message)
        assert store_layers(img_agent) == before_layers, case
        assert scratch_entries(img_agent) == [], case
        assert os.listdir(outside) == [], case
    # A hostile layer inside an otherwise fine image archive: named, and nothing kept (not
    # even the good layer unpacked before it).
    good = Layer().busybox().file("etc/good", b"g").bytes()
    bad = Layer().file("/etc/evil", b"x").bytes()
    path = write(tmp_path, "mixed.tar", docker_archive([good, bad]))
    with pytest.raises(pbox.InvalidArgument) as exc:
        ic.import_image("hostile-mixed", path)
    assert "/etc/evil" in exc.value.message and "layer 2 of 2" in exc.value.message
    assert {i.name for i in ic.list_images()} == before_images
    # The good layer may stay (content-addressed, referenced by nothing): prune takes it.
    ic.prune_images()
    assert scratch_entries(img_agent) == []
    with pytest.raises(pbox.InvalidArgument):
        ic.import_image("Bad/Name", write(tmp_path, "ok.tar", good))


def test_entry_replacing_a_symlink_does_not_write_through_it(ic: pbox.Client,
                                                              tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    # tar semantics: a later entry replaces an earlier one of the same name, the link itself.
    layer = (Layer().busybox().symlink("etc/f", str(outside / "target"))
             .file("etc/f", b"inside").hardlink("etc/g", "etc/f").bytes())
    ic.import_image("replace-link", write(tmp_path, "r.tar", layer))
    assert os.listdir(outside) == []
    sb = ic.create(image="replace-link", memory="128M", disk="64M")
    try:
        assert run(sb, "cat", "/etc/f", "/etc/g").stdout == b"insideinside"
        assert not run(sb, "test", "-L", "/etc/f").ok
    finally:
        sb.destroy()
    ic.remove_image("replace-link")


def test_concurrent_imports_and_prunes(ic: pbox.Client, img_agent: Agent,
                                       tmp_path: Path) -> None:
    import threading

    shared = Layer().busybox().file("etc/shared", b"s").bytes()
    paths = [write(tmp_path, f"c{i}.tar", docker_archive(
        [shared, Layer().file("etc/own", str(i).encode()).bytes()])) for i in range(4)]
    errors: List[BaseException] = []
    stop = threading.Event()

    def importer(i: int) -> None:
        try:
            ic.import_image(f"conc-{i}", paths[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def pruner() -> None:
        while not stop.is_set():
            try:
                ic.prune_images()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    threads = [threading.Thread(target=importer, args=(i,)) for i in range(4)]
    p = threading.Thread(target=pruner)
    p.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    p.join(120)
    assert errors == []
    infos = {i.name: i for i in ic.list_images()}
    assert len({infos[f"conc-{i}"].layers[0] for i in range(4)}) == 1  # one shared base layer
    ic.prune_images()  # nothing of a listed image goes
    for i in range(4):
        sb = ic.create(image=f"conc-{i}", memory="128M", disk="64M")
        try:
            assert run(sb, "cat", "/etc/shared", "/etc/own").stdout == b"s" + str(i).encode()
        finally:
            sb.destroy()
        ic.remove_image(f"conc-{i}")
    assert scratch_entries(img_agent) == []
    assert not [d for d in store_layers(img_agent) if d.startswith(".tmp-")]


def test_size_limit(make_agent: AgentFactory, tmp_path: Path) -> None:
    agent = make_agent(extra=["--max-image-bytes", "4M"])
    c = agent.client()
    # Unpacked size over the limit, archive under it (zeros compress well).
    big = Layer().busybox().file("big", b"\0" * (8 << 20)).bytes()
    with pytest.raises(pbox.ResourceExhausted) as exc:
        c.import_image("big", write(tmp_path, "big.tar.gz", gzip.compress(big)))
    assert '"big"' in exc.value.message and "--max-image-bytes" in exc.value.message
    # The archive itself over the limit.
    with pytest.raises(pbox.ResourceExhausted) as exc:
        c.import_image("big", write(tmp_path, "big.tar", big))
    assert "archive is larger" in exc.value.message
    assert store_layers(agent) == [] and scratch_entries(agent) == []
    assert "big" not in {i.name for i in c.list_images()}
    c.close()


def test_in_use_image_cannot_be_removed_and_prune(ic: pbox.Client, img_agent: Agent,
                                                  tmp_path: Path) -> None:
    v1 = ic.import_image("inuse", write(tmp_path, "v1.tar", docker_archive([
        Layer().busybox().file("etc/v", b"1").bytes(), Layer().file("etc/w", b"w1").bytes()])))
    other = ic.import_image("keeper", write(tmp_path, "k.tar",
                                             Layer().busybox().file("etc/k", b"k").bytes()))
    sb = ic.create(image="inuse", memory="128M", disk="64M")
    try:
        with pytest.raises(pbox.FailedPrecondition) as exc:
            ic.remove_image("inuse")
        assert "in use by 1 live sandbox" in exc.value.message
        assert {i.name: i.sandboxes for i in ic.list_images()}["inuse"] == 1
        with pytest.raises(pbox.FailedPrecondition):
            ic.remove_image("host")
        with pytest.raises(pbox.NotFound):
            ic.remove_image("no-such-image")
        # Replacing the image under the running sandbox: prune keeps the layers it uses.
        v2 = ic.import_image("inuse", write(tmp_path, "v2.tar",
                                            Layer().busybox().file("etc/v", b"2").bytes()))
        assert set(v1.layers).isdisjoint(v2.layers)
        pruned = ic.prune_images()
        assert set(pruned.removed_layers).isdisjoint(v1.layers + v2.layers + other.layers)
        assert run(sb, "cat", "/etc/v").stdout == b"1"
    finally:
        sb.destroy()
    pruned = ic.prune_images()
    assert set(v1.layers) <= set(pruned.removed_layers)
    assert set(pruned.removed_layers).isdisjoint(v2.layers + other.layers)
    for sha in v1.layers:
        assert sha not in store_layers(img_agent)
    ic.remove_image("inuse")
    assert "inuse" not in {i.name for i in ic.list_images()}
    pruned = ic.prune_images()
    assert set(v2.layers) - set(other.layers) <= set(pruned.removed_layers)
    sb = ic.create(image="keeper", memory="128M", disk="64M")
    try:
        assert run(sb, "cat", "/etc/k").stdout == b"k"
    finally:
        sb.destroy()
    with pytest.raises(pbox.NotFound):
        ic.create(image="inuse", memory="128M", disk="64M")


def test_images_survive_agent_restart(make_agent: AgentFactory, tmp_path: Path) -> None:
    agent = make_agent()
    c = agent.client()
    info = c.import_image("persist", write(tmp_path, "p.tar.gz", gzip.compress(
        Layer().busybox().file("etc/p", b"persisted").bytes())))
    c.close()
    assert agent.stop() == 0
    # A half-finished import of the dead agent: dropped at the next start.
    (agent.state_dir / "images/store/layers/.tmp-dead").mkdir()
    again = make_agent(root=agent.root)
    c = again.client()
    listed = {i.name: i for i in c.list_images()}
    assert listed["persist"].layers == info.layers
    assert ".tmp-dead" not in store_layers(again)
    sb = c.create(image="persist", memory="128M", disk="64M")
    try:
        assert run(sb, "cat", "/etc/p").stdout == b"persisted"
    finally:
        sb.destroy()
    c.close()


def test_cli_image_commands(img_agent: Agent, tmp_path: Path) -> None:
    pbox_cli = Path(_find_pboxd() or "").parent / "pbox"
    if not pbox_cli.exists():
        pytest.skip("pbox CLI not built")
    path = write(tmp_path, "cli.tar", Layer().busybox().file("etc/cli", b"c").bytes())
    env = dict(os.environ, PBOX_ENDPOINT=img_agent.endpoint)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(pbox_cli), *args], env=env, capture_output=True, text=True,
                              timeout=60)

    r = cli("image", "import", "cli-img", str(path))
    assert r.returncode == 0 and "imported cli-img (rootfs, 1 layer" in r.stdout, r
    r = cli("image", "ls", "-q")
    assert "cli-img" in r.stdout.split(), r
    r = cli("image", "rm", "cli-img")
    assert r.returncode == 0, r
    r = cli("image", "rm", "cli-img")
    assert r.returncode == 1 and "no imported image" in r.stderr, r
    r = cli("image", "prune")
    assert r.returncode == 0 and "removed" in r.stdout, r


@pytest.mark.skipif(os.environ.get("PBOX_TEST_BASE_IMAGE") != "1"
                    and not os.environ.get("PBOX_BASE_IMAGE"),
                    reason="builds a Debian rootfs with mmdebstrap (minutes; ctest caches it): set "
                           "PBOX_TEST_BASE_IMAGE=1, or PBOX_BASE_IMAGE=<tarball of "
                           "scripts/make-base-image --minimal>")
def test_base_image_from_make_base_image(make_agent: AgentFactory, tmp_path: Path) -> None:
    out = Path(os.environ.get("PBOX_BASE_IMAGE") or tmp_path / "base.tar.zst")
    out.parent.mkdir(parents=True, exist_ok=True)
    # ctest runs this file as root and rootless at once: one of them builds the cached tarball
    # on a machine's first run, the other waits for it.
    with open(f"{out}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            subprocess.run([str(REPO / "scripts/make-base-image"), "--minimal", str(out)],
                           check=True, timeout=1800)
    agent = make_agent()
    c = agent.client()
    c.import_image("debian-min", out)
    sb = c.create(image="debian-min", memory="512M", disk="256M")
    try:
        r = sb.run(["python3", "-c", "import sys; print(sys.version_info[:2])"], timeout=60)
        assert r.ok and r.stdout.strip() == b"(3, 11)", r
        r = sb.run(["sh", "-c", "cat /etc/debian_version"], timeout=60)
        assert r.ok and r.stdout.startswith(b"12"), r
    finally:
        sb.destroy()
    c.close()


# ---- OCI image layouts ----

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
LAYER_TYPES = {"plain": "application/vnd.oci.image.layer.v1.tar",
               "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
               "zstd": "application/vnd.oci.image.layer.v1.tar+zstd"}


class Oci:
    """An OCI image layout built by hand: blobs by digest, index.json, oci-layout."""

    def __init__(self) -> None:
        self.blobs: Dict[str, bytes] = {}
        self.index: List[dict] = []

    def blob(self, data: bytes, media_type: str) -> dict:
        import hashlib
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    def layer(self, tar: bytes, compression: str = "plain") -> dict:
        data = tar
        if compression == "gzip":
            data = gzip.compress(tar)
        elif compression == "zstd":
            data = subprocess.run(["zstd", "-q", "-c"], input=tar, capture_output=True,
                                  check=True).stdout
        return self.blob(data, LAYER_TYPES[compression])

    def manifest(self, layers: List[dict]) -> dict:
        config = self.blob(b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers"}}',
                           "application/vnd.oci.image.config.v1+json")
        body = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config,
                "layers": layers}
        return self.blob(json.dumps(body).encode(), OCI_MANIFEST)

    def nested(self, entries: List[dict]) -> dict:
        body = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
        return self.blob(json.dumps(body).encode(), OCI_INDEX)

    def add(self, desc: dict, ref: Optional[str] = None) -> "Oci":
        d = dict(desc)
        if ref is not None:
            d["annotations"] = {"org.opencontainers.image.ref.name": ref}
        self.index.append(d)
        return self

    def files(self) -> Dict[str, bytes]:
        out = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}',
               "index.json": json.dumps({"schemaVersion": 2, "manifests": self.index}).encode()}
        for digest, data in self.blobs.items():
            out["blobs/sha256/" + digest.split(":")[1]] = data
        return out

    def archive(self, extra: Optional[Layer] = None) -> bytes:
        out = extra or Layer()
        out.dir("blobs").dir("blobs/sha256")
        for name, data in self.files().items():
            out.file(name, data)
        return out.bytes()

    def directory(self, path: Path) -> Path:
        for name, data in self.files().items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_bytes(data)
        return path


def _layered_pair() -> Tuple[bytes, bytes]:
    base = (Layer().busybox().file("etc/a", b"one\n").file("etc/b", b"bee\n")
            .dir("data").file("data/old", b"o").bytes())
    top = (Layer().file("etc/a", b"two\n").file("etc/.wh.b", b"")
           .dir("data").file("data/.wh..wh..opq", b"").file("data/new", b"n").bytes())
    return base, top


def _check_layered(ic: pbox.Client, name: str) -> None:
    sb = ic.create(image=name, memory="128M", disk="64M")
    try:
        assert run(sb, "cat", "/etc/a").stdout == b"two\n"
        assert not run(sb, "test", "-e", "/etc/b").ok
        assert run(sb, "ls", "/data").stdout.split() == [b"new"]
    finally:
        sb.destroy()


@pytest.mark.parametrize("compression", ["plain", "gzip", "zstd"])
def test_oci_archive_layers_merge(ic: pbox.Client, tmp_path: Path, compression: str) -> None:
    base, top = _layered_pair()
    oci = Oci()
    oci.add(oci.manifest([oci.layer(base, compression), oci.layer(top, "gzip")]), "v1")
    path = write(tmp_path, "oci.tar", oci.archive())
    info = ic.import_image(f"oci-{compression}", path)
    assert info.format == "oci-archive" and len(info.layers) == 2
    _check_layered(ic, f"oci-{compression}")


def test_oci_layout_directory_and_nested_index(ic: pbox.Client, img_agent: Agent,
                                               tmp_path: Path) -> None:
    base, top = _layered_pair()
    oci = Oci()
    mine = oci.manifest([oci.layer(base), oci.layer(top)])
    other = oci.manifest([oci.layer(Layer().busybox().file("etc/a", b"arm\n").bytes())])
    import platform
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    other["platform"] = {"os": "linux", "architecture": "s390x"}
    mine["platform"] = {"os": "linux", "architecture": arch}
    oci.add(oci.nested([other, mine]), "multi")
    layout = oci.directory(tmp_path / "layout")
    info = ic.import_image("oci-dir", layout)
    assert info.format == "oci-archive" and len(info.layers) == 2
    _check_layered(ic, "oci-dir")
    # The CLI tars the directory the same way.
    pbox_cli = Path(_find_pboxd() or "").parent / "pbox"
    if pbox_cli.exists():
        r = subprocess.run([str(pbox_cli), "image", "import", "oci-dir-cli", str(layout)],
                           env=dict(os.environ, PBOX_ENDPOINT=img_agent.endpoint),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "imported oci-dir-cli (oci-archive, 2 layers" in r.stdout, r
        _check_layered(ic, "oci-dir-cli")
        r = subprocess.run([str(pbox_cli), "image", "import", "x", str(tmp_path)],
                           env=dict(os.environ, PBOX_ENDPOINT=img_agent.endpoint),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "not an OCI image layout" in r.stderr, r


def test_multi_image_archives_need_a_ref(ic: pbox.Client, tmp_path: Path) -> None:
    one = Layer().busybox().file("etc/which", b"one\n").bytes()
    two = Layer().busybox().file("etc/which", b"two\n").bytes()
    oci = Oci()
    oci.add(oci.manifest([oci.layer(one)]), "localhost/app:one")
    second = oci.manifest([oci.layer(two)])
    oci.add(second, "localhost/app:two")
    oci_path = write(tmp_path, "multi-oci.tar", oci.archive())
    # docker save of two images: a manifest.json of two entries.
    import hashlib
    d = Layer().dir("blobs").dir("blobs/sha256")
    entries = []
    for tag, data in (("app:one", one), ("app:two", two)):
        digest = hashlib.sha256(data).hexdigest()
        d.file(f"blobs/sha256/{digest}", data)
        entries.append({"Config": "c", "RepoTags": [f"localhost/{tag}"],
                        "Layers": [f"blobs/sha256/{digest}"]})
    d.file("manifest.json", json.dumps(entries).encode())
    docker_path = write(tmp_path, "multi-docker.tar", d.bytes())
    for path in (oci_path, docker_path):
        with pytest.raises(pbox.InvalidArgument) as exc:
            ic.import_image("multi", path)
        msg = exc.value.message
        assert "holds 2 images" in msg and "localhost/app:one" in msg and \
            "localhost/app:two" in msg, msg
        with pytest.raises(pbox.InvalidArgument) as exc:
            ic.import_image("multi", path, ref="app:three")
        assert "names no image" in exc.value.message and "app:two" in exc.value.message
        for ref, want in (("app:two", b"two\n"), ("localhost/app:one", b"one\n")):
            ic.import_image("multi", path, ref=ref)
            sb = ic.create(image="multi", memory="128M", disk="64M")
            try:
                assert run(sb, "cat", "/etc/which").stdout == want, (path, ref)
            finally:
                sb.destroy()
    # An OCI manifest digest names its image too.
    ic.import_image("multi", oci_path, ref=second["digest"])
    with pytest.raises(pbox.InvalidArgument) as exc:
        ic.import_image("single", write(tmp_path, "rootfs.tar", one), ref="x")
    assert "root filesystem tarball" in exc.value.message


def _hostile_oci_cases() -> Dict[str, Tuple[bytes, str]]:
    good = Layer().busybox().bytes()
    cases: Dict[str, Tuple[bytes, str]] = {}

    oci = Oci()
    layer = oci.layer(good)
    oci.blobs[layer["digest"]] = good[:-512] + b"\1" * 512  # same size, other bytes
    oci.add(oci.manifest([layer]))
    cases["layer-digest-mismatch"] = (oci.archive(), "does not match its descriptor")

    oci = Oci()
    layer = dict(oci.layer(good))
    layer["size"] = layer["size"] + 1
    oci.add(oci.manifest([layer]))
    cases["layer-size-mismatch"] = (oci.archive(), "does not match its descriptor")

    oci = Oci()
    m = oci.manifest([oci.layer(good)])
    oci.blobs[m["digest"]] = oci.blobs[m["digest"]].replace(b'"layers"', b'"layers" ')
    oci.add(m)
    cases["manifest-digest-mismatch"] = (oci.archive(), "does not match its descriptor")

    oci = Oci()
    layer = oci.layer(good)
    digest = layer["digest"].split(":")[1]
    data = oci.blobs.pop(layer["digest"])
    oci.add(oci.manifest([layer]))
    cases["blob-outside-blobs"] = (
        oci.archive(Layer().dir("elsewhere").file("elsewhere/x", data)
                    .dir("blobs").dir("blobs/sha256")
                    .symlink(f"blobs/sha256/{digest}", "../../elsewhere/x")),
        "outside the layout's blobs/")

    oci = Oci()
    layer = oci.layer(good)
    del oci.blobs[layer["digest"]]
    oci.add(oci.manifest([layer]))
    cases["missing-blob"] = (oci.archive(), "is not a regular file of the archive")

    oci = Oci()
    oci.add({"mediaType": OCI_MANIFEST, "digest": "sha256:../../../etc/passwd", "size": 10})
    cases["digest-path"] = (oci.archive(), "is not sha256:<64 lower-case hex digits>")

    oci = Oci()
    layer = dict(oci.layer(good))
    layer["size"] = 1 << 60
    oci.add(oci.manifest([layer]))
    cases["huge-layer"] = (oci.archive(), "larger than the agent's limit")

    oci = Oci()
    m = dict(oci.manifest([oci.layer(good)]))
    m["size"] = 1 << 40
    oci.add(m)
    cases["huge-manifest"] = (oci.archive(), "more than")

    oci = Oci()
    oci.add(oci.manifest([oci.blob(b"{}", "application/vnd.oci.empty.v1+json")]))
    cases["not-a-layer"] = (oci.archive(), "not a tar layer")

    oci = Oci()
    desc = oci.manifest([oci.layer(good)])
    for _ in range(10):
        desc = oci.nested([desc])
    oci.add(desc)
    cases["deep-nesting"] = (oci.archive(), "nested deeper than")

    # An index listing itself: content addressing makes the digest wrong, and the cycle is
    # caught before the blob is read a second time either way.
    oci = Oci()
    fake = "sha256:" + "ab" * 32
    body = json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": OCI_INDEX, "digest": fake, "size": 0}]}).encode()
    oci.blobs[fake] = body
    oci.add({"mediaType": OCI_INDEX, "digest": fake, "size": len(body)})
    cases["index-cycle"] = (oci.archive(), "does not match its descriptor")

    oci = Oci()
    oci.add(oci.manifest([oci.layer(Layer().file("/etc/evil", b"x").bytes())]))
    cases["hostile-layer"] = (oci.archive(), "/etc/evil")

    cases["bad-index"] = (Layer().file("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
                          .file("index.json", b"[1,2]").bytes(), "not an OCI image index")
    return cases


def test_hostile_oci_archives_rejected_and_leave_nothing(ic: pbox.Client, img_agent: Agent,
                                                         tmp_path: Path) -> None:
    before_images = {i.name for i in ic.list_images()}
    for case, (data, why) in _hostile_oci_cases().items():
        path = write(tmp_path, f"{case}.tar", data)
        with pytest.raises((pbox.InvalidArgument, pbox.ResourceExhausted)) as exc:
            ic.import_image(f"hostile-oci-{case}", path)
        assert why in exc.value.message, (case, exc.value.message)
        assert scratch_entries(img_agent) == [], case
    assert {i.name for i in ic.list_images()} == before_images
    ic.prune_images()


def test_real_podman_oci_archive(ic: pbox.Client, tmp_path: Path) -> None:
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("podman is not installed (Debian: podman)")
    import tempfile
    runroot = tempfile.mkdtemp(prefix="pbx-")  # podman wants a runroot under 50 characters
    storage = ["--root", str(tmp_path / "storage"), "--runroot", runroot,
               "--storage-driver", "vfs"]
    rootfs = write(tmp_path, "root.tar", Layer().busybox().file("etc/podman", b"p\n").bytes())
    try:
        subprocess.run([podman, *storage, "import", str(rootfs), "localhost/pbox-oci:t1"],
                       check=True, capture_output=True, timeout=120)
        out = tmp_path / "saved.tar"
        subprocess.run([podman, *storage, "save", "--format", "oci-archive", "-o", str(out),
                        "localhost/pbox-oci:t1"], check=True, capture_output=True, timeout=120)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"podman cannot import/save here: {getattr(e, 'stderr', b'')!r}")
    finally:
        subprocess.run([podman, *storage, "rmi", "-a", "-f"], capture_output=True, timeout=120)
        subprocess.run(["umount", "-R", str(tmp_path / "storage")], capture_output=True)
        shutil.rmtree(runroot, ignore_errors=True)
    info = ic.import_image("podman-oci", out)
    assert info.format == "oci-archive" and len(info.layers) == 1
    sb = ic.create(image="podman-oci", memory="128M", disk="64M")
    try:
        assert run(sb, "cat", "/etc/podman").stdout == b"p\n"
    finally:
        sb.destroy()
    with pytest.raises(pbox.InvalidArgument):
        ic.import_image("podman-oci", out, ref="localhost/pbox-oci:other")
    ic.import_image("podman-oci", out, ref="pbox-oci:t1")
