#!/usr/bin/env python3
"""Trains a small byte-level BPE with HF `tokenizers` and writes goldens for the C++ tests.

Usage: make_tokenizer_goldens.py CORPUS_DIR OUT_DIR

Writes OUT_DIR/json_split/tokenizer.json      (Split(regex) + ByteLevel, merges as lists),
       OUT_DIR/json_o200k/tokenizer.json      (o200k-style Split + ByteLevel),
       OUT_DIR/json_prefix_space/tokenizer.json (ByteLevel with add_prefix_space),
       OUT_DIR/json_ignore_merges/tokenizer.json (json_split with model.ignore_merges),
       OUT_DIR/json_bytelevel/tokenizer.json  (ByteLevel with its regex, merges as "a b"),
       OUT_DIR/vocab_merges/{vocab.json,merges.txt,tokenizer_config.json},
       OUT_DIR/goldens.json                   (hex strings and expected ids / decodes).
When the corpus or the `tokenizers` package is missing it writes OUT_DIR/SKIP with the
reason instead, and the C++ test skips with that message.
"""
import json
import os
import random
import sys

# M3 specials (architecture doc 5.1) plus a stripping one; non-special added tokens below.
SPECIALS = [
    "]!p~[", "]~b]", "[e~[", "]!d~[", "<function_call>", "]<]speech[>[", "]<]image[>[",
    "]<]video[>[", "]<]start of image[>[", "]<]end of image[>[", "]<]vision pad[>[", "]~!b[",
    "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>", "<mm:think>",
    "</mm:think>", "]<]minimax[>[",
]
NON_SPECIAL = ["<tool_call>", "</tool_call>", "<invoke name=", "</invoke>"]
STRIPPED = "<|strip|>"
# o200k-style: case classes, marks, possessive quantifiers (PCRE2 and Oniguruma both have them).
O200K_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def skip(out_dir, reason):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "SKIP"), "w") as f:
        f.write(reason)
    print("skip:", reason)
    return 0


def corpus_files(corpus_dir):
    return sorted(os.path.join(corpus_dir, n) for n in os.listdir(corpus_dir) if n.endswith(".txt"))


