#!/usr/bin/env python3
"""Held-out perplexity of an exported m3-small directory through HF transformers (fp32, eager,
real MSA selection), loading the checkpoint exactly as tools/hf_oracle.py does.

Usage: eval_small_model.py --model models/m3-small [--model models/m3-small-mxfp8] --data .dev/trained/data
       [--device cpu] [--context 1024] [--out result.json]
The held-out stream (val.bin from train_small_model.py prepare) is cut into non-overlapping
windows of --context tokens, each scored from position 0 (same windows as training's val loss).
"""
import argparse
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_oracle  # noqa: E402
import torch  # noqa: E402


def perplexity(model_dir, val, context, device):
    config, info = hf_oracle.load_config(model_dir, [])
    model = hf_oracle.build_model(config, device)
    ckpt = hf_oracle.Checkpoint(model_dir)
    hf_oracle.load_weights_manually(model, ckpt, info["quant"], device)
    n = val.size // context
    x = torch.from_numpy(val[: n * context].astype(np.int64)).view(n, context)
    y = torch.from_numpy(val[1: n * context + 1].astype(np.int64)).view(n, context)
    total = 0.0
    with torch.no_grad():
        for i in range(n):
            logits = model(input_ids=x[i:i + 1].to(device)).logits.float()
            total += torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y[i].to(device),
                                                       reduction="sum").item()
    loss = total / (n * context)
    return {"model": model_dir, "windows": n, "tokens": n * context, "loss": loss, "ppl": math.exp(loss)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_float32_matmul_precision("highest")
    val = np.fromfile(os.path.join(args.data, "val.bin"), dtype=np.uint16)
    res = [perplexity(m, val, args.context, args.device) for m in args.model]
    for r in res:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
