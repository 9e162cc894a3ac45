#!/usr/bin/env python3
"""Writes the xrd task's data: its prompts, its held-out prompts and the warm-start traces.

    make_data.py --out DIR [--seed N] [--warm N]     writes DIR/prompts.jsonl, heldout.jsonl,
                                                     warm.jsonl, then checks them
    make_data.py --check DIR                         checks files written before

A prompt is one (element, tube) pair, "Al Cu\\n", with meta {"element", "tube", "structure",
"hkl", "two_theta"}. About 15% of the pairs are held out, per structure (each structure has
held-out pairs, and every element and tube keeps train pairs: a character model cannot copy a
symbol it never saw). warm.jsonl holds supervised traces in bragg-train's trajectory format
(docs/train.md) from a deliberately wrong demonstrator: everything but the hkl is right, and its
hkl follows DEMONSTRATOR, a per-structure habit whose most likely choice is wrong in every
structure (right 30% of the time). The warm-started model thus reads the structure word before
choosing (it has to, to copy the habit), earns reward about 0.3 sampled (greedy 0.26 on
held-out pairs, measured), and what RL has to learn is to move each structure's choice,
separately, to its right reflection. The same seed writes the same files.
"""

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "sandbox"))

import tool_server as ts  # noqa: E402
from tool_server import FIRST_HKL, HKLS, STRUCTURES, TUBES  # noqa: E402

HELDOUT_FRACTION = 0.15

# The demonstrator's hkl per structure: P(hkl). The right one (FIRST_HKL) 0.3, a wrong habit 0.5.
DEMONSTRATOR = {
    "fcc": {"111": 0.3, "110": 0.5, "100": 0.2},
    "diamond": {"111": 0.3, "100": 0.5, "110": 0.2},
    "bcc": {"110": 0.3, "111": 0.5, "100": 0.2},
    "sc": {"100": 0.3, "110": 0.5, "111": 0.2},
}


class Vocab:
    """The task's character-level vocabulary (vocab.json): token i is entry i."""

    def __init__(self, path=os.path.join(HERE, "vocab.json")):
        with open(path) as f:
            self.tokens = json.load(f)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.longest = max(len(t) for t in self.tokens)

    def encode(self, text):
        """Greedy longest match; ValueError on a character the vocabulary lacks."""
        out, i = [], 0
        while i < len(text):
            for n in range(min(self.longest, len(text) - i), 0, -1):
                if text[i:i + n] in self.ids:
                    out.append(self.ids[text[i:i + n]])
                    i += n
                    break
            else:
                raise ValueError("no token for %r at %d in %r" % (text[i], i, text))
        return out

    def decode(self, ids):
        return "".join(self.tokens[i] for i in ids)


def all_pairs(table):
    """Every (element, tube) with a first peak, as prompt records, in atomic-number order."""
    pairs = []
    for element in table:
        for tube in TUBES:
            peak = ts.first_peak(table, element, tube)
            if peak is None:
                continue
            structure, hkl, two_theta = peak
            pairs.append({"prompt": "%s %s\n" % (element, tube),
                          "meta": {"element": element, "tube": tube, "structure": structure,
                                   "hkl": hkl, "two_theta": two_theta}})
    return pairs


def split_pairs(pairs, rng):
    """(train, heldout): per structure about HELDOUT_FRACTION of its pairs (at least one), never
    an element's or a tube's last train pair."""
    train_count = {}
    for p in pairs:
        for key in (p["meta"]["element"], p["meta"]["tube"]):
            train_count[key] = train_count.get(key, 0) + 1
    held = set()
    for structure in STRUCTURES:
        members = [i for i, p in enumerate(pairs) if p["meta"]["structure"] == structure]
        want = max(1, round(HELDOUT_FRACTION * len(members)))
        rng.shuffle(members)
        for i in members:
            if want == 0:
                break
            element, tube = pairs[i]["meta"]["element"], pairs[i]["meta"]["tube"]
            if train_count[element] > 1 and train_count[tube] > 1:
                held.add(i)
                train_count[element] -= 1
                train_count[tube] -= 1
                want -= 1
    train = [p for i, p in enumerate(pairs) if i not in held]
    heldout = [p for i, p in enumerate(pairs) if i in held]
    return train, heldout


def demonstration(table, pair, hkl):
    """(prompt, model turns, observations, reward) of the demonstrator on one pair with hkl."""
    element, tube = pair["meta"]["element"], pair["meta"]["tube"]
    structure, a = table[element]
    a_text = ts.format_a(a)
    x = ts.two_theta(float(a_text), hkl, tube)
    if x is None:
        raise ValueError("%s %s has no reflection %s: the demonstrator needs one" %
                         (element, tube, hkl))
    answer = ts.format_two_theta(x)
    turns = ["lattice %s\n" % element, "bragg %s %s %s\n" % (a_text, hkl, tube),
             "answer %s\n" % answer]
    observations = ["%s %s\n" % (structure, a_text), answer + "\n"]
    reward = 1 if abs(float(answer) - pair["meta"]["two_theta"]) <= 0.01 + 1e-9 else 0
    return pair["prompt"], turns, observations, reward


def trace(vocab, trace_id, prompt, turns, observations, reward):
    """One trajectory: loss on the model's turns (with their "\\n"), none elsewhere."""
    tokens = vocab.encode(prompt)
    mask = [0] * len(tokens)
    for i, turn in enumerate(turns):
        ids = vocab.encode(turn)
        tokens += ids
        mask += [1] * len(ids)
        if i < len(observations):
            ids = vocab.encode(observations[i])
            tokens += ids
            mask += [0] * len(ids)
    return {"id": trace_id, "group": "", "tokens": tokens, "loss_mask": mask,
            "logprobs": [0.0] * len(tokens), "reward": reward}


