#!/usr/bin/env python3
"""Trains the byte-level BPE tokenizer of the small M3-architecture model (models/m3-small).

Usage: train_tokenizer.py [--corpus DIR] [--out DIR]
       (defaults: $M3_SHARED_DIR/data/corpus or ../shared/data/corpus, models/m3-small)

Corpus: pg1184-monte-cristo.txt and tinyshakespeare.txt. Held-out split: the LAST 5% of
each file, counted in Python characters (code points) after UTF-8 decoding, is never
seen by the tokenizer or the model; `split_text()` below is the single definition and
tools/train_small_model.py imports it.

Vocabulary: 6144 ids in total. Ids 0..20 are the M3 specials/added tokens of
m3-architecture.md 5.1 in that order (then `]<]minimax[>[`, the tool namespace the chat
template writes before every tool tag), then 256 byte tokens, then merges.
Control tokens (pad, role start, eos, unk, bos, function_call, media placeholders) are
special; the think tags, the tool-call tags and the namespace are added tokens that are
matched whole but not special, so decoding with skip_special keeps them for the
reasoning and tool parsers. No normalizer; ByteLevel pre-tokenizer with the GPT-2 regex.
"""
import argparse
import json
import os
import shutil
import sys

VOCAB_SIZE = 6144
HELDOUT_FRACTION = 0.05
CORPUS_FILES = ["pg1184-monte-cristo.txt", "tinyshakespeare.txt"]
MODEL_MAX_LENGTH = 4096

# (content, special) in id order.
ADDED_TOKENS = [
    ("]!p~[", True),                 # pad
    ("]~b]", True),                  # role start
    ("[e~[", True),                  # end of message = eos
    ("]!d~[", True),                 # unk
    ("<function_call>", True),
    ("]<]speech[>[", True),
    ("]<]image[>[", True),
    ("]<]video[>[", True),
    ("]<]start of image[>[", True),
    ("]<]end of image[>[", True),
    ("]<]start of video[>[", True),
    ("]<]end of video[>[", True),
    ("]<]vision pad[>[", True),
    ("]~!b[", True),                 # bos / begin of document
    ("<think>", False),
    ("</think>", False),
    ("<minimax:tool_call>", False),
    ("</minimax:tool_call>", False),
    ("<mm:think>", False),
    ("</mm:think>", False),
    ("]<]minimax[>[", False),        # tool namespace
]
PAD, ROLE, EOS, UNK, BOS = "]!p~[", "]~b]", "[e~[", "]!d~[", "]~!b["


def repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_corpus_dir():
    if "M3_SHARED_DIR" in os.environ:
        return os.path.join(os.environ["M3_SHARED_DIR"], "data", "corpus")
    for up in ("..", os.path.join("..", "..")):  # checkout or worktree next to shared/
        cand = os.path.join(repo_root(), up, "shared", "data", "corpus")
        if os.path.isdir(cand):
            return os.path.normpath(cand)
    return "/work/shared/data/corpus"


def split_text(text):
    """(train, heldout): heldout = the last 5% of the characters."""
    cut = len(text) - int(len(text) * HELDOUT_FRACTION)
    return text[:cut], text[cut:]


def read_splits(corpus_dir):
    """{file name: (train text, heldout text)} for every corpus file."""
    out = {}
    for name in CORPUS_FILES:
        with open(os.path.join(corpus_dir, name), encoding="utf-8") as f:
            out[name] = split_text(f.read())
    return out


def train(corpus_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers, AddedToken
    splits = read_splits(corpus_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(c, special=s, normalized=False) for c, s in ADDED_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def chunks():  # paragraphs keep each training sequence small
        for train_text, _ in splits.values():
            for para in train_text.split("\n\n"):
                yield para + "\n\n"
    tok.train_from_iterator(chunks(), trainer)
    # Added tokens came first (ids 0..20); re-add with the right `special` flags.
    for i, (content, _) in enumerate(ADDED_TOKENS):
        assert tok.token_to_id(content) == i, (content, tok.token_to_id(content))
    return tok


def fix_special_flags(path):
    """The trainer marks every token it is given as special; restore our flags."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    flags = dict(ADDED_TOKENS)
    for entry in data["added_tokens"]:
        entry["special"] = flags[entry["content"]]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)


def write_config(out_dir, template_path):
    with open(template_path, encoding="utf-8") as f:
        template = f.read()
    decoder = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": s}
               for i, (c, s) in enumerate(ADDED_TOKENS)}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": decoder,
        "chat_template": template,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=1)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK},
                  f, indent=1)
    shutil.copyfile(template_path, os.path.join(out_dir, "chat_template.jinja"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default=default_corpus_dir())
    ap.add_argument("--out", default=os.path.join(repo_root(), "models", "m3-small"))
    ap.add_argument("--template", default=None,
                    help="chat template (default: <corpus>/../minimax-m3/chat_template.jinja)")
    args = ap.parse_args()
    template = args.template or os.path.join(args.corpus, "..", "minimax-m3", "chat_template.jinja")
    os.makedirs(args.out, exist_ok=True)
    tok = train(args.corpus)
    path = os.path.join(args.out, "tokenizer.json")
    tok.save(path)
    fix_special_flags(path)
    write_config(args.out, template)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(path)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    splits = read_splits(args.corpus)
    for name, (tr, ho) in splits.items():
        n = len(tok.encode(ho).ids)
        print(f"{name}: train {len(tr)} chars, heldout {len(ho)} chars = {n} tokens "
              f"({len(ho.encode('utf-8')) / n:.2f} bytes/token)")
    print("wrote", args.out, "vocab", tok.get_vocab_size())
    return 0


if __name__ == "__main__":
    sys.exit(main())
