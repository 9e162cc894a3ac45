"""bragg-engine's tokenizer against Hugging Face `tokenizers` and `transformers` (the peer
environment's pinned versions), through the engine's own HTTP endpoints.

Tokenizers are trained here with `tokenizers` itself on a generated corpus, in the two shapes the
engine reads: Qwen2/Qwen3's (NFC, the Qwen2 split regex, then byte-level) and GPT-2/Llama 3's
(the GPT-2 regex inside ByteLevel, a prefix space, ignore_merges, a BOS template). Each is saved
beside a tiny random checkpoint and served by bragg-engine. Checked:

- /tokenize gives `tokenizers`' ids on hundreds of texts chosen to break a tokenizer (Unicode
  whitespace outside ASCII, combining marks, CJK, emoji sequences, contractions in odd cases,
  special tokens inside words and near-misses of them, long runs, NUL);
- /detokenize gives `tokenizers`' text on random id sequences (characters cut between tokens
  included), with and without special tokens;
- /v1/chat/completions prompts the model with the ids of transformers' apply_chat_template on a
  ChatML template (rendered by transformers, tokenized by the served file): same greedy answer as
  /generate on those ids, and the second request finds the whole prompt in the prefix cache;
- /generate with text answers with `tokenizers`' decoding of its output ids.
"""

import json
import os
import random
import subprocess
import tempfile
import urllib.error
import urllib.request

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers
from transformers import PreTrainedTokenizerFast

ENGINE = os.environ.get("BRAGG_ENGINE")
WRITE = os.environ.get("BRAGG_WRITE_TINY_MODEL")
VOCAB = 1024  # the tiny model's embedding rows: more than any tokenizer here has

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(rng, n):
    words = ["the", "lattice", "constant", "of", "aluminium", "is", "4.05", "Å", "Bragg's", "law",
             "diffraction", "peak", "2θ", "=", "asin(λ/2d)", "def", "return", "x", "+", "1",
             "naïve", "café", "東京", "データ", "😀", "👩‍🔬", "don't", "WE'LL", "it's", "\t", "\n",
             "    ", "if", "(x)", "{", "}", "//", "#", "0xFF", "1e-6", "µm", "Ω", "ß", "İ"]
    for _ in range(n):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))


def train(shape, rng):
    if shape == "qwen2":
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:  # gpt2/llama3
        tok = Tokenizer(models.BPE(ignore_merges=True))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(rng, 3000), trainer)
    tok.add_tokens(["<tool>"])  # an added token that is not special
    if shape == "llama3":
        bos = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                          special_tokens=[("<|endoftext|>", bos)])])
    return tok


def hostile_texts(rng):
    out = ["", " ", "a", "\x00", "hello world", "  leading and trailing  ", "\n\n\n", "\r\n",
           "\t\t x", "\x0b\x0c\x85\xa0\u2028\u2029\u3000 mixed whitespace \u00a0x",
           "e\u0301 vs \u00e9", "\u1e9b\u0323", "I'M HE'S they'Re 'S 's'", "x's's's", "'",
           "<|im_start|>user\nhi<|im_end|>", "<|im_start|<|im_end|><|im_end", "a<tool>b<tool",
           "<|endoftext|><|endoftext|>", "word<|im_end|>word", "123456789012", "3.14159e-10",
           "👩‍🔬👨‍👩‍👧‍👦🏳️‍🌈", "\U0001F600" * 50, "東京タワー データ", "مرحبا بالعالم", "שלום",
           "!" * 5000, " " * 3000 + "x", "\n" * 2000, "ab" * 3000, "İstanbul ß ẞ ǅ", "\ufeffbom",
           "\ud7ff\ue000\uffff", "\U0010ffff", "tab\tand\vvertical", "µΩÅ2θλ"]
    alphabet = ("abcXYZ019 \t\n\r'!?.,;:()[]{}<>|_-+=*/\\\"#$%&@~^`"
                "éüßñ東京データ😀👩🔬\u0301\u0323\u00a0\u2028\x85\x0b\x00\x1c\x1f\u200b\u180e\u2007")
    for _ in range(300):
        out.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))))
    for _ in range(40):
        out.append("".join(rng.choice(SPECIALS + ["<tool>", "<|im", "x", " ", "\n"])
                           for _ in range(rng.randint(1, 12))))
    return out


def post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


