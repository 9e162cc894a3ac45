"""The xrd example task (examples/xrd): its tool server and verifier driven as the sandbox runs
them (subprocesses speaking JSON lines), and the invariants of the data make_data.py writes."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASK = os.path.join(ROOT, "examples", "xrd")
SERVER = os.path.join(TASK, "sandbox", "tool_server.py")
VERIFIER = os.path.join(TASK, "sandbox", "verifier.py")
MAKE_DATA = os.path.join(TASK, "make_data.py")

sys.path.insert(0, TASK)
import make_data  # noqa: E402

VOCAB = make_data.Vocab()


def by_hand(a, hkl, wavelength):
    """2θ in degrees from Bragg's law, written out independently of the task's code."""
    h, k, l = (int(c) for c in hkl)
    d = a / math.sqrt(h * h + k * k + l * l)
    return 2 * math.degrees(math.asin(wavelength / (2 * d)))


class Server:
    """One tool_server.py process; ask() sends a raw line and reads the one answer line."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def ask_raw(self, line):
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        assert out.endswith(b"\n"), "server died: %r" % self.proc.stderr.read()
        return json.loads(out)

    def ask(self, text):
        return self.ask_raw(json.dumps({"text": text}).encode())

    def close(self):
        self.proc.stdin.close()
        rc = self.proc.wait(timeout=10)
        rest = self.proc.stdout.read()
        self.proc.stdout.close()
        self.proc.stderr.close()
        return rc, rest


@pytest.fixture
def server():
    s = Server()
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


def assert_error(reply, tool):
    assert reply["error"] is True and reply["tool"] == tool, reply
    text = reply["observation"]
    assert text.startswith("error: ") and text.endswith("\n") and len(text) <= 41, reply
    # The model reads it: every character must be a token.
    assert VOCAB.decode(VOCAB.encode(text)) == text


# ---- the tool server ----------------------------------------------------------------------


def test_whole_conversation(server):
    assert server.ask("lattice Al\n") == {"observation": "fcc 4.05\n", "tool": "lattice"}
    assert server.ask("bragg 4.05 111 Cu\n") == {"observation": "38.47\n", "tool": "bragg"}
    assert server.ask("answer 38.47\n") == {"done": True}
    assert server.close() == (0, b"")


@pytest.mark.parametrize("element,structure,a,hkl,literature", [
    # literature: the measured first peak under Cu Kα1 (ICDD cards); ASE's a is rounded to 0.01 Å,
    # so the tool's value may differ from it by a few hundredths (Fe: a = 2.87 vs 2.8665).
    ("Al", "fcc", "4.05", "111", 38.47),
    ("Si", "diamond", "5.43", "111", 28.44),
    ("Fe", "bcc", "2.87", "110", 44.67),
    ("Po", "sc", "3.35", "100", None),
])
def test_known_peaks_under_copper(server, element, structure, a, hkl, literature):
    assert server.ask("lattice %s\n" % element)["observation"] == "%s %s\n" % (structure, a)
    got = float(server.ask("bragg %s %s Cu\n" % (a, hkl))["observation"])
    assert got == round(by_hand(float(a), hkl, 1.5406), 2)
    if literature is not None:
        assert abs(got - literature) < 0.07
    if element == "Al":
        assert got == 38.47


def test_every_tube(server):
    for tube, wavelength in [("Cu", 1.5406), ("Mo", 0.7093), ("Co", 1.7890), ("Cr", 2.2897),
                             ("Fe", 1.9360), ("Ag", 0.5594)]:
        got = server.ask("bragg 4.05 111 %s\n" % tube)["observation"]
        assert got == "%.2f\n" % by_hand(4.05, "111", wavelength)


def test_no_reflection_when_lambda_exceeds_2d(server):
    # Cr: λ = 2.2897, d(111) of a = 1 is 0.577: λ / 2d = 1.98.
    assert_error(server.ask("bragg 1 111 Cr\n"), "bragg")


