#!/usr/bin/env python3
"""PyTorch grouped-GEMM baselines for the MXFP8 MoE benchmark (tools/moe_bench.sh runs it).

Same problem as moe_bench: M3 at TP1 (hidden 6144, 128 routed experts of intermediate 3072 plus
the shared expert as a 129th group taking every token), top-4 uniform random routing, rows
already permuted into expert order. Times, per token count, the two grouped GEMMs (gate+up
fused as one [hidden, 2*inter] weight, then down) with the SwiGLU-OAI between them:
  - torch._grouped_mm, BF16 weights and activations;
  - torch._scaled_grouped_mm, FP8 e4m3 weights and activations with rowwise (per row / per
    output column) fp32 scales.
GPU time per step from CUDA events, L2 flushed before each as moe_bench does (a 256 MB read;
M3_BENCH_FLUSH=memset for a 256 MB write), median of --iters.
Whatever is unavailable (no torch, no GPU, an op missing or rejecting the layout) is reported in
the JSON instead of failing.
"""
import argparse
import os
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,32,128,512,4096,16384")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--json", default="moe_torch_baseline.json")
    args = ap.parse_args()
    doc = {"shapes": {"hidden": args.hidden, "inter": args.inter, "routed": args.experts, "shared": 1,
                      "top_k": args.top_k}, "rows": [], "errors": []}

    def save():
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print("wrote", args.json)

    try:
        import torch
    except Exception as e:  # noqa: BLE001
        doc["errors"].append(f"import torch: {e}")
        save()
        return 0
    doc["torch"] = torch.__version__
    if not torch.cuda.is_available():
        doc["errors"].append("no CUDA device")
        save()
        return 0
    dev = torch.device("cuda")
    doc["device"] = torch.cuda.get_device_name(0)
    H, I, E, K = args.hidden, args.inter, args.experts, args.top_k
    G = E + 1
    torch.manual_seed(0)
    flush = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    flush_mode = os.environ.get("M3_BENCH_FLUSH", "read")
    doc["l2_flush"] = flush_mode

    def flush_l2():
        # A read leaves L2 holding clean lines (tools/gpu_bench_flush.h); a write leaves them dirty.
        if flush_mode == "memset":
            flush.zero_()
        else:
            flush.view(torch.int64).sum()

    # Copy bandwidth (read + write bytes per second), as moe_bench measures it.
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(6):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        best = max(best, 2 * a.numel() / (s.elapsed_time(e) * 1e-3))
    del a, b
    copy_bw = best
    doc["copy_bandwidth_gbps"] = copy_bw / 1e9

    def timed(fn, iters):
        fn()
        torch.cuda.synchronize()
        us = []
        for _ in range(iters + 1):
            flush_l2()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            us.append(s.elapsed_time(e) * 1e3)
        us = sorted(us[1:])
        return us[len(us) // 2]

    def swiglu_oai(gu, alpha=1.702, limit=7.0):
        g, u = gu[:, :I], gu[:, I:]
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
        return ((u + 1) * g * torch.sigmoid(alpha * g)).to(gu.dtype)

    # Weights in the layouts the ops take: mat_b [groups, K, N] (column-major per group for FP8).
    variants = {}
    try:
        w1 = (torch.randn(G, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02).transpose(1, 2)  # [G, H, 2I]
        w2 = (torch.randn(G, H, I, device=dev, dtype=torch.bfloat16) * 0.02).transpose(1, 2)      # [G, I, H]
        variants["bf16_grouped_mm"] = (w1, w2)
    except Exception as e:  # noqa: BLE001
        doc["errors"].append(f"bf16 weights: {e}")
    try:
        f8 = torch.float8_e4m3fn
        w1_8 = torch.randn(G, 2 * I, H, device=dev).to(f8).transpose(1, 2)  # column-major [G, H, 2I]
        w2_8 = torch.randn(G, H, I, device=dev).to(f8).transpose(1, 2)
        s1 = torch.full((G, 2 * I), 0.01, device=dev, dtype=torch.float32)
        s2 = torch.full((G, H), 0.01, device=dev, dtype=torch.float32)
        variants["fp8_scaled_grouped_mm"] = (w1_8, w2_8, s1, s2)
    except Exception as e:  # noqa: BLE001
        doc["errors"].append(f"fp8 weights: {e}")
    weight_bytes_fp8 = 3.0 * H * I * (1 + 1 / 32)  # what an MXFP8 expert reads, for the roofline ratio

    for T in [int(t) for t in args.tokens.split(",")]:
        ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]) if T <= 4096 else \
            torch.argsort(torch.rand(T, E, device=dev), dim=1)[:, :K]
        counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
        counts = torch.cat([counts, torch.tensor([T], dtype=torch.int32, device=dev)])
        offs = torch.cumsum(counts, 0).to(torch.int32)
        rows = int(offs[-1].item())
        touched = int((counts > 0).sum().item())
        flops = 2.0 * rows * 3 * H * I
        it = args.iters if T < 4096 else max(3, args.iters // 3)
        x = torch.randn(rows, H, device=dev, dtype=torch.bfloat16)
        for name, wv in variants.items():
            row = {"tokens": T, "what": name, "experts_touched": touched}
            try:
                if name == "bf16_grouped_mm":
                    w1, w2 = wv

                    def step():
                        h = swiglu_oai(torch._grouped_mm(x, w1, offs=offs))
                        return torch._grouped_mm(h, w2, offs=offs)
                    wbytes = touched * 3.0 * H * I * 2
                else:
                    w1_8, w2_8, s1, s2 = wv
                    x8 = x.to(torch.float8_e4m3fn)
                    sx = torch.ones(rows, device=dev, dtype=torch.float32)

                    def step():
                        h = swiglu_oai(torch._scaled_grouped_mm(x8, w1_8, sx, s1, offs=offs, out_dtype=torch.bfloat16))
                        h8 = h.to(torch.float8_e4m3fn)
                        return torch._scaled_grouped_mm(h8, w2_8, sx, s2, offs=offs, out_dtype=torch.bfloat16)
                    wbytes = touched * 3.0 * H * I
                us = timed(step, it)
                row.update({"us": us, "tflops": flops / (us * 1e-6) / 1e12,
                            "weight_bytes": wbytes, "copy_ratio_own_weights": wbytes / (us * 1e-6) / copy_bw,
                            "copy_ratio_mxfp8_bytes": touched * weight_bytes_fp8 / (us * 1e-6) / copy_bw})
                print(f"T={T:6d} {name:22s} {us:10.1f} us {row['tflops']:8.1f} TFLOP/s "
                      f"{100 * row['copy_ratio_own_weights']:5.1f}% copy (own weight bytes)")
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                print(f"T={T:6d} {name:22s} unavailable: {row['error']}")
            sys.stdout.flush()
            doc["rows"].append(row)
        del x
        torch.cuda.empty_cache()
    save()
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"moe_torch_baseline: {time.time() - t0:.1f} s")
    sys.exit(rc)