@pytest.fixture(scope="module", params=["qwen2", "llama3"])
def served(request):
    if not ENGINE or not WRITE:
        pytest.fail("BRAGG_ENGINE and BRAGG_WRITE_TINY_MODEL must name the built binaries")
    rng = random.Random(11)
    tok = train(request.param, rng)
    with tempfile.TemporaryDirectory(prefix="bragg-tokenizer-") as tmp:
        subprocess.run([WRITE, tmp, "--dense", "--vocab", str(VOCAB), "--eos", "2"], check=True)
        tok.save(os.path.join(tmp, "tokenizer.json"))
        p = subprocess.Popen([ENGINE, "--model", tmp, "--listen", "127.0.0.1:0", "--threads",
                              "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        if not line.startswith("listening on "):
            p.kill()
            pytest.fail(f"bragg-engine did not start: {line!r} {p.stderr.read()}")
        try:
            yield request.param, tok, line.split()[-1]
        finally:
            p.terminate()
            p.wait(timeout=30)


def test_tokenize_matches_tokenizers(served):
    shape, tok, url = served
    texts = hostile_texts(random.Random(5))
    status, out = post(url + "/tokenize", {"prompt": texts})
    assert status == 200, out
    mismatches = []
    for text, ids in zip(texts, out["tokens"]):
        want = tok.encode(text).ids
        if ids != want:
            mismatches.append((text, ids, want))
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, first: {mismatches[0]!r}"
    # add_special_tokens=false leaves the template out (Llama 3's BOS).
    status, out = post(url + "/tokenize", {"prompt": "a b", "add_special_tokens": False})
    assert status == 200 and out["tokens"] == tok.encode("a b", add_special_tokens=False).ids
    if shape == "llama3":
        assert out["tokens"] != tok.encode("a b").ids, "the template added nothing"


def test_detokenize_matches_tokenizers(served):
    _, tok, url = served
    rng = random.Random(9)
    n = tok.get_vocab_size()
    seqs = [[rng.randrange(n) for _ in range(rng.randint(0, 40))] for _ in range(300)]
    seqs += [tok.encode(t).ids for t in hostile_texts(rng)[:60]]
    for skip in (False, True):
        status, out = post(url + "/detokenize", {"tokens": seqs, "skip_special_tokens": skip})
        assert status == 200, out
        for ids, text in zip(seqs, out["text"]):
            assert text == tok.decode(ids, skip_special_tokens=skip), ids


def test_chat_prompt_is_apply_chat_template(served):
    shape, tok, url = served
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHATML)
    messages = [{"role": "system", "content": "You compute Bragg peaks."},
                {"role": "user", "content": "Al Cu: first peak?"},
                {"role": "assistant", "content": "fcc → 111"},
                {"role": "user", "content": "naïve 東京 <tool>"}]
    # transformers renders the template; the file the engine serves tokenizes it. (transformers'
    # own tokenizing is the same for the Qwen shape; for the GPT-2 shape its wrapper turns the
    # file's add_prefix_space off, so it is not the file's tokenizer any more.)
    rendered = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(rendered, add_special_tokens=False).ids
    if shape == "qwen2":
        assert ids == fast.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True)
    end = tok.token_to_id("<|im_end|>")
    status, chat = post(url + "/v1/chat/completions",
                        {"messages": messages, "max_tokens": 12, "temperature": 0})
    assert status == 200, chat
    assert chat["usage"]["prompt_tokens"] == len(ids)
    status, gen = post(url + "/generate",
                       {"input_ids": ids, "sampling_params": {"max_new_tokens": 12,
                                                              "temperature": 0,
                                                              "stop_token_ids": [end]}})
    assert status == 200, gen
    # Same prompt ids: the whole prompt but its last token comes from the chat request's cache.
    assert gen["meta_info"]["cached_tokens"] >= len(ids) - 1, gen["meta_info"]
    assert chat["choices"][0]["output_ids"] == gen["output_ids"]
    assert chat["choices"][0]["message"]["content"] == tok.decode(gen["output_ids"],
                                                                  skip_special_tokens=True)
    # No max_tokens: as long as the context allows, never refused for it.
    status, chat = post(url + "/v1/chat/completions",
                        {"messages": messages, "temperature": 0, "ignore_eos": True})
    assert status == 200, chat
    assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + len(
        chat["choices"][0]["output_ids"])
    assert chat["choices"][0]["finish_reason"] in ("length", "stop"), chat


def test_generate_text_decodes_as_tokenizers(served):
    _, tok, url = served
    status, out = post(url + "/generate", {"text": ["Bragg's law: 2θ =", "東京"],
                                           "sampling_params": {"max_new_tokens": 24,
                                                               "temperature": 0}})
    assert status == 200, out
    for prompt, answer in zip(["Bragg's law: 2θ =", "東京"], out):
        assert answer["meta_info"]["prompt_tokens"] == len(tok.encode(prompt).ids)
        assert answer["text"] == tok.decode(answer["output_ids"], skip_special_tokens=True)
    status, out = post(url + "/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "skip_special_tokens": False}})
    assert status == 200 and out["text"] == tok.decode(out["output_ids"], skip_special_tokens=False)


def start_engine(argv):
    p = subprocess.Popen([ENGINE] + argv + ["--listen", "127.0.0.1:0", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    return p, line


def test_tokenizers_it_cannot_read(tmp_path):
    """The model directory's own unreadable tokenizer leaves ids served with a warning; one named
    with --tokenizer-path must load; --skip-tokenizer-init serves ids only."""
    model = str(tmp_path / "m")
    subprocess.run([WRITE, model, "--dense", "--vocab", str(VOCAB)], check=True)
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.save(os.path.join(model, "tokenizer.json"))

    p, line = start_engine(["--model", model])
    try:
        assert line.startswith("listening on "), line
        url = line.split()[-1]
        status, out = post(url + "/tokenize", {"prompt": "a"})
        assert status == 400 and "no tokenizer" in out["error"]["message"], out
        status, out = post(url + "/generate", {"input_ids": [1, 2],
                                               "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and len(out["output_ids"]) == 2, out
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert "serving token ids only" in err and "model is not supported (type WordPiece)" in err, err

    p, line = start_engine(["--model", model, "--tokenizer-path", model])
    _, err = p.communicate(timeout=30)
    assert p.returncode == 2 and not line, line
    assert "WordPiece" in err and "--skip-tokenizer-init" in err, err

    good = train("qwen2", random.Random(3))
    good.save(os.path.join(model, "tokenizer.json"))
    p, line = start_engine(["--model", model, "--skip-tokenizer-init"])
    try:
        assert line.startswith("listening on "), line
        status, out = post(line.split()[-1] + "/generate", {"text": "a"})
        assert status == 400 and "no tokenizer" in out["error"]["message"], out
    finally:
        p.terminate()
        p.wait(timeout=30)