@pytest.mark.parametrize("text,tool", [
    ("lattice Xx\n", "lattice"),          # unknown element
    ("lattice H\n", "lattice"),           # an element without a cubic reference state
    ("lattice\n", "lattice"),
    ("lattice Al Cu\n", "lattice"),
    ("lattice  Al\n", "lattice"),         # two spaces
    ("bragg 4.05 000 Cu\n", "bragg"),
    ("bragg -4.05 111 Cu\n", "bragg"),
    ("bragg 0 111 Cu\n", "bragg"),
    ("bragg 0.0 111 Cu\n", "bragg"),
    ("bragg inf 111 Cu\n", "bragg"),
    ("bragg nan 111 Cu\n", "bragg"),
    ("bragg 1e3 111 Cu\n", "bragg"),
    ("bragg 4_05 111 Cu\n", "bragg"),     # Python's float() would take it
    ("bragg 4.05 11 Cu\n", "bragg"),
    ("bragg 4.05 1111 Cu\n", "bragg"),
    ("bragg 4.05 1-1 Cu\n", "bragg"),
    ("bragg 4.05 111 Xx\n", "bragg"),
    ("bragg 4.05 111\n", "bragg"),
    ("bragg 4.05 111 Cu extra\n", "bragg"),
    ("fly me to the moon\n", "none"),
    ("\n", "none"),
    ("lattice Al", "none"),               # the turn hit max_new_tokens: no "\n"
    ("bragg 4.05 111 Cu\n\n", "bragg"),   # a second line inside one turn
])
def test_malformed_calls(server, text, tool):
    assert_error(server.ask(text), tool)


@pytest.mark.parametrize("line", [
    b"garbage",
    b"",
    b"{",
    b"[]",
    b"null",
    b"42",
    b'"lattice Al\\n"',
    b"{}",
    b'{"txt": "lattice Al\\n"}',
    b'{"text": 7}',
    b'{"text": null}',
    b'{"text": ["lattice Al\\n"]}',
    b"\xff\xfe\x00 not utf-8",
    b"[" * 50000,                         # nesting deep enough to exhaust the JSON parser
])
def test_hostile_lines(server, line):
    assert_error(server.ask_raw(line), "none")
    # ...and it still serves.
    assert server.ask("lattice Al\n")["observation"] == "fcc 4.05\n"


def test_huge_line(server):
    reply = server.ask_raw(json.dumps({"text": "lattice " + "A" * (4 << 20) + "\n"}).encode())
    assert_error(reply, "none")
    assert server.ask("lattice Al\n")["observation"] == "fcc 4.05\n"


def test_eof_exits_zero(server):
    assert server.close() == (0, b"")


def test_eof_in_the_middle_of_a_line():
    proc = subprocess.run([sys.executable, SERVER], input=b'{"text": "lattice Al\\n"}\n{"tex',
                          capture_output=True, timeout=30)
    assert proc.returncode == 0
    lines = proc.stdout.decode().splitlines()
    assert json.loads(lines[0])["observation"] == "fcc 4.05\n"
    assert json.loads(lines[1])["error"] is True and len(lines) == 2


def test_answer_ends_the_rollout_whatever_it_says(server):
    assert server.ask("answer banana\n") == {"done": True}


# ---- the verifier -------------------------------------------------------------------------


def verify_in_a_process(rollout):
    data = rollout if isinstance(rollout, bytes) else json.dumps(rollout).encode()
    proc = subprocess.run([sys.executable, VERIFIER], input=data, capture_output=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.decode().strip())


@pytest.fixture(scope="module")
def long_lived_server():
    s = Server()
    yield s
    assert s.close() == (0, b"")


@pytest.fixture(params=["verifier.py", "tool_server.py verify"])
def verify(request):
    """The reward of a rollout two ways, which must agree: verifier.py in a process of its own
    (task.verifier), and the verify line of one long-lived tool server (task.
    verifier_in_tool_server), asked between ordinary turns."""
    if request.param == "verifier.py":
        return verify_in_a_process
    server = request.getfixturevalue("long_lived_server")

    def in_server(rollout):
        if isinstance(rollout, bytes):
            try:
                rollout = json.loads(rollout)
            except ValueError:
                # bragg-rl sends only JSON objects; a line that is not JSON gets an error
                # observation (no reward: the trajectory would be dropped), not a crash.
                reply = server.ask_raw(b'{"verify": ' + rollout + b"}")
                assert "reward" not in reply and reply["error"] is True, reply
                return 0
        reply = server.ask_raw(json.dumps({"verify": rollout}).encode())
        assert set(reply) == {"reward", "reason"} and reply["reward"] in (0, 1), reply
        assert server.ask("lattice Al\n") == {"observation": "fcc 4.05\n", "tool": "lattice"}
        return reply["reward"]

    return in_server


