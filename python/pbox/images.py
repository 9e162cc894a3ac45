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


def import_requests(name: str, source: Union[str, os.PathLike, IO[bytes]]
                    ) -> Iterator[pb.ImportImageRequest]:
    """The header, then the archive's bytes in IMPORT_CHUNK_BYTES pieces. ``source`` is a path
    or a binary file object; a path is opened here (and closed when the stream ends)."""
    yield pb.ImportImageRequest(header=pb.ImportImageHeader(name=name))
    if isinstance(source, (str, os.PathLike)):
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
