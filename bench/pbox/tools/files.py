#!/usr/bin/python3
"""Tool execution: a file-heavy step (many small files written, listed, read back, removed).

Writes 400 small per-frame result files (JSON, about 2 KiB each) into a fresh directory under
/tmp, lists and reads them back, checks each one, and removes them: what an agent's data
reduction step does to its working directory. Deterministic for a given seed.

    python3 files.py SEED
"""
import hashlib
import json
import os
import shutil
import sys
import tempfile

FILES = 400


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    work = tempfile.mkdtemp(prefix="bragg-tool-files-", dir="/tmp")
    try:
        digest = hashlib.sha256()
        for i in range(FILES):
            frame = {"seed": seed, "frame": i, "intensity": [(i * 31 + j * seed) % 997 for j in range(300)]}
            with open(os.path.join(work, f"frame_{i:05d}.json"), "w") as f:
                json.dump(frame, f)
        names = sorted(os.listdir(work))
        total = 0
        for name in names:
            with open(os.path.join(work, name), "rb") as f:
                data = f.read()
            frame = json.loads(data)
            if frame["frame"] != int(name[6:11]):
                sys.exit(f"files: {name} holds frame {frame['frame']}")
            total += sum(frame["intensity"])
            digest.update(data)
    finally:
        shutil.rmtree(work)
    print(json.dumps({"tool": "files", "seed": seed, "files": len(names), "total": total,
                      "sha256": digest.hexdigest()[:16]}))


if __name__ == "__main__":
    main()