def rollout(turns, prompt="Al Cu\n", meta=None):
    return {"prompt": prompt, "meta": meta or {}, "turns": turns,
            "observations": ["fcc 4.05\n", "38.47\n"][:max(0, len(turns) - 1)]}


def test_verifier_right_answer(verify):
    assert verify(rollout(["lattice Al\n", "bragg 4.05 111 Cu\n", "answer 38.47\n"])) == 1


def test_verifier_wrong_hkl(verify):
    wrong = "%.2f" % by_hand(4.05, "110", 1.5406)
    assert verify(rollout(["lattice Al\n", "bragg 4.05 110 Cu\n", "answer %s\n" % wrong])) == 0


@pytest.mark.parametrize("answer,reward", [
    ("38.47", 1), ("38.479", 1), ("38.461", 1), ("38.48", 1), ("38.46", 1),
    ("38.481", 0), ("38.459", 0), ("38.5", 0), ("-38.47", 0),
    ("38.47 degrees", 0), ("abc", 0), ("", 0), ("nan", 0), ("inf", 0), ("3.847e1", 0),
])
def test_verifier_tolerance_and_numbers(answer, reward, verify):
    assert verify(rollout(["answer %s\n" % answer])) == reward


def test_verifier_by_hand_for_polonium(verify):
    truth = round(by_hand(3.35, "100", 1.5406), 2)
    assert verify(rollout(["answer %.2f\n" % truth], prompt="Po Cu\n")) == 1
    assert verify(rollout(["answer %.3f\n" % (truth + 0.011)], prompt="Po Cu\n")) == 0


def test_verifier_no_answer(verify):
    assert verify(rollout(["lattice Al\n", "bragg 4.05 111 Cu\n"])) == 0
    assert verify(rollout([])) == 0
    assert verify(rollout(["answer\n"])) == 0


def test_verifier_takes_the_last_answer(verify):
    assert verify(rollout(["answer 38.47\n", "answer 12.00\n"])) == 0
    assert verify(rollout(["answer 12.00\n", "answer 38.47\n"])) == 1


def test_verifier_answer_without_newline(verify):
    assert verify(rollout(["answer 38.47"])) == 1


def test_verifier_ignores_meta(verify):
    lying = {"element": "Al", "tube": "Cu", "structure": "fcc", "hkl": "111", "two_theta": 12.0}
    assert verify(rollout(["answer 12.00\n"], meta=lying)) == 0
    assert verify(rollout(["answer 38.47\n"], meta=lying)) == 1


@pytest.mark.parametrize("data", [
    b"", b"not json", b"[]", b"{}", b'{"prompt": "Al Cu\\n"}', b'{"turns": ["answer 38.47\\n"]}',
    json.dumps(rollout(["answer 38.47\n"], prompt="Al Cu")).encode(),
    json.dumps(rollout(["answer 38.47\n"], prompt="Xx Cu\n")).encode(),
    json.dumps(rollout(["answer 38.47\n"], prompt="Al Zz\n")).encode(),
    json.dumps(rollout(["answer 38.47\n"], prompt="Al  Cu\n")).encode(),
    json.dumps({"prompt": "Al Cu\n", "turns": "answer 38.47\n"}).encode(),
    json.dumps({"prompt": 7, "turns": ["answer 38.47\n"]}).encode(),
])
def test_verifier_hostile_input(data, verify):
    assert verify(data) == 0


def test_verifier_skips_turns_that_are_not_text(verify):
    assert verify({"prompt": "Al Cu\n", "turns": [7, None, "answer 38.47\n"]}) == 1


