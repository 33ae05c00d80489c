#!/usr/bin/env python3
"""Goldens for the committed trained model (models/m3-small, models/m3-small-mxfp8).

  make_small_goldens.py prompts   (needs `tokenizers`)
      writes tests/fixtures/goldens/m3_small_prompts.json: a short prompt from the held-out
      tinyshakespeare text and a 640-token one from the held-out Monte Cristo text (so MSA
      selection is sparse: 20 blocks of 32, top-4).
  make_small_goldens.py oracle [--device cpu|cuda]   (needs torch + transformers >= 5.17)
      runs tools/hf_oracle.py on both model dirs with --meta m3_model_dir=<dir> and --spec-check,
      then keeps the logits of positions p % 16 == 0 and the last 16 only (as
      prompt.i.logit_positions), so each golden stays ~2 MB; writes
      tests/fixtures/goldens/m3_small_{bf16,mxfp8}/golden.safetensors and oracle.log.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FIXTURES = os.path.join(REPO, "tests", "fixtures", "goldens")
PROMPTS = os.path.join(FIXTURES, "m3_small_prompts.json")
MODELS = {"m3_small_bf16": "models/m3-small", "m3_small_mxfp8": "models/m3-small-mxfp8"}
GREEDY = 32


def cmd_prompts(_args):
    sys.path.insert(0, HERE)
    import train_tokenizer as tt
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(REPO, MODELS["m3_small_bf16"], "tokenizer.json"))
    splits = tt.read_splits(tt.default_corpus_dir())
    ts = splits["tinyshakespeare.txt"][1]
    mc = splits["pg1184-monte-cristo.txt"][1]
    s0 = ts.index("\n\n", 2000) + 2
    short = tok.encode(ts[s0:s0 + 400]).ids[:48]
    m0 = mc.index("\n\n“", 10000) + 2
    long = tok.encode(mc[m0:m0 + 4000]).ids[:640]
    with open(PROMPTS, "w") as f:
        json.dump({"vocab": 6144, "greedy_tokens": GREEDY,
                   "source": "held-out split (last 5% of the characters) of tinyshakespeare.txt (short) "
                             "and pg1184-monte-cristo.txt (long)",
                   "prompts": [short, long]}, f)
    print(len(short), len(long))
    print(repr(tok.decode(short)))
    print(repr(tok.decode(long[:80])))
    return 0


def trim(src, dst):
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open
    with safe_open(src, "np") as f:
        meta = f.metadata()
    tensors = load_file(src)
    import numpy as np
    p = 0
    while f"prompt.{p}.input_ids" in tensors:
        T = tensors[f"prompt.{p}.input_ids"].shape[0]
        rows = np.array([t for t in range(T) if t % 16 == 0 or t >= T - 16], dtype=np.int32)
        tensors[f"prompt.{p}.logits"] = np.ascontiguousarray(tensors[f"prompt.{p}.logits"][rows])
        tensors[f"prompt.{p}.logit_positions"] = rows
        p += 1
    meta["logit_positions"] = "p % 16 == 0 or p >= T - 16"
    save_file(tensors, dst, metadata=meta)


def cmd_oracle(args):
    for name, model in MODELS.items():
        out_dir = os.path.join(FIXTURES, name)
        os.makedirs(out_dir, exist_ok=True)
        raw = os.path.join(args.tmp, name + ".full.safetensors")
        cmd = [sys.executable, os.path.join(HERE, "hf_oracle.py"), "--model", os.path.join(REPO, model),
               "--prompts", PROMPTS, "--greedy-tokens", str(GREEDY), "--out", raw, "--spec-check",
               "--meta", f"m3_model_dir={model}"]
        if args.device:
            cmd += ["--device", args.device]
        print("==", " ".join(cmd), flush=True)
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        log = res.stdout + res.stderr
        print(log)
        if res.returncode != 0:
            return res.returncode
        with open(os.path.join(out_dir, "oracle.log"), "w") as f:
            f.write(log.replace(REPO + "/", ""))
        trim(raw, os.path.join(out_dir, "golden.safetensors"))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prompts")
    o = sub.add_parser("oracle")
    o.add_argument("--device", default=None)
    o.add_argument("--tmp", default="/tmp")
    args = ap.parse_args()
    return cmd_prompts(args) if args.cmd == "prompts" else cmd_oracle(args)


if __name__ == "__main__":
    sys.exit(main())
