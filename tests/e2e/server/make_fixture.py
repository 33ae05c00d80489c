#!/usr/bin/env python3
"""Builds the e2e test model: `m3serve make-model --preset tiny` (vocab 512) plus a matching
byte-level BPE tokenizer.json trained with HF `tokenizers` (vocab <= 512, M3 special tokens)
and, when ../shared has it, the M3 chat template.

Usage: make_fixture.py M3SERVE OUT_DIR
Ids 0, 1, 2 are ]!p~[ (pad), ]~!b[ (bos) and [e~[ (eos), as the tiny config expects.
"""
import json
import os
import shutil
import subprocess
import sys

SPECIALS = [
    "]!p~[", "]~!b[", "[e~[", "]~b]", "]!d~[", "<function_call>", "]<]speech[>[", "]<]image[>[",
    "]<]video[>[", "]<]start of image[>[", "]<]end of image[>[", "]<]vision pad[>[",
    "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>", "<mm:think>",
    "</mm:think>", "]<]minimax[>[",
]
NON_SPECIAL = ["<tool_call>", "</tool_call>", "<invoke name=", "</invoke>"]
VOCAB_SIZE = 512

FALLBACK_TEXT = """The quick brown fox jumps over the lazy dog. What is the weather in Paris today?
Please call the tool with the city name. The answer is forty two. Hello, world! How are you?
def add(a, b):\n    return a + b\nThe user asked a question and the assistant replied politely.
"""


def corpus(shared_dir):
    path = os.path.join(shared_dir or "", "data", "corpus", "tinyshakespeare.txt")
    if shared_dir and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()[:200000] + FALLBACK_TEXT * 50
    return FALLBACK_TEXT * 200


def main():
    m3serve, out_dir = sys.argv[1], sys.argv[2]
    stamp = os.path.join(out_dir, ".complete")
    if os.path.exists(stamp):
        return 0
    shutil.rmtree(out_dir, ignore_errors=True)
    subprocess.run([m3serve, "make-model", "--preset", "tiny", "--out", out_dir, "--seed", "7"], check=True,
                   stdout=subprocess.DEVNULL)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(NON_SPECIAL), special_tokens=SPECIALS,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus(os.environ.get("M3_SHARED_DIR"))], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL])
    assert tok.token_to_id("]~!b[") == 1 and tok.token_to_id("[e~[") == 2, "special ids moved"
    assert tok.get_vocab_size(with_added_tokens=True) <= VOCAB_SIZE, tok.get_vocab_size(with_added_tokens=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    template = os.path.join(os.environ.get("M3_SHARED_DIR", ""), "data", "minimax-m3", "chat_template.jinja")
    if os.path.isfile(template):
        shutil.copy(template, os.path.join(out_dir, "chat_template.jinja"))
    with open(stamp, "w") as f:
        f.write("ok\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