# ---- the data -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("xrd")
    proc = subprocess.run([sys.executable, MAKE_DATA, "--out", str(out), "--seed", "3",
                           "--warm", "1200"], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_vocab_is_the_agreed_one():
    assert len(VOCAB.tokens) == 74
    assert VOCAB.tokens[:3] == ["<pad>", "<eos>", "\n"] and VOCAB.tokens[-1] == "?"
    assert VOCAB.encode("Al Cu\n") == [16, 53, 3, 18, 62, 2]


def test_split(data_dir):
    train = read(data_dir / "prompts.jsonl")
    heldout = read(data_dir / "heldout.jsonl")
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in heldout}
    structures = {"fcc", "bcc", "diamond", "sc"}
    assert {p["meta"]["structure"] for p in train} == structures
    assert {p["meta"]["structure"] for p in heldout} == structures
    assert len(train) + len(heldout) == 38 * 6
    assert 0.12 < len(heldout) / (len(train) + len(heldout)) < 0.18
    assert sum(p["meta"]["element"] == "Po" for p in heldout) == 1
    # Held out are pairs, never whole elements.
    assert {p["meta"]["element"] for p in heldout} <= {p["meta"]["element"] for p in train}
    for p in train + heldout:
        m = p["meta"]
        assert p["prompt"] == "%s %s\n" % (m["element"], m["tube"])
        assert m["hkl"] == {"fcc": "111", "diamond": "111", "bcc": "110", "sc": "100"}[
            m["structure"]]


def test_warm_traces(data_dir):
    train = {p["prompt"]: p for p in read(data_dir / "prompts.jsonl")}
    warm = read(data_dir / "warm.jsonl")
    assert len(warm) == 1200
    for t in warm:
        assert set(t) == {"id", "group", "tokens", "loss_mask", "logprobs", "reward"}
        tokens, mask = t["tokens"], t["loss_mask"]
        assert len(tokens) == len(mask) == len(t["logprobs"]) and mask[0] == 0
        assert all(0 <= x < 74 for x in tokens) and set(mask) == {0, 1}
        text = VOCAB.decode(tokens)
        assert VOCAB.encode(text) == tokens
        lines = text.splitlines(keepends=True)
        assert len(lines) == 6 and lines[0] in train
        # Lines 1, 3, 5 are the model's; 0, 2, 4 prompt and observations. Each token is one
        # character here, so the mask lines up with the characters.
        assert len(tokens) == len(text)
        pos = 0
        for i, line in enumerate(lines):
            assert mask[pos:pos + len(line)] == [i % 2] * len(line), (t["id"], i)
            pos += len(line)
        meta = train[lines[0]]["meta"]
        assert lines[1] == "lattice %s\n" % meta["element"]
        structure, a = lines[2].split()
        bragg, a2, hkl, tube = lines[3].split()
        assert (bragg, a2, tube, structure) == ("bragg", a, meta["tube"], meta["structure"])
        assert lines[4] == "%.2f\n" % by_hand(float(a), hkl, make_data.TUBES[tube])
        assert lines[5] == "answer " + lines[4]
        assert t["reward"] == (1 if hkl == meta["hkl"] else 0)
    rate = sum(t["reward"] for t in warm) / len(warm)
    assert abs(rate - 0.3) < 0.05
    counts, chosen = {}, {}
    for t in warm:
        lines = VOCAB.decode(t["tokens"]).split("\n")
        structure = train[lines[0] + "\n"]["meta"]["structure"]
        counts[structure] = counts.get(structure, 0) + 1
        hkl = lines[3].split()[2]
        chosen.setdefault(structure, {}).setdefault(hkl, 0)
        chosen[structure][hkl] += 1
    assert counts == {"fcc": 300, "bcc": 300, "diamond": 300, "sc": 300}
    # The demonstrator's habit: in every structure its most frequent hkl is a wrong one (what
    # RL has to undo, per structure), and the right one is still tried often enough to learn.
    right = {"fcc": "111", "diamond": "111", "bcc": "110", "sc": "100"}
    for structure, hkls in chosen.items():
        habit = max(hkls, key=hkls.get)
        assert habit != right[structure], (structure, hkls)
        assert 0.2 < hkls.get(right[structure], 0) / counts[structure] < 0.4, (structure, hkls)
    assert len({max(h, key=h.get) for h in chosen.values()}) > 1, chosen


