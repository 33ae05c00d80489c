#!/usr/bin/env python3
"""Disaggregated prefill, measured against running servers (`m3serve serve` with
--kv-transfer-config kv_producer / kv_consumer, and `m3serve disagg-proxy` in front).

For each prompt length: the prefill server's one-token request that keeps the prompt's blocks,
the decode server's request with them fetched (its time to the first token: fetch, checks, host
tier -> KV cache, one token's prefill), the same decode server computing a prompt of the same
length itself, and one request through the proxy whose answer must equal the producer's own for
the same prompt (greedy). Prints and saves JSON rows.

Usage: disagg_timing.py --producer PORT --consumer PORT [--proxy PORT] [--lengths 512,2048] [--json F]
"""
import argparse
import json
import random
import time
import urllib.request


def post(port, body, timeout=600):
    t = time.time()
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    r = json.load(urllib.request.urlopen(req, timeout=timeout))
    return time.time() - t, r


def wait_healthy(port, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("port %d did not become healthy" % port)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--producer", type=int, required=True)
    ap.add_argument("--consumer", type=int, required=True)
    ap.add_argument("--proxy", type=int)
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--vocab", type=int, default=6000)
    ap.add_argument("--json")
    a = ap.parse_args()
    for p in (a.producer, a.consumer) + ((a.proxy,) if a.proxy else ()):
        wait_healthy(p)
    rows = []
    # A warm-up pair so that the first row does not carry start-up costs (graph capture, page-ins).
    post(a.consumer, {"prompt": [5] * 64, "max_tokens": 2})
    post(a.producer, {"prompt": [6] * 64, "max_tokens": 2})
    for n in [int(x) for x in a.lengths.split(",")]:
        rng = random.Random(n)
        prompt = [rng.randrange(10, a.vocab) for _ in range(n)]
        t_pre, pre = post(a.producer, {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                       "kv_transfer_params": {"do_remote_decode": True}})
        kv = pre["kv_transfer_params"]
        t_dec, dec = post(a.consumer, {"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": kv})
        other = [rng.randrange(10, a.vocab) for _ in range(n)]
        t_own, _ = post(a.consumer, {"prompt": other, "max_tokens": 1, "temperature": 0})
        row = {"prompt_tokens": n, "blocks": kv["num_blocks"], "prefill_server_s": round(t_pre, 4),
               "decode_with_transfer_s": round(t_dec, 4), "decode_computing_s": round(t_own, 4),
               "cached_tokens": dec["usage"]["prompt_tokens_details"]["cached_tokens"],
               "same_first_token": pre["choices"][0]["text"] == dec["choices"][0]["text"]}
        if a.proxy:
            body = {"prompt": prompt[1:] + [7], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            _, via = post(a.proxy, body)
            _, own = post(a.producer, body)
            row["proxy_equals_single_server"] = via["choices"][0]["text"] == own["choices"][0]["text"]
            row["proxy_cached_tokens"] = via["usage"]["prompt_tokens_details"]["cached_tokens"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    m = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % a.producer).read().decode()
    exported = [l for l in m.splitlines() if l.startswith("m3:kv_transfer_exported_bytes_total{")]
    print(exported[0] if exported else "no export counter")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
