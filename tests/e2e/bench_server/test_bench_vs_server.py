#!/usr/bin/env python3
"""`m3serve bench serve`, `bench replay` and `eval gsm8k` against a real `m3serve serve` on the
embedded m3-small model: every request succeeds, the reported token counts are the requested
ones, the replay sees real prefix-cache hits, and GSM8K runs end to end.

Usage: test_bench_vs_server.py --m3serve PATH --model DIR --work DIR   (exit 77 = skipped)
"""
import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port, proc, log_path, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit("server exited early:\n" + open(log_path).read())
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    sys.exit("server did not become healthy")


def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        out[name.split("{", 1)[0]] = out.get(name.split("{", 1)[0], 0.0) + float(value)
    return out


def run(cmd, name, work):
    log = os.path.join(work, name + ".log")
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=300)
    if rc != 0:
        sys.exit("%s failed (rc %d):\n%s" % (name, rc, open(log).read()[-4000:]))


def check(cond, msg):
    if not cond:
        sys.exit("FAIL: " + msg)
    print("ok:", msg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m3serve", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    shared = os.environ.get("M3_SHARED_DIR", "")
    gsm8k = os.path.join(shared, "data/gsm8k")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print("skip: no model at", args.model)
        return 77
    os.makedirs(args.work, exist_ok=True)
    port = free_port()
    log_path = os.path.join(args.work, "server.log")
    server = subprocess.Popen([args.m3serve, "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
                               "--served-model-name", "m3-small", "--max-num-seqs", "16"],
                              stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, server, log_path)
        base = "http://127.0.0.1:%d" % port
        out = os.path.join(args.work, "serve.json")
        run([args.m3serve, "bench", "serve", "--base-url", base, "--endpoint", "completions", "--model", "m3-small",
             "--tokenizer", args.model, "--dataset-name", "random", "--random-input-len", "64",
             "--random-output-len", "16", "--num-prompts", "12", "--max-concurrency", "4", "--ignore-eos",
             "--seed", "3", "--no-progress", "--result-file", out], "bench_serve", args.work)
        s = json.load(open(out))["summary"]
        check(s["completed"] == 12 and s["failed"] == 0, "bench serve: 12 of 12 requests completed")
        check(s["total_input_tokens"] == 12 * 64, "bench serve: the server saw exactly 64 input tokens per prompt")
        check(s["total_output_tokens"] == 12 * 16 and s["output_token_source"]["usage"] == 12,
              "bench serve: 16 output tokens per request, counted from the server's usage")
        check(s["ttft_ms"]["mean"] > 0 and s["tpot_ms"]["mean"] > 0, "bench serve: TTFT and TPOT measured")

        # A short Mooncake-format trace (the shipped ones exceed the small model's context):
        # requests share 512-token blocks by hash id, so the server must see prefix hits.
        trace = os.path.join(args.work, "short_trace.jsonl")
        with open(trace, "w") as f:
            for i, (ids, length) in enumerate([([0, 1], 900), ([0, 2], 1000), ([0, 1, 3], 1400),
                                                ([4], 300), ([0, 2, 5], 1300), ([4, 6], 700)]):
                f.write(json.dumps({"timestamp": i * 100, "input_length": length, "output_length": 8,
                                    "hash_ids": ids}) + "\n")
        if True:
            before = metrics(port)
            out = os.path.join(args.work, "replay.json")
            run([args.m3serve, "bench", "replay", "--base-url", base, "--model", "m3-small", "--tokenizer", args.model,
                 "--trace", trace, "--fixed-concurrency", "--max-concurrency", "1", "--server-block-size", "32", "--no-progress", "--result-file", out],
                "bench_replay", args.work)
            r = json.load(open(out))
            after = metrics(port)
            hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
            check(r["summary"]["completed"] == 6 and r["summary"]["failed"] == 0, "bench replay: 6 of 6 requests completed")
            pc = r["prefix_cache"]
            check(hits > 0 and pc["usage_hit_rate"] > 0,
                  "bench replay: the trace's shared prefixes hit the server's prefix cache (%d tokens)" % hits)
            # Hit tokens must agree exactly; the query count also holds the client's small probe request.
            check(pc["metrics_hits"] == r["summary"]["server_cached_tokens"]["cached_tokens"] == hits,
                  "bench replay: usage.cached_tokens and /metrics agree (%d hit tokens)" % hits)

        if os.path.isdir(gsm8k):
            out = os.path.join(args.work, "gsm8k.json")
            run([args.m3serve, "eval", "gsm8k", "--base-url", base, "--model", "m3-small", "--data-dir", gsm8k,
                 "--limit", "3", "--concurrency", "3", "--max-tokens", "32", "--no-progress", "--result-file", out],
                "eval_gsm8k", args.work)
            r = json.load(open(out))
            flat = json.dumps(r)
            check('"num_samples": 3' in flat or len(r.get("samples", [])) == 3, "eval gsm8k: 3 questions answered")
        else:
            print("skip gsm8k: no data at", gsm8k)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
