#!/usr/bin/env python3
"""What disaggregated prefill is for: decode steps that long prefills do not stall.

One client streams a long greedy generation and records its inter-token latencies, while another
sends long prompts (one every --interval seconds, --prefill-tokens each, a few output tokens).
Run it against a single server (prefills and decodes share its steps) and against
`m3serve disagg-proxy` (prefills run on the prefill server; the decode server only loads their
blocks): the streamed request's ITL percentiles and the long requests' end-to-end times are
printed and saved as JSON.

Usage: disagg_interference.py --port PORT --label NAME [--prefill-tokens 4000] [--json F]
"""
import argparse
import http.client
import json
import random
import statistics
import threading
import time


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))] if xs else None


def stream_itl(port, prompt, max_tokens):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    times = []
    buf = b""
    while True:
        chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(1)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b"data: ") and event != b"data: [DONE]":
                d = json.loads(event[6:])
                if d.get("choices") and d["choices"][0].get("text") is not None:
                    times.append(time.time())
    conn.close()
    return [b - a for a, b in zip(times, times[1:])]


def post(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t = time.time()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = json.loads(conn.getresponse().read())
    conn.close()
    return time.time() - t, r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--prefill-tokens", type=int, default=4000)
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--decode-tokens", type=int, default=600)
    ap.add_argument("--vocab", type=int, default=6000)
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(1)
    post(a.port, {"prompt": [9] * 64, "max_tokens": 4})  # warm-up
    result = {}
    # Alone first: the decode stream's own pace.
    result["itl_alone"] = stream_itl(a.port, [rng.randrange(10, a.vocab) for _ in range(64)], a.decode_tokens // 2)
    stop = threading.Event()
    e2e = []

    def prefills():
        k = 0
        while not stop.is_set():
            k += 1
            prompt = [rng.randrange(10, a.vocab) for _ in range(a.prefill_tokens)]
            t, r = post(a.port, {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            e2e.append((t, r["usage"]["prompt_tokens_details"]["cached_tokens"]))
            stop.wait(a.interval)

    th = threading.Thread(target=prefills)
    th.start()
    time.sleep(0.05)
    result["itl_with_prefills"] = stream_itl(a.port, [rng.randrange(10, a.vocab) for _ in range(64)], a.decode_tokens)
    stop.set()
    th.join()
    row = {"label": a.label, "prefill_tokens": a.prefill_tokens, "long_requests": len(e2e),
           "long_e2e_mean_s": round(statistics.mean(t for t, _ in e2e), 4) if e2e else None,
           "long_cached_tokens_mean": round(statistics.mean(c for _, c in e2e), 1) if e2e else None}
    for key in ("itl_alone", "itl_with_prefills"):
        xs = [x * 1000 for x in result[key]]
        med = percentile(xs, 50)
        row[key + "_ms"] = {"p50": round(med, 3), "p90": round(percentile(xs, 90), 3),
                            "p99": round(percentile(xs, 99), 3), "max": round(max(xs), 3), "n": len(xs),
                            # time the stream stood still: gaps over 10x its median
                            "stalled": round(sum(x for x in xs if x > 10 * med), 1)}
    print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