def build_cases(corpus_dir, rng):
    cases = []  # raw bytes
    for path in corpus_files(corpus_dir):
        with open(path, "rb") as f:
            data = f.read()
        lines = [l for l in data.split(b"\n") if l.strip()]
        cases += rng.sample(lines, min(700, len(lines)))
        for _ in range(150):  # multi-line chunks with blank lines and indentation
            start = rng.randrange(0, len(data) - 600)
            cases.append(data[start:start + rng.randrange(50, 600)])
    fixed = [
        "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "a  b   c    d", "trailing   ",
        "   leading", "x\r\ny\r\n\r\nz", "line1\n  line2\n\tline3", "I'm they'LL DON'T we've",
        "12345678901234567890", "3.14159 2.71828 -42 +7 1,000,000 1e-9 0x1F", "版本 2026年1月",
        "你好，世界！这是一个测试。", "日本語のテキストとカタカナ", "한국어 문장입니다",
        "Привет, мир! Ёжик", "مرحبا بالعالم", "नमस्ते दुनिया", "ελληνικά γράμματα",
        "emoji 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️", "e\u0301 a\u0308 combining", "\u00a0nbsp\u2003em\u3000ideo",
        "zero\u200bwidth", "mixed English中文日本語Русский123😀", "tabs\tand\u000bvt\u000cff",
        "]~!b[]~b]system\nYou are helpful.[e~[\n]~b]user\nhi[e~[\n]~b]ai\n<mm:think>",
        "<mm:think>reasoning</mm:think>answer", "</mm:think>stray", "<mm:think", "mm:think>",
        "]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name=\"f\">]<]minimax[>[<a>1]<]minimax[>[</a>",
        "]<]minimax[>[</invoke>\n]<]minimax[>[</tool_call>[e~[", "]~b]]~b]]~b]", "]~b", "[e~[[e~",
        "<think>x</think><minimax:tool_call>", "text <|strip|>  after", "a   <|strip|>\nb",
        "<|strip|><|strip|>", "]<]start of image[>[]<]image[>[]<]end of image[>[", "<function_call>{}",
        "<tool_call></tool_call><invoke name=\"x\"></invoke>", "]!p~[]!d~[", "{\"a\": [1, 2, {\"b\": null}]}",
        "def f(x):\n    return x ** 2  # square\n", "<html><body>&amp;&lt;</body></html>",
        "https://example.com/path?q=1&r=two#frag", "CamelCaseWordsAndALLCAPS snake_case_words",
        "!!!???...,,,;;;", "$$$ €€€ £££ ¥¥¥", "--- *** ___ ===", "'s 't 're 've 'm 'll 'd",
        "'S 'T 'RE", "a'b'c", "  \n  \n", "x" * 300, "ab" * 200, " " * 100, "\n" * 50,
        "😀" * 40, "中" * 120,
    ]
    cases += [s.encode("utf-8") for s in fixed]
    invalid = [b"\xff", b"\xc3", b"abc\x80def", b"\xe4\xbd", b"\xe4\xbd\xa0\xe5", b"\xf0\x9f\x98",
               b"\xed\xa0\x80 surrogate", b"\xc0\xaf overlong", b"\xf5\x80\x80\x80", b"\xf4\x90\x80\x80",
               b"ok\xe0\x80\xafok", b"\xfe\xfe]~b]\xff", b"\x00nul\x00", b"\xe2\x82"]
    cases += invalid
    alphabet = ("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789 \n\t.,;:'\"!?-_()[]{}<>/\\|~"
                "éüñßçøå中文字日本한국😀👍🏽ΩЖ\u200b\u00a0\u3000")
    for _ in range(600):
        n = rng.randrange(1, 40)
        s = "".join(rng.choice(alphabet) for _ in range(n))
        if rng.random() < 0.3:
            pos = rng.randrange(0, len(s) + 1)
            s = s[:pos] + rng.choice(SPECIALS + NON_SPECIAL + [STRIPPED]) + s[pos:]
        cases.append(s.encode("utf-8"))
    for _ in range(200):  # random bytes: mostly invalid UTF-8
        cases.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 24))))
    return cases


