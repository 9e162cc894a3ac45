#!/usr/bin/python3
"""Writes the seed corpora of the reshard fuzz targets (src/reshard/fuzz_pickle.cc,
fuzz_zip.cc) into tests/fuzz/corpus/reshard_fuzz_{pickle,zip}/: a few valid inputs of the
shapes torch checkpoints hold, and a few broken ones. Standard library only:

    /usr/bin/python3 tests/fuzz/make_reshard_corpus.py
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import shutil
import struct
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")


def write_all(target: str, seeds: dict) -> None:
    d = os.path.join(OUT, target)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for name, data in seeds.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)


class _Named:
    """Pickles as a call of the global `module.name`, which need not exist here (torch's)."""

    def __init__(self, module: str, name: str, args: tuple) -> None:
        self.fn = _Global(module, name)
        self.args = args

    def __reduce__(self):
        return self.fn, self.args


class _Global:
    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args):  # save_reduce wants a callable; never called
        raise NotImplementedError


class _Pickler(pickle._Pickler):  # the pure-Python pickler, whose save_global can be replaced
    def persistent_id(self, obj):
        if isinstance(obj, tuple) and obj[:1] == ("storage",):
            return obj  # torch: ("storage", type, key, location, numel)
        return None

    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, _Global):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            return
        super().save(obj, save_persistent_id)


def torch_like(protocol: int) -> bytes:
    """A state dict of one tensor the way torch.save writes data.pkl."""
    storage = ("storage", _Global("torch", "FloatStorage"), "0", "cpu", 6)
    tensor = _Named("torch._utils", "_rebuild_tensor_v2",
                    (storage, 0, (2, 3), (3, 1), False, collections.OrderedDict()))
    out = io.BytesIO()
    _Pickler(out, protocol=protocol).dump(
        collections.OrderedDict([("model.weight", tensor), ("iteration", 7)]))
    return out.getvalue()


def pickles() -> dict:
    plain = {"a": [1, 2.5, "x", b"y", None, True], "b": (1, (2, (3,))), "c": {"n": -(2 ** 40)}}
    seeds = {
        "plain_p2": pickle.dumps(plain, protocol=2),
        "plain_p4": pickle.dumps(plain, protocol=4),
        "plain_p5": pickle.dumps(plain, protocol=5),
        "torch_like_p2": torch_like(2),
        "torch_like_p4": torch_like(4),
        "big_ints": pickle.dumps([2 ** 63, -(2 ** 63), 2 ** 200, 0], protocol=2),
        "memo_shared": pickle.dumps([[1, 2]] * 3, protocol=2),
    }
    seeds["truncated"] = seeds["torch_like_p2"][: len(seeds["torch_like_p2"]) // 2]
    seeds["no_stop"] = seeds["plain_p2"][:-1]
    seeds["bad_opcode"] = b"\x80\x02\xff."
    seeds["stub_global"] = b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00ls\x85R."
    seeds["deep_marks"] = b"\x80\x02" + b"(" * 64 + b"."
    return seeds


def zips() -> dict:
    def make(entries: dict, compression: int = zipfile.ZIP_STORED) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", compression=compression) as z:
            for name, data in entries.items():
                z.writestr(name, data)
        return out.getvalue()

    ckpt = {"archive/data.pkl": torch_like(2), "archive/data/0": struct.pack("<6f", *range(6)),
            "archive/version": b"3\n"}
    seeds = {
        "torch_save": make(ckpt),
        "empty": make({}),
        "one_entry": make({"a": b"hello"}),
        "deflated": make({"a": b"x" * 1000}, zipfile.ZIP_DEFLATED),
    }
    good = seeds["torch_save"]
    seeds["truncated"] = good[: len(good) - 10]
    seeds["no_directory"] = good[: good.rfind(b"PK\x01\x02")]
    corrupt = bytearray(good)
    eocd = corrupt.rfind(b"PK\x05\x06")
    struct.pack_into("<I", corrupt, eocd + 16, len(good) * 2)  # directory offset past the end
    seeds["directory_past_end"] = bytes(corrupt)
    corrupt = bytearray(good)
    cd = corrupt.find(b"PK\x01\x02")
    struct.pack_into("<I", corrupt, cd + 42, len(good) - 4)  # local header offset near the end
    seeds["entry_past_end"] = bytes(corrupt)
    return seeds


if __name__ == "__main__":
    write_all("reshard_fuzz_pickle", pickles())
    write_all("reshard_fuzz_zip", zips())