def test_the_verifier_agrees_with_the_warm_rewards(data_dir, verify):
    for t in read(data_dir / "warm.jsonl")[:8]:
        lines = VOCAB.decode(t["tokens"]).splitlines(keepends=True)
        got = verify({"prompt": lines[0], "meta": {}, "turns": lines[1::2],
                      "observations": lines[2::2]})
        assert got == t["reward"], t["id"]


def test_deterministic_for_a_seed(data_dir, tmp_path):
    subprocess.run([sys.executable, MAKE_DATA, "--out", str(tmp_path), "--seed", "3",
                    "--warm", "1200"], check=True, capture_output=True, timeout=120)
    for name in ("prompts.jsonl", "heldout.jsonl", "warm.jsonl"):
        assert (tmp_path / name).read_bytes() == (data_dir / name).read_bytes(), name


def test_check_mode_catches_a_leak(data_dir, tmp_path):
    for name in ("prompts.jsonl", "heldout.jsonl", "warm.jsonl"):
        (tmp_path / name).write_bytes((data_dir / name).read_bytes())
    ok = subprocess.run([sys.executable, MAKE_DATA, "--check", str(tmp_path)],
                        capture_output=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    # Copy a held-out pair into train: --check must refuse it.
    with open(tmp_path / "prompts.jsonl", "a") as f:
        f.write((data_dir / "heldout.jsonl").read_text().splitlines()[0] + "\n")
    bad = subprocess.run([sys.executable, MAKE_DATA, "--check", str(tmp_path)],
                         capture_output=True, timeout=120)
    assert bad.returncode != 0 and b"held-out pairs in train" in bad.stderr


def test_prepare_writes_the_table_the_server_then_reads(tmp_path):
    """`tool_server.py --prepare` (bragg-rl's task.setup) writes ASE's table next to the script;
    the server and the verifier then read it instead of importing ASE, with the same answers."""
    import shutil

    for name in ("tool_server.py", "verifier.py"):
        shutil.copy(os.path.join(TASK, "sandbox", name), tmp_path / name)
    subprocess.run([sys.executable, str(tmp_path / "tool_server.py"), "--prepare"], check=True)
    cached = json.loads((tmp_path / "lattice.json").read_text())
    sys.path.insert(0, os.path.join(TASK, "sandbox"))
    import tool_server

    fresh = tool_server.lattice_table(cache=None)
    assert {k: tuple(v) for k, v in cached.items()} == fresh
    assert len(cached) == 38
    # The cached table answers as ASE's does; a corrupt cache would show here.
    (tmp_path / "lattice.json").write_text(json.dumps({"Al": ["bcc", 9.99]}))
    out = subprocess.run([sys.executable, str(tmp_path / "tool_server.py")],
                         input=json.dumps({"text": "lattice Al\n"}) + "\n", capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out)["observation"] == "bcc 9.99\n"


def test_hkl_by_structure_counts_per_version_bucket():
    import hkl_by_structure as h

    structure_of = {"Al Cu\n": "fcc", "Fe Cu\n": "bcc"}
    rollouts = [
        {"id": "r-1", "prompt": "Al Cu\n", "turns": ["lattice Al\n", "bragg 4.05 111 Cu\n"],
         "reward": 1.0, "versions": [0, 1]},
        {"id": "r-2", "prompt": "Al Cu\n", "turns": ["lattice Al\n", "bragg 4.05 110 Cu\n"],
         "reward": 0.0, "versions": [1, 1]},
        # Malformed bragg calls and rollouts that never got there count as "?".
        {"id": "r-3", "prompt": "Fe Cu\n", "turns": ["lattice Fe\n", "bragg 2.87\n"],
         "reward": 0.0, "versions": [2, 2]},
        {"id": "r-4", "prompt": "Fe Cu\n", "turns": [], "reward": 0.0},
        # Eval rollouts are not the training policy's samples.
        {"id": "x-eval-after-0", "prompt": "Fe Cu\n", "turns": ["lattice Fe\n"],
         "reward": 1.0, "versions": [3, 3]},
    ]
    lines = h.table(rollouts, structure_of, 2)
    assert lines == [
        "v0-1 reward 0.333 n 3 malformed 0.33 | bcc(110) ?:1.00 | fcc(111) 110:0.50 111:0.50",
        "v2-3 reward 0.000 n 1 malformed 1.00 | bcc(110) ?:1.00",
    ]