def main():
    corpus_dir, out_dir = sys.argv[1], sys.argv[2]
    if not os.path.isdir(corpus_dir) and os.environ.get("M3_SHARED_DIR"):
        # A worktree outside the main checkout's parent: take the shared dir from the env.
        corpus_dir = os.path.join(os.environ["M3_SHARED_DIR"], "data", "corpus")
    if not os.path.isdir(corpus_dir) or not corpus_files(corpus_dir):
        return skip(out_dir, "corpus not found at " + corpus_dir)
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        return skip(out_dir, "python package 'tokenizers' not importable: %s" % e)
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(os.path.join(out_dir, "SKIP")):
        os.remove(os.path.join(out_dir, "SKIP"))
    rng = random.Random(1234)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus_files(corpus_dir), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL])
    tok.add_special_tokens([AddedToken(STRIPPED, lstrip=True, rstrip=True, special=True)])

    # Variant B: plain ByteLevel, merges rewritten in the older "a b" string form.
    bytelevel_dir = os.path.join(out_dir, "json_bytelevel")
    os.makedirs(bytelevel_dir, exist_ok=True)
    spec = json.loads(tok.to_str())
    spec["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    with open(os.path.join(bytelevel_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    tok_b = Tokenizer.from_file(os.path.join(bytelevel_dir, "tokenizer.json"))

    # Variant A: Split(regex) + ByteLevel(use_regex=False), merges as lists.
    split_dir = os.path.join(out_dir, "json_split")
    os.makedirs(split_dir, exist_ok=True)
    tok_a = Tokenizer.from_str(tok.to_str())
    tok_a.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok_a.save(os.path.join(split_dir, "tokenizer.json"))

    # Variant D: o200k-style Split (possessive quantifiers, \p{Lu}/\p{M}) + ByteLevel.
    o200k_dir = os.path.join(out_dir, "json_o200k")
    os.makedirs(o200k_dir, exist_ok=True)
    tok_d = Tokenizer.from_str(tok.to_str())
    tok_d.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok_d.save(os.path.join(o200k_dir, "tokenizer.json"))

    # Variant E: ByteLevel with add_prefix_space (a space before every non-added segment).
    prefix_dir = os.path.join(out_dir, "json_prefix_space")
    os.makedirs(prefix_dir, exist_ok=True)
    tok_e = Tokenizer.from_str(tok.to_str())
    tok_e.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok_e.save(os.path.join(prefix_dir, "tokenizer.json"))

    # Variant F: ignore_merges (a word that is itself in the vocab is one token).
    ignore_dir = os.path.join(out_dir, "json_ignore_merges")
    os.makedirs(ignore_dir, exist_ok=True)
    spec_f = json.loads(tok_a.to_str())
    spec_f["model"]["ignore_merges"] = True
    # Without some merges many vocab words are unreachable by merging, so the whole-word
    # lookup decides the result.
    spec_f["model"]["merges"] = [m for i, m in enumerate(spec_f["model"]["merges"]) if i % 5 != 3]
    with open(os.path.join(ignore_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(spec_f, f, ensure_ascii=False)
    tok_f = Tokenizer.from_file(os.path.join(ignore_dir, "tokenizer.json"))

    # Variant C: vocab.json + merges.txt + added tokens in tokenizer_config.json (same ids as B).
    vm_dir = os.path.join(out_dir, "vocab_merges")
    os.makedirs(vm_dir, exist_ok=True)
    tok.model.save(vm_dir)
    decoder = {}
    for entry in spec["added_tokens"]:
        decoder[str(entry["id"])] = {k: entry[k] for k in
                                    ("content", "lstrip", "rstrip", "normalized", "single_word", "special")}
    with open(os.path.join(vm_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"added_tokens_decoder": decoder}, f, ensure_ascii=False)

    raw_cases = build_cases(corpus_dir, rng)
    texts = [c.decode("utf-8", errors="replace") for c in raw_cases]
    enc_a = [e.ids for e in tok_a.encode_batch(texts, add_special_tokens=False)]
    enc_b = [e.ids for e in tok_b.encode_batch(texts, add_special_tokens=False)]
    enc_d = [e.ids for e in tok_d.encode_batch(texts, add_special_tokens=False)]
    enc_e = [e.ids for e in tok_e.encode_batch(texts, add_special_tokens=False)]
    enc_f = [e.ids for e in tok_f.encode_batch(texts, add_special_tokens=False)]
    tok_b.encode_special_tokens = True
    enc_b_plain = [e.ids for e in tok_b.encode_batch(texts, add_special_tokens=False)]
    tok_b.encode_special_tokens = False

    cases = []
    for raw, text, a, b, d, e, f_ids, plain in zip(raw_cases, texts, enc_a, enc_b, enc_d, enc_e, enc_f,
                                                   enc_b_plain):
        case = {"hex": raw.hex(), "split": a, "bytelevel": b, "o200k": d, "prefix_space": e,
                "ignore_merges": f_ids, "bytelevel_no_special": plain}
        decoded = tok_b.decode(b, skip_special_tokens=False)
        if decoded != text:  # stripping added tokens swallow whitespace
            case["decoded_hex"] = decoded.encode("utf-8").hex()
        cases.append(case)

    vocab_size = tok_b.get_vocab_size(with_added_tokens=True)
    special_ids = [tok_b.token_to_id(t) for t in SPECIALS]
    decodes = []
    for _ in range(400):  # random id sequences: split UTF-8 sequences, specials, added tokens
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 12))]
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special_ids))
        decodes.append({
            "ids": ids,
            "text": tok_b.decode(ids, skip_special_tokens=False).encode("utf-8").hex(),
            "text_skip": tok_b.decode(ids, skip_special_tokens=True).encode("utf-8").hex(),
        })
    with open(os.path.join(out_dir, "goldens.json"), "w") as f:
        json.dump({"vocab_size": vocab_size, "cases": cases, "decodes": decodes}, f)
    print("wrote %d encode cases and %d decode cases to %s" % (len(cases), len(decodes), out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
