#!/usr/bin/env python3
"""What may include what under src/ (docs/architecture.md, "Layering"), checked.

Every quoted #include of every .h/.cc under src/ is read and held against RULES: the first rule
whose folder holds the including file says which folders (and generated headers) it may name.
Standard and third-party headers (<...>, "absl/...", "fmt/...", ...) are not the layering's
business; a quoted include that names a folder under src/ is. Also checked: the folders of one
part form no cycle (a <-> b through any chain of includes), and every file under src/ falls
under some rule (a new folder needs a line here and in docs/architecture.md).

Run: python3 tests/layering_test.py [SRC_DIR]   (ctest: layering_test)
"""

import os
import re
import sys

# folder (relative to src/) -> include prefixes it may use besides its own folder.
# Order matters: the longest (most specific) folder is matched first.
PROTO_PBOX = "bragg/pbox/v1/"
RULES = {
    "common": [],
    # pbox: the agent at the top, its rooms below; the client reaches only the wire format
    # and the proto, never the agent's files.
    "pbox/wire": ["common/"],
    "pbox/init": ["common/"],
    "pbox/cgroup": ["common/"],
    "pbox/image": ["common/"],
    "pbox/runtime": ["common/", "pbox/cgroup/", "pbox/image/", "pbox/init/"],
    "pbox/client": ["common/", "pbox/wire/", PROTO_PBOX],
    "pbox/testing": ["common/", "pbox/"],
    "pbox": ["common/", "pbox/", PROTO_PBOX],
    # gateway: production code never includes the simulator; the simulator may use the
    # gateway's HTTP helpers.
    "gateway/sim": ["common/", "gateway/"],
    "gateway": ["common/", "gateway/"],
    # engine: the server reaches the core through engine.h alone (no libtorch in its folder).
    "engine/server": ["common/", "engine/engine.h", "engine/tokenizer.h"],
    # the model and the test-model writer: torch's side, under the scheduler.
    "engine/model": ["common/"],
    "engine/testing": ["common/"],
    "engine": ["common/", "engine/model/"],
    # train: the engine's model code (one Qwen3, so trainer and engine cannot drift) and pack's
    # planner; its kernels and optimizer stand alone.
    "train/kernels": ["common/", "engine/model/linear.h"],
    "train/optim": ["common/"],
    # The trainer reaches the engine's model library (one Qwen3 for both), pack's planner door,
    # and in its tests the engine's door (parity) and test-model writer.
    "train": ["common/", "train/", "engine/model/", "engine/testing/", "engine/engine.h",
              "pack/plan.h"],
    "pack": ["common/"],
    "reshard": ["common/"],
    # rl, the controller, drives the others through their doors: the trainer's (in process),
    # the gateway's rollout client, pbox's client; it writes a first model with the engine's
    # random-model writer.
    "rl": ["common/", "rl/", "train/trainer.h", "train/trajectory.h", "gateway/client.h",
           "pbox/client/client.h", "pbox/client/cluster_client.h", PROTO_PBOX, "pack/plan.h",
           "engine/testing/"],
    # fusion, SandboxFusion's API in front of pbox: pbox's client door only, as rl.
    "fusion": ["common/", "fusion/", "pbox/client/client.h", PROTO_PBOX],
}

# Prefixes a folder may never include, though its rule above would allow them.
FORBIDDEN = {
    "gateway": ["gateway/sim/"],  # the simulator is for tests and benchmarks only
}

# Quoted includes that are not Bragg's (libraries whose headers are included with quotes).
THIRD_PARTY = re.compile(
    r"^(absl|fmt|spdlog|nlohmann|gtest|gmock|grpcpp|grpc|google|CLI|httplib|boost|pybind11|"
    r"benchmark|seccomp|archive|openssl|torch|ATen|c10|cuda|cub|thrust)[/.]")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def rule_for(rel):
    folder = os.path.dirname(rel)
    for prefix in sorted(RULES, key=len, reverse=True):
        if folder == prefix or folder.startswith(prefix + "/"):
            return prefix
    return None


