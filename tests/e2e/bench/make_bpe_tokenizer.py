#!/usr/bin/env python3
"""Trains a small byte-level BPE tokenizer (HF `tokenizers`) for the bench CLI test.

Usage: make_bpe_tokenizer.py OUT_DIR [CORPUS_FILE]. Writes OUT_DIR/tokenizer.json; exits 3
when the `tokenizers` package is missing (the test skips).
"""
import os
import sys

try:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
except ImportError:
    sys.exit(3)

out_dir = sys.argv[1]
text = None
if len(sys.argv) > 2 and os.path.exists(sys.argv[2]):
    with open(sys.argv[2], encoding="utf-8", errors="replace") as f:
        text = f.read()[:400000]
if not text:
    words = "the quick brown fox jumps over lazy dog while seven wizards quietly hex jumbled text".split()
    text = "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(4000))
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(text.split("\n"), trainer)
os.makedirs(out_dir, exist_ok=True)
tok.save(os.path.join(out_dir, "tokenizer.json"))
