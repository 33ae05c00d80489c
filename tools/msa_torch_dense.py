#!/usr/bin/env python3
"""Dense attention on msa_bench's shapes with PyTorch SDPA, to show what MSA saves.

M3 TP1 shapes: 64 query heads, 4 KV heads (GQA), head_dim 128, BF16. Decode: B sequences of
`context` cached tokens, one query each. Prefill: one sequence of `context` tokens, causal.
Each backend (flash, cuDNN, memory-efficient) is tried alone; shapes it refuses are reported
as such. GPU time per call from CUDA events around a CUDA-graph replay (eager when capture
fails), L2 flushed before each as msa_bench does (a 256 MB read; M3_BENCH_FLUSH=memset for a
256 MB write), median of --iters. Prints a table, writes JSON.
Never fails the caller: without torch or a GPU it says so and exits 0.

  tools/msa_torch_dense.py [--contexts 2048,8192,32768,131072] [--batches 1,8,64]
                           [--prefill 8192,32768] [--iters 20] [--max-gb 60] [--json F]
"""
import argparse
import os
import json
import statistics
import sys


def parse_list(s):
    return [int(x) for x in s.split(",") if x.strip()] if s and s != "none" else []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="2048,8192,32768,131072")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill", default="8192,32768")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-gb", type=float, default=60)
    ap.add_argument("--json", default="msa_torch_dense.json")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:  # noqa: BLE001 - any import problem means "no comparison"
        print(f"msa_torch_dense: torch with SDPA backends not available ({e}); skipped")
        return 0
    if not torch.cuda.is_available():
        print("msa_torch_dense: no CUDA device; skipped")
        return 0

    dev = torch.device("cuda")
    hq, hkv, d = 64, 4, 128
    flush = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    flush_mode = os.environ.get("M3_BENCH_FLUSH", "read")

    def flush_l2(i):
        # A read leaves L2 holding clean lines (tools/gpu_bench_flush.h); a write leaves them dirty.
        if flush_mode == "memset":
            flush.fill_(i & 0xFF)
        else:
            flush.view(torch.int64).sum()
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]

    def timed(fn, iters):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up (and the error, if the backend refuses the shape)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        run = fn
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        except Exception:  # noqa: BLE001 - eager timing then
            torch.cuda.synchronize()
        times = []
        for i in range(iters + 2):
            flush_l2(i)
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            run()
            e1.record()
            e1.synchronize()
            if i >= 2:
                times.append(e0.elapsed_time(e1) * 1e3)
        return statistics.median(times), run is not fn

    def attend(q, k, v, causal, backend):
        def fn():
            with sdpa_kernel(backend):
                try:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                except TypeError:  # torch < 2.5: no enable_gqa
                    rep = q.shape[1] // k.shape[1]
                    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                          is_causal=causal)
        return fn

    rows = []
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    print(f"\n{'mode':<8} {'context':>7} {'B':>4} | " + " ".join(f"{n + '_us':>12}" for n, _ in backends) + " | TFLOP/s(best)")
    cases = [("decode", c, b) for c in parse_list(args.contexts) for b in parse_list(args.batches)]
    cases += [("prefill", c, 1) for c in parse_list(args.prefill)]
    for mode, ctx, b in cases:
        tq = 1 if mode == "decode" else ctx
        need = b * hkv * ctx * d * 2 * 2 + b * hq * tq * d * 2 * 2
        row = {"mode": mode, "context": ctx, "batch": b}
        if need > args.max_gb * 1e9:
            row["skipped"] = f"needs {need / 1e9:.1f} GB"
            rows.append(row)
            print(f"{mode:<8} {ctx:>7} {b:>4} | skipped ({row['skipped']})")
            continue
        try:
            q = torch.randn(b, hq, tq, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.bfloat16)
        except Exception as e:  # noqa: BLE001
            row["error"] = str(e)
            rows.append(row)
            print(f"{mode:<8} {ctx:>7} {b:>4} | {e}")
            continue
        # FLOPs: 4*d per (query head, visible key); causal prefill sees (T+1)/2 keys on average.
        keys = ctx if mode == "decode" else (ctx + 1) / 2
        flops = 4.0 * d * b * hq * tq * keys
        cells, best = [], None
        for name, backend in backends:
            try:
                us, graphed = timed(attend(q, k, v, mode == "prefill", backend), args.iters)
                row[name + "_us"] = us
                row[name + "_graph"] = graphed
                best = us if best is None else min(best, us)
                cells.append(f"{us:>12.1f}")
            except Exception as e:  # noqa: BLE001 - the backend refuses this shape
                row[name + "_error"] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                cells.append(f"{'n/a':>12}")
        row["flops"] = flops
        if best:
            row["best_us"] = best
            row["best_tflops"] = flops / (best * 1e-6) / 1e12
        print(f"{mode:<8} {ctx:>7} {b:>4} | " + " ".join(cells) + f" | {row.get('best_tflops', 0):.0f}")
        sys.stdout.flush()
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "shapes": {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": "bf16"},
                   "timing": "median GPU time (events) of a CUDA-graph replay, L2 flushed before each",
                   "l2_flush": flush_mode,
                   "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # noqa: BLE001 - a comparison must never fail the benchmark run
        print(f"msa_torch_dense: failed ({e}); skipped")
        sys.exit(0)