def check(src):
    """The problems found under `src`, one line each."""
    errors = []
    edges = {}  # (part-folder) -> set of folders it includes, for the cycle check
    parts = {p.split("/")[0] for p in RULES}
    for root, _, files in os.walk(src):
        for name in files:
            if not name.endswith((".h", ".cc")):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)
            rule = rule_for(rel)
            if rule is None:
                errors.append(f"{rel}: no layering rule covers its folder "
                              f"(add one to tests/layering_test.py and docs/architecture.md)")
                continue
            allowed = [rule + "/"] + RULES[rule]
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            for inc in INCLUDE.findall(text):
                if THIRD_PARTY.match(inc):
                    continue
                top = inc.split("/")[0]
                if top not in parts and not inc.startswith("bragg/"):
                    # A sibling include without a folder ("foo.h") or a library header.
                    if "/" not in inc and os.path.exists(os.path.join(root, inc)):
                        errors.append(f'{rel}: includes "{inc}" by bare name; '
                                      f'name it from src/ ("{os.path.dirname(rel)}/{inc}")')
                    continue
                if any(inc.startswith(f) for f in FORBIDDEN.get(rule, ())):
                    errors.append(f'{rel}: includes "{inc}", which {rule}/ may never use')
                elif not any(inc.startswith(a) for a in allowed):
                    errors.append(f'{rel}: includes "{inc}", outside what {rule}/ may use '
                                  f"({', '.join(allowed)})")
                target = rule_for(inc)
                if (target and target != rule and "/" in rule
                        and target.split("/")[0] == rule.split("/")[0]):
                    edges.setdefault(rule, set()).add(target)

    # No cycles among the folders of one part (pbox's agent top excluded: it is the root that
    # may include every room, and no room may include it back, which RULES already enforce).
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    for folder in sorted(edges):
        if folder in reach(folder):
            errors.append(f"{folder}/: its includes come back to it (a cycle between folders)")

    return errors


def self_test():
    """The checker finds each kind of break in a small tree made for it (so that a pass on the
    real tree means something)."""
    import tempfile
    files = {
        "common/ok.h": '#include "common/status.h"\n#include "absl/status/status.h"\n',
        "common/up.h": '#include "pbox/agent.h"\n',                    # common includes a part
        "pbox/client/c.cc": '#include "pbox/service.h"\n',             # client reaches the agent
        "pbox/cgroup/a.h": '#include "pbox/image/b.h"\n',              # outside its rule
        "pbox/runtime/r.h": '#include "pbox/cgroup/x.h"\n#include "r2.h"\n',  # bare name
        "pbox/runtime/r2.h": "",
        "gateway/g.cc": '#include "gateway/sim/sim_worker.h"\n',       # production on the sim
        "pack/p.cc": '#include "reshard/zip.h"\n',                     # part on part
        "newpart/n.cc": "",                                             # folder without a rule
    }
    want = ["common/up.h", "pbox/client/c.cc", "pbox/cgroup/a.h", "pbox/runtime/r.h",
            "gateway/g.cc", "pack/p.cc", "newpart/n.cc"]
    with tempfile.TemporaryDirectory() as d:
        for rel, text in files.items():
            os.makedirs(os.path.join(d, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(d, rel), "w") as f:
                f.write(text)
        found = check(d)
    missed = [w for w in want if not any(e.startswith(w + ":") for e in found)]
    extra = [e for e in found if not any(e.startswith(w + ":") for w in want)]
    assert not missed and not extra, f"self-test: missed {missed}, unexpected {extra}"


def main(src):
    self_test()
    errors = check(src)
    for e in errors:
        print("layering:", e)
    print(f"layering: {'FAILED' if errors else 'ok'} ({len(errors)} problems)")
    return 1 if errors else 0


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "src")))
