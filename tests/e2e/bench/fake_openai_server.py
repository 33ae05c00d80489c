#!/usr/bin/env python3
"""A tiny OpenAI-compatible streaming server for the bench clients' end-to-end test.

Usage: fake_openai_server.py [ANSWERS_JSONL]. Prints the port it listens on, then serves.
- /v1/completions and /v1/chat/completions, streamed (SSE) or not. Output is max_tokens
  words " aa", " ab", ... (one per chunk), or, when ANSWERS_JSONL is given and the prompt's
  last "Question: ..." is one of its questions, a GSM8K answer: model "exact" ends with
  "#### N", model "flex" says "The answer is N.", anything else answers 0.
- Model "fail" gets HTTP 500; model "noids" rejects token-id prompts with HTTP 400.
- Token-id prompts go through a prefix cache of 16-token blocks (chained hashes);
  usage.prompt_tokens_details.cached_tokens and /metrics (vllm:prefix_cache_hits_total,
  vllm:prefix_cache_queries_total, vllm:kv_cache_usage_perc) report it.
"""
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BLOCK = 16
WORDS = [" " + a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"]
LOCK = threading.Lock()
STATE = {"cache": set(), "hits": 0, "queries": 0}
ANSWERS = {}


def cached_prefix(ids):
    """Tokens of ids found in the cache (full blocks, chained), then caches ids' full blocks."""
    with LOCK:
        chain, hit, hitting = (), 0, True
        for i in range(len(ids) // BLOCK):
            chain = hash((chain, tuple(ids[i * BLOCK:(i + 1) * BLOCK])))
            if hitting and chain in STATE["cache"]:
                hit += BLOCK
            else:
                hitting = False
                STATE["cache"].add(chain)
        STATE["hits"] += hit
        STATE["queries"] += len(ids)
        return hit


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def reply(self, status, body, content_type="application/json"):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self.reply(200, json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}))
        elif self.path == "/metrics":
            text = ("# TYPE vllm:prefix_cache_hits_total counter\n"
                    f'vllm:prefix_cache_hits_total{{engine="0"}} {STATE["hits"]}\n'
                    f'vllm:prefix_cache_queries_total{{engine="0"}} {STATE["queries"]}\n'
                    'vllm:kv_cache_usage_perc{engine="0"} 0.5\n')
            self.reply(200, text, "text/plain")
        else:
            self.reply(404, '{"error": {"message": "not found"}}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        model = body.get("model", "")
        chat = self.path.endswith("/chat/completions")
        if model == "fail":
            return self.reply(500, '{"error": {"message": "boom"}}')
        prompt = body["messages"][-1]["content"] if chat else body.get("prompt", "")
        cached = 0
        if isinstance(prompt, list):
            if model == "noids":
                return self.reply(400, '{"error": {"message": "prompt must be a string"}}')
            prompt_tokens = len(prompt)
            cached = cached_prefix(prompt)
        else:
            prompt_tokens = len(prompt.split())
        pieces = self.generate(model, prompt, int(body.get("max_tokens") or 16))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces),
                 "total_tokens": prompt_tokens + len(pieces),
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if not body.get("stream"):
            text = "".join(pieces)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                      if chat else {"index": 0, "text": text, "finish_reason": "stop"})
            return self.reply(200, json.dumps({"id": "x", "choices": [choice], "usage": usage}))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            choice = {"index": 0, "finish_reason": "length" if last else None}
            if chat:
                choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.002)
        if (body.get("stream_options") or {}).get("include_usage"):
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def generate(self, model, prompt, max_tokens):
        if isinstance(prompt, str) and "Question: " in prompt:
            question = prompt.rsplit("Question: ", 1)[1].rsplit("\nAnswer:", 1)[0]
            if question in ANSWERS:
                n = ANSWERS[question]
                text = f" Some steps.\n#### {n}" if model == "exact" else f" The answer is {n}." if model == "flex" else " 0"
                return [text[i:i + 4] for i in range(0, len(text), 4)]
        return [WORDS[(i * 7) % len(WORDS)] for i in range(max_tokens)]


def main():
    if len(sys.argv) > 1 and sys.argv[1]:
        with open(sys.argv[1]) as f:
            for line in f:
                ex = json.loads(line)
                ANSWERS[ex["question"]] = ex["answer"].rsplit("#### ", 1)[1].strip()
    ThreadingHTTPServer.request_queue_size = 256  # the default backlog of 5 drops bursts
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