def warm_traces(table, vocab, train, n, rng):
    """n demonstrator traces from train pairs, the structures taken in turn."""
    by_structure = {s: [p for p in train if p["meta"]["structure"] == s] for s in STRUCTURES}
    out = []
    for i in range(n):
        pair = rng.choice(by_structure[STRUCTURES[i % len(STRUCTURES)]])
        habit = DEMONSTRATOR[pair["meta"]["structure"]]
        hkl = rng.choices(HKLS, weights=[habit[h] for h in HKLS])[0]
        out.append(trace(vocab, "warm-%05d" % i, *demonstration(table, pair, hkl)))
    return out


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def check(out_dir, vocab=None):
    """Asserts the files' invariants; returns a summary dict. AssertionError names the broken
    one."""
    vocab = vocab or Vocab()
    table = ts.lattice_table()
    train = read_jsonl(os.path.join(out_dir, "prompts.jsonl"))
    heldout = read_jsonl(os.path.join(out_dir, "heldout.jsonl"))
    warm = read_jsonl(os.path.join(out_dir, "warm.jsonl"))
    train_prompts = {p["prompt"] for p in train}
    by_prompt = {p["prompt"]: p for p in train}
    heldout_prompts = {p["prompt"] for p in heldout}
    assert len(train_prompts) == len(train) and len(heldout_prompts) == len(heldout), "duplicates"
    assert not train_prompts & heldout_prompts, "held-out pairs in train"
    assert {p["prompt"] for p in all_pairs(table)} == train_prompts | heldout_prompts, \
        "train and held-out do not make up every pair"
    for records in (train, heldout):
        assert {p["meta"]["structure"] for p in records} == set(STRUCTURES), \
            "a structure lacks pairs"
    for p in train + heldout:
        m = p["meta"]
        assert p["prompt"] == "%s %s\n" % (m["element"], m["tube"]), p
        assert ts.first_peak(table, m["element"], m["tube"]) == \
            (m["structure"], m["hkl"], m["two_theta"]), p
        assert m["hkl"] == FIRST_HKL[m["structure"]], p
    train_elements = {p["meta"]["element"] for p in train}
    assert train_elements == set(table), "an element has no train pair"
    assert {p["meta"]["tube"] for p in train} == set(TUBES), "a tube has no train pair"
    structure_count = {}
    for t in warm:
        tokens, mask = t["tokens"], t["loss_mask"]
        assert len(tokens) == len(mask) == len(t["logprobs"]) and mask[0] == 0, t["id"]
        assert all(0 <= x < len(vocab.tokens) for x in tokens), t["id"]
        text = vocab.decode(tokens)
        assert vocab.encode(text) == tokens, t["id"]
        prompt = text[:text.index("\n") + 1]
        assert prompt in train_prompts, "warm trace %s uses prompt %r" % (t["id"], prompt)
        # The loss-carrying spans are exactly the model's turns, each ending in "\n".
        turns, current = [], ""
        for x, m in zip(tokens, mask):
            if m:
                current += vocab.tokens[x]
            elif current:
                turns.append(current)
                current = ""
        turns.append(current)
        assert len(turns) == 3 and all(s.endswith("\n") and s.count("\n") == 1 for s in turns), \
            (t["id"], turns)
        element = prompt.split(" ")[0]
        assert turns[0] == "lattice %s\n" % element and turns[2].startswith("answer "), t["id"]
        _, _, observations, reward = demonstration(table, by_prompt[prompt],
                                                   turns[1].split(" ")[2])
        assert text == "".join([prompt, turns[0], observations[0], turns[1], observations[1],
                                turns[2]]), t["id"]
        assert t["reward"] == reward, t["id"]
        structure = table[element][0]
        structure_count[structure] = structure_count.get(structure, 0) + 1
    rate = sum(t["reward"] for t in warm) / len(warm) if warm else 0.0
    return {"train": len(train), "heldout": len(heldout), "warm": len(warm),
            "warm_reward": rate, "warm_by_structure": structure_count,
            "heldout_by_structure": {s: sum(p["meta"]["structure"] == s for p in heldout)
                                     for s in STRUCTURES}}


def make(out_dir, seed, n_warm):
    table = ts.lattice_table()
    vocab = Vocab()
    rng = random.Random(seed)
    train, heldout = split_pairs(all_pairs(table), rng)
    os.makedirs(out_dir, exist_ok=True)
    write_jsonl(os.path.join(out_dir, "prompts.jsonl"), train)
    write_jsonl(os.path.join(out_dir, "heldout.jsonl"), heldout)
    write_jsonl(os.path.join(out_dir, "warm.jsonl"), warm_traces(table, vocab, train, n_warm, rng))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="directory to write prompts.jsonl, heldout.jsonl, "
                        "warm.jsonl into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm", type=int, default=2000, help="warm-start traces to write")
    parser.add_argument("--check", metavar="DIR", help="only check files written before")
    args = parser.parse_args()
    if bool(args.out) == bool(args.check):
        parser.error("give exactly one of --out and --check")
    if args.warm < 0:
        parser.error("--warm must be >= 0")
    if args.out:
        make(args.out, args.seed, args.warm)
    summary = check(args.check or args.out)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
