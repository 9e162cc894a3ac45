"""Images on a pbox agent: what :meth:`pbox.Client.list_images` returns, and the request
stream of :meth:`pbox.Client.import_image`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import IO, Iterator, List, Union

from ._proto import pbox_pb2 as pb

__all__ = ["ImageInfo", "PruneResult"]

# Pieces of an image upload: images are GiBs, and the agent only spools them to disk.
IMPORT_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ImageInfo:
    """One image of the agent (``ListImages``, ``ImportImage``)."""

    name: str
    kind: str                 # "host", "directory" (pboxd --image) or "imported"
    format: str = ""          # imported: "rootfs" or "docker-archive"
    layers: List[str] = field(default_factory=list)  # sha256 of each layer tarball, bottom first
    bytes: int = 0            # imported: sum of the file sizes of its layers
    created_unix_ms: int = 0
    sandboxes: int = 0        # live sandboxes using it


@dataclass(frozen=True)
class PruneResult:
    removed_layers: List[str]
    bytes_freed: int


def image_info(m: pb.ImageInfo) -> ImageInfo:
    return ImageInfo(name=m.name, kind=m.kind, format=m.format, layers=list(m.layers),
                     bytes=m.bytes, created_unix_ms=m.created_unix_ms, sandboxes=m.sandboxes)


def prune_result(m: pb.PruneImagesResponse) -> PruneResult:
    return PruneResult(removed_layers=list(m.removed_layers), bytes_freed=m.bytes_freed)


def import_requests(name: str, source: Union[str, os.PathLike, IO[bytes]], ref: str = ""
                    ) -> Iterator[pb.ImportImageRequest]:
    """The header, then the archive's bytes in IMPORT_CHUNK_BYTES pieces. ``source`` is a path
    or a binary file object; a path is opened here (and closed when the stream ends). A
    directory path is an OCI image layout, sent as its tar (what the agent reads from
    ``podman save --format oci-archive``)."""
    yield pb.ImportImageRequest(header=pb.ImportImageHeader(name=name, ref=ref))
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        yield from _oci_dir_chunks(os.fspath(source))
    elif isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            yield from _chunks(f)
    else:
        yield from _chunks(source)


def _chunks(f: IO[bytes]) -> Iterator[pb.ImportImageRequest]:
    while True:
        data = f.read(IMPORT_CHUNK_BYTES)
        if not data:
            return
        yield pb.ImportImageRequest(chunk=data)


def _oci_dir_chunks(path: str) -> Iterator[pb.ImportImageRequest]:
    """The tar of the OCI layout at ``path`` (oci-layout, index.json, blobs/<alg>/<hex>), made
    as it is sent: regular files only, symlinks skipped and never followed."""
    import stat
    import tarfile

    for marker in ("oci-layout", "index.json"):
        st = os.lstat(os.path.join(path, marker)) if os.path.lexists(
            os.path.join(path, marker)) else None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is a directory without {marker}: not an OCI image layout")
    names = ["oci-layout", "index.json"]
    blobs = os.path.join(path, "blobs")
    if os.path.isdir(blobs):
        for alg in sorted(os.listdir(blobs)):
            sub = os.path.join(blobs, alg)
            if os.path.islink(sub) or not os.path.isdir(sub):
                continue
            names += [f"blobs/{alg}/{b}" for b in sorted(os.listdir(sub))]
    for name in names:
        fd = os.open(os.path.join(path, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC) \
            if not os.path.islink(os.path.join(path, name)) else -1
        if fd < 0:
            continue
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                continue
            info = tarfile.TarInfo(name)
            info.size = st.st_size
            info.mode = 0o644
            yield pb.ImportImageRequest(chunk=info.tobuf(format=tarfile.GNU_FORMAT))
            left = st.st_size
            while left > 0:
                data = f.read(min(IMPORT_CHUNK_BYTES, left))
                if not data:
                    raise OSError(f"{path}/{name} shrank while it was being sent")
                left -= len(data)
                yield pb.ImportImageRequest(chunk=data)
            if st.st_size % 512:
                yield pb.ImportImageRequest(chunk=b"\0" * (512 - st.st_size % 512))
    yield pb.ImportImageRequest(chunk=b"\0" * 1024)
