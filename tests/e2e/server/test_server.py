#!/usr/bin/env python3
"""End-to-end tests of `m3serve serve`: the real binary on a tiny random model, driven by the
official `openai` SDK (completions, chat, streaming, tools, logprobs) and by plain HTTP for the
error cases, /metrics, client disconnects, 1000 concurrent streams and graceful shutdown.

Usage: test_server.py --m3serve PATH --fixture DIR   (exit 77 = skipped)
"""
import argparse
import asyncio
import concurrent.futures
import gc
import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import unittest

ARGS = None
API_KEY = "sk-test-key"
MODEL = "tiny"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_when_up(port, path, body, stream=False):
    """POST to a process that may still be starting (disagg-proxy): (status, JSON body or SSE chunks)."""
    deadline = time.time() + 30
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
    payload = resp.read().decode()
    conn.close()
    if not stream:
        return resp.status, json.loads(payload)
    return resp.status, [json.loads(line[6:]) for line in payload.splitlines()
                         if line.startswith("data: ") and line != "data: [DONE]"]


def terminate(proc, timeout):
    """SIGTERM (a graceful drain), then SIGKILL after `timeout` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


class Proxy:
    """`m3serve disagg-proxy` in front of a prefill and a decode server."""

    def __init__(self, prefill_port, decode_port):
        self.port = free_port()
        self.log = open(os.path.join(ARGS.work, "proxy-%d.log" % self.port), "w")
        self.proc = subprocess.Popen([ARGS.m3serve, "disagg-proxy", "--host", "127.0.0.1", "--port", str(self.port),
                                      "--prefill", "http://127.0.0.1:%d" % prefill_port,
                                      "--decode", "http://127.0.0.1:%d" % decode_port],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def post(self, path, body, stream=False):
        return post_when_up(self.port, path, body, stream)

    def stop(self):
        terminate(self.proc, 10)
        self.log.close()


class Server:
    def __init__(self, extra=(), api_key=API_KEY, script=None, script_extra=(), blocks=400):
        self.port = free_port()
        self.clients = []
        # With a script, the test-only m3serve_scripted runs the same serve command with a
        # fixed-output engine in place of the model.
        binary = [ARGS.m3serve_scripted, "--script", script, *script_extra] if script else [ARGS.m3serve]
        cmd = [*binary, "serve", ARGS.fixture, "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", MODEL, "--max-model-len", "2048", "--num-gpu-blocks-override", str(blocks),
               "--max-num-seqs", "32", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = os.path.join(ARGS.work, "server-%d.log" % self.port)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited early:\n" + open(self.log_path).read())
            try:
                if self.request("GET", "/health", auth=False)[0] == 200:
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("server did not become healthy")

    def request(self, method, path, body=None, auth=True, raw=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        h = {"Content-Type": "application/json"}
        if auth:
            h["Authorization"] = "Bearer " + API_KEY
        h.update(headers or {})
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        conn.request(method, path, body=data, headers=h)
        resp = conn.getresponse()
        payload = resp.read()
        conn.close()
        return resp.status, payload

    def json(self, method, path, body=None, **kw):
        status, payload = self.request(method, path, body, **kw)
        return status, json.loads(payload) if payload else None

    def metrics(self):
        status, payload = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in payload.decode().splitlines():
            if line.startswith("#") or not line:
                continue
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
        return out

    def metric(self, name, labels=""):
        key = '%s{model_name="%s"%s}' % (name, MODEL, ("," + labels) if labels else "")
        return self.metrics()[key]

    def client(self):
        import openai
        c = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % self.port, api_key=API_KEY, max_retries=0)
        self.clients.append(c)
        return c

    def close_clients(self):
        for c in self.clients:
            c.close()
        self.clients = []

    def stop(self):
        self.close_clients()
        if self.proc.poll() is None:
            terminate(self.proc, 30)
        self.log.close()


class ServerTest(unittest.TestCase):
    server = None

    @classmethod
    def setUpClass(cls):
        cls.server = Server(extra=["--max-pending", "300"])

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    # ---- the OpenAI SDK --------------------------------------------------------------------

    def test_completion_non_stream(self):
        before = self.server.metric("vllm:generation_tokens_total")
        r = self.server.client().completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0,
                                                    extra_body={"ignore_eos": True})
        self.assertEqual(len(r.choices), 1)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 5)
        self.assertGreater(r.usage.prompt_tokens, 0)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + 5)
        self.assertTrue(r.id.startswith("cmpl-"))
        self.assertEqual(r.model, MODEL)
        # Greedy is deterministic.
        r2 = self.server.client().completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0,
                                                     extra_body={"ignore_eos": True})
        self.assertEqual(r.choices[0].text, r2.choices[0].text)
        self.assertGreaterEqual(self.server.metric("vllm:generation_tokens_total") - before, 10)

    def test_completion_n_seed_and_token_prompt(self):
        c = self.server.client()
        r = c.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, n=3, temperature=1.0, seed=11,
                                 extra_body={"ignore_eos": True})
        self.assertEqual([ch.index for ch in r.choices], [0, 1, 2])
        self.assertEqual(r.usage.prompt_tokens, 4)  # the prompt counts once
        self.assertEqual(r.usage.completion_tokens, 12)
        r2 = c.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, n=3, temperature=1.0, seed=11,
                                  extra_body={"ignore_eos": True})
        self.assertEqual([ch.text for ch in r.choices], [ch.text for ch in r2.choices])

    def test_completion_logprobs(self):
        r = self.server.client().completions.create(model=MODEL, prompt="The", max_tokens=4, temperature=0, logprobs=3,
                                                    extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        self.assertEqual(len(lp.tokens), 4)
        self.assertEqual(len(lp.token_logprobs), 4)
        for lps, top in zip(lp.token_logprobs, lp.top_logprobs):
            self.assertLessEqual(lps, 0.0)
            self.assertTrue(1 <= len(top) <= 3)  # keyed by text: tokens that decode alike collapse
            self.assertAlmostEqual(max(top.values()), lps, places=4)  # greedy picks the top token
        self.assertEqual(lp.text_offset[0], 0)

    def test_logit_bias(self):
        c = self.server.client()
        kw = dict(model=MODEL, prompt="The", temperature=0, extra_body={"ignore_eos": True})
        detok = lambda ids: self.server.json("POST", "/detokenize", {"tokens": ids})[1]["prompt"]
        a, b = 7, 8
        self.assertNotEqual(detok([a]), detok([b]))
        # +100 makes one token the greedy choice at every step; logprobs stay the model's own.
        base = c.completions.create(max_tokens=4, logprobs=1, **kw)
        r = c.completions.create(max_tokens=4, logprobs=1, logit_bias={str(a): 100}, **kw)
        self.assertEqual(r.choices[0].text, detok([a] * 4))
        self.assertEqual(r.choices[0].logprobs.top_logprobs[0], base.choices[0].logprobs.top_logprobs[0])
        # Both boosted: the model's own order decides; -100 on the winner leaves the other.
        both = {str(a): 100, str(b): 100}
        won = c.completions.create(max_tokens=1, logit_bias=both, **kw).choices[0].text
        self.assertIn(won, (detok([a]), detok([b])))
        winner, other = (a, b) if won == detok([a]) else (b, a)
        both[str(winner)] = -100
        self.assertEqual(c.completions.create(max_tokens=1, logit_bias=both, **kw).choices[0].text, detok([other]))
        # allowed_token_ids: only those can come (a bias cannot bring others back).
        r = c.completions.create(model=MODEL, prompt="The", temperature=0, max_tokens=1, logit_bias={str(a): 100},
                                 extra_body={"ignore_eos": True, "allowed_token_ids": [b]})
        self.assertEqual(r.choices[0].text, detok([b]))
        self.check_error({"model": MODEL, "prompt": "x", "allowed_token_ids": [99999]}, "allowed_token_ids",
                         path="/v1/completions")
        # Chat takes it too, and streams the same text as without streaming.
        ck = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
                  logit_bias={str(a): 100}, extra_body={"ignore_eos": True})
        whole = c.chat.completions.create(**ck).choices[0].message.content
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **ck)
                           if ch.choices)
        self.assertEqual(whole, streamed)
        self.assertEqual(whole, detok([a] * 3))

    def test_echo_and_prompt_logprobs(self):
        # The logprob of token 7 after P, as the sampled token (forced by logit_bias, reported raw)
        # and as the last prompt token of P + [7] (echo; prompt_logprobs): the same number.
        p = [5, 9, 14, 20, 33, 41, 52, 60]
        st, r1 = self.server.json("POST", "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 1,
                                  "temperature": 0, "logprobs": 0, "logit_bias": {"7": 100}, "ignore_eos": True})
        self.assertEqual(st, 200, r1)
        want = r1["choices"][0]["logprobs"]["token_logprobs"][0]
        st, r2 = self.server.json("POST", "/v1/completions", {"model": MODEL, "prompt": p + [7], "max_tokens": 2,
                                  "temperature": 0, "logprobs": 1, "echo": True, "ignore_eos": True})
        self.assertEqual(st, 200, r2)
        lp = r2["choices"][0]["logprobs"]
        self.assertEqual(len(lp["tokens"]), len(p) + 1 + 2)
        self.assertIsNone(lp["token_logprobs"][0])
        self.assertIsNone(lp["top_logprobs"][0])
        self.assertAlmostEqual(lp["token_logprobs"][len(p)], want, places=5)
        prompt_text = self.server.json("POST", "/detokenize", {"tokens": p + [7]})[1]["prompt"]
        self.assertTrue(r2["choices"][0]["text"].startswith(prompt_text))
        self.assertEqual(r2["usage"]["completion_tokens"], 2)
        # vLLM's prompt_logprobs field, completions and chat; streamed once, in the first chunk.
        st, r3 = self.server.json("POST", "/v1/completions", {"model": MODEL, "prompt": p + [7], "max_tokens": 1,
                                  "prompt_logprobs": 2})
        self.assertEqual(st, 200, r3)
        pl = r3["choices"][0]["prompt_logprobs"]
        self.assertEqual(len(pl), len(p) + 1)
        self.assertIsNone(pl[0])
        self.assertAlmostEqual(pl[len(p)]["7"]["logprob"], want, places=5)
        self.assertTrue(all(1 <= len(d) <= 3 for d in pl[1:]))
        st, r4 = self.server.json("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                  "messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0})
        self.assertEqual(st, 200, r4)
        self.assertEqual(len(r4["prompt_logprobs"]), r4["usage"]["prompt_tokens"])
        body = {"model": MODEL, "prompt": p + [7], "max_tokens": 3, "temperature": 0, "echo": True, "ignore_eos": True}
        whole = self.server.json("POST", "/v1/completions", body)[1]["choices"][0]["text"]
        status, payload = self.server.request("POST", "/v1/completions", dict(body, stream=True))
        self.assertEqual(status, 200)
        chunks = [json.loads(part[6:]) for part in payload.decode().split("\n\n") if part.startswith("data: {")]
        self.assertEqual(chunks[0]["choices"][0]["text"], prompt_text)
        self.assertEqual("".join(c["choices"][0]["text"] for c in chunks if c["choices"]), whole)
        self.assertTrue(whole.startswith(prompt_text) and len(whole) > len(prompt_text))

    def test_json_object_mode(self):
        tok = lambda text: self.server.json("POST", "/tokenize", {"prompt": text})[1]["tokens"]
        lb, rb = tok("{"), tok("}")
        self.assertEqual((len(lb), len(rb)), (1, 1))
        # '{' then '}' favoured: '{' opens, a second '{' cannot be a key, so '}' closes; then EOS.
        bias = {str(lb[0]): 30, str(rb[0]): 20}
        body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "temperature": 0, "logit_bias": bias,
                "response_format": {"type": "json_object"}}
        st, r = self.server.json("POST", "/v1/completions", body)
        self.assertEqual(st, 200, r)
        self.assertEqual((r["choices"][0]["text"], r["choices"][0]["finish_reason"]), ("{}", "stop"))
        st, r = self.server.json("POST", "/v1/chat/completions", dict(self.chat(max_tokens=20, temperature=0,
                                 logit_bias=bias, response_format={"type": "json_object"})))
        self.assertEqual(st, 200, r)
        self.assertEqual(r["choices"][0]["message"]["content"], "{}")
        # Unbiased: whatever the random model writes is an object when it stops, and stays JSON text.
        for seed in range(4):
            st, r = self.server.json("POST", "/v1/completions", {"model": MODEL, "prompt": "Data:", "max_tokens": 48,
                                     "temperature": 1.0, "seed": seed, "response_format": {"type": "json_object"}})
            self.assertEqual(st, 200, r)
            text, finish = r["choices"][0]["text"], r["choices"][0]["finish_reason"]
            self.assertTrue(text.lstrip().startswith("{"), text)
            if finish == "stop":
                self.assertIsInstance(json.loads(text), dict)
        # json_schema: the schema leaves the model only whitespace and a boolean to choose.
        schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "n": {"type": "integer"}},
                  "required": ["a", "n"], "additionalProperties": False}
        for seed in range(3):
            st, r = self.server.json("POST", "/v1/completions", {
                "model": MODEL, "prompt": "Data:", "max_tokens": 400, "temperature": 1.0, "seed": seed,
                "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}})
            self.assertEqual(st, 200, r)
            text, finish = r["choices"][0]["text"], r["choices"][0]["finish_reason"]
            self.assertTrue(text.lstrip().startswith("{"), text)
            if finish == "stop":
                doc = json.loads(text)
                self.assertEqual(set(doc), {"a", "n"})
                self.assertIsInstance(doc["a"], bool)
                self.assertIsInstance(doc["n"], int)
        err = self.check_error(self.chat(response_format={"type": "json_schema", "json_schema": {
            "name": "t", "schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}}}),
            "response_format")
        self.assertIn("'minimum' is not supported", err["message"])
        # String rules: a pattern and a format, on the decoded text.
        schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-C]{2}[0-9]$"},
                                                   "day": {"type": "string", "format": "date"}},
                  "required": ["code", "day"], "additionalProperties": False}
        done = 0
        for seed in range(3):
            st, r = self.server.json("POST", "/v1/completions", {
                "model": MODEL, "prompt": "Data:", "max_tokens": 200, "temperature": 1.0, "seed": seed,
                "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}})
            self.assertEqual(st, 200, r)
            if r["choices"][0]["finish_reason"] != "stop":
                continue
            doc = json.loads(r["choices"][0]["text"])
            self.assertRegex(doc["code"], r"^[A-C]{2}[0-9]$")
            self.assertRegex(doc["day"], r"^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$")
            done += 1
        self.assertGreater(done, 0)
        self.check_error(self.chat(response_format={"type": "json_schema"}), "response_format")

    def test_guided_regex_choice_truncation_and_bad_words(self):
        import re
        options = ["alpha", "beta", "gamma delta"]
        for seed in range(4):
            st, r = self.server.json("POST", "/v1/completions", {"model": MODEL, "prompt": "Pick:", "max_tokens": 40,
                                     "temperature": 1.0, "seed": seed, "guided_choice": options})
            self.assertEqual(st, 200, r)
            self.assertEqual(r["choices"][0]["finish_reason"], "stop", r)
            self.assertIn(r["choices"][0]["text"], options)
            st, r = self.server.json("POST", "/v1/completions", {"model": MODEL, "prompt": "Code:", "max_tokens": 40,
                                     "temperature": 1.0, "seed": seed, "guided_regex": r"[A-C]\d{2}-(x|yz)"})
            self.assertEqual(st, 200, r)
            self.assertEqual(r["choices"][0]["finish_reason"], "stop", r)
            self.assertRegex(r["choices"][0]["text"], r"^[A-C]\d{2}-(x|yz)$")
        # vLLM's structured_outputs form, in chat (thinking off: no reasoning block first).
        st, r = self.server.json("POST", "/v1/chat/completions", self.chat(
            max_tokens=40, temperature=1.0, seed=7, structured_outputs={"choice": options},
            chat_template_kwargs={"thinking_mode": "disabled"}))
        self.assertEqual(st, 200, r)
        self.assertIn(r["choices"][0]["message"]["content"], options)
        err = self.check_error(self.chat(guided_regex="(?=a)b"), "guided_regex")
        self.assertIn("look-around", err["message"])
        self.check_error(self.chat(guided_regex="a", guided_choice=["a"]), "guided_choice")
        # truncate_prompt_tokens keeps the prompt's last tokens.
        ids = list(range(10, 60))
        st, r = self.server.json("POST", "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2,
                                 "truncate_prompt_tokens": 5, "echo": True, "temperature": 0})
        self.assertEqual(st, 200, r)
        self.assertEqual(r["usage"]["prompt_tokens"], 5)
        tail = self.server.json("POST", "/detokenize", {"tokens": ids[-5:]})[1]["prompt"]
        self.assertTrue(r["choices"][0]["text"].startswith(tail), (r["choices"][0]["text"], tail))
        # bad_words: a token of the greedy output whose text is one token without a leading space,
        # banned, changes the output exactly there (vLLM's rule: the word as tokenized alone, and
        # after a space only when that gives as many tokens).
        body = {"model": MODEL, "prompt": "The", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        tokens = self.server.json("POST", "/v1/completions", body)[1]["choices"][0]["logprobs"]["tokens"]
        tokenize = lambda text: self.server.json("POST", "/tokenize", {"prompt": text})[1]["tokens"]
        k = next(k for k, t in enumerate(tokens) if t.strip() == t and t and len(tokenize(t)) == 1)
        st, r = self.server.json("POST", "/v1/completions", dict(body, bad_words=[tokens[k]]))
        self.assertEqual(st, 200, r)
        banned = r["choices"][0]["logprobs"]["tokens"]
        self.assertEqual(banned[:k], tokens[:k])
        self.assertNotEqual(banned[k], tokens[k])
        self.assertNotIn(tokens[k], banned)

    def test_tool_choice_required_and_named_are_enforced(self):
        tools = [WEATHER_TOOL, {"type": "function", "function": {"name": "ping"}}]
        calls = 0
        for seed in range(4):
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                st, r = self.server.json("POST", "/v1/chat/completions", self.chat(
                    max_tokens=300, temperature=1.0, seed=seed, tools=tools, tool_choice=choice,
                    chat_template_kwargs={"thinking_mode": "disabled"}))
                self.assertEqual(st, 200, r)
                msg, finish = r["choices"][0]["message"], r["choices"][0]["finish_reason"]
                self.assertFalse(msg.get("content"), msg)  # a call and nothing else
                self.assertFalse(msg.get("reasoning_content"), msg)
                if finish == "length":
                    continue  # a random model may ramble inside a string value
                self.assertEqual(finish, "tool_calls", r)
                for call in msg["tool_calls"]:
                    calls += 1
                    if choice != "required":
                        self.assertEqual(call["function"]["name"], "get_weather")
                    self.assertIn(call["function"]["name"], {"get_weather", "ping"})
                    args = json.loads(call["function"]["arguments"])
                    if call["function"]["name"] == "get_weather":
                        self.assertLessEqual(set(args), {"city", "days"})
                        self.assertIsInstance(args.get("days", 0), int)
        self.assertGreater(calls, 3)

    def test_min_tokens(self):
        # EOS (id 2 in the fixture) pushed to the top ends the completion at once; min_tokens holds it off.
        c = self.server.client()
        kw = dict(model=MODEL, prompt="The", max_tokens=8, temperature=0, logit_bias={"2": 100})
        r = c.completions.create(**kw)
        self.assertEqual((r.choices[0].finish_reason, r.usage.completion_tokens), ("stop", 1))
        r = c.completions.create(extra_body={"min_tokens": 3}, **kw)
        self.assertEqual((r.choices[0].finish_reason, r.usage.completion_tokens), ("stop", 4))
        self.assertNotEqual(r.choices[0].text, "")
        # min_tokens above max_tokens is refused.
        self.check_error(self.chat(min_tokens=5, max_tokens=4), "min_tokens")

    def test_completion_stream_and_usage(self):
        stream = self.server.client().completions.create(model=MODEL, prompt="Once upon", max_tokens=6, temperature=0,
                                                         stream=True, stream_options={"include_usage": True},
                                                         extra_body={"ignore_eos": True})
        text, finish, usage = "", None, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
        self.assertEqual(finish, "length")
        self.assertEqual(usage.completion_tokens, 6)
        full = self.server.client().completions.create(model=MODEL, prompt="Once upon", max_tokens=6, temperature=0,
                                                       extra_body={"ignore_eos": True})
        self.assertEqual(text, full.choices[0].text)
        # vLLM's continuous_usage_stats: every chunk carries the usage so far.
        stream = self.server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
        counts = [chunk.usage.completion_tokens for chunk in stream]
        self.assertEqual(counts[0], 0)  # the role chunk
        self.assertEqual(counts, sorted(counts))
        self.assertEqual(counts[-1], 5)
        self.assertGreater(len(counts), 3)

    def test_stop_string_truncates(self):
        c = self.server.client()
        full = c.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
        visible = [i for i in range(2, len(full)) if full[i - 2:i].strip()]
        if not visible:
            self.skipTest("random model produced no usable text")
        cut = visible[len(visible) // 2]
        stop = full[cut - 2:cut]
        r = c.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True})
        self.assertEqual(r.choices[0].text, full[:full.index(stop)])
        self.assertEqual(r.choices[0].finish_reason, "stop")
        # Streaming cuts at the same place.
        text = "".join(ch.choices[0].text for ch in c.completions.create(
            model=MODEL, prompt="Hello", max_tokens=24, temperature=0, stop=[stop], stream=True,
            extra_body={"ignore_eos": True}) if ch.choices)
        self.assertEqual(text, full[:full.index(stop)])

    def test_chat_non_stream(self):
        r = self.server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
            max_completion_tokens=8, temperature=0, extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}})
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertIn(r.choices[0].finish_reason, ("stop", "length", "tool_calls"))
        self.assertLessEqual(r.usage.completion_tokens, 8)
        # The prompt is what /tokenize renders for the same messages.
        status, tok = self.server.json("POST", "/tokenize", {
            "model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
            "chat_template_kwargs": {"thinking_mode": "disabled"}})
        self.assertEqual(status, 200)
        self.assertEqual(tok["count"], r.usage.prompt_tokens)

    def test_chat_stream_matches_non_stream(self):
        c = self.server.client()
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=12, temperature=0,
                  seed=3)
        full = c.chat.completions.create(**kw)
        content, reasoning, finish, roles = "", "", None, []
        for chunk in c.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                if ch.delta.role:
                    roles.append(ch.delta.role)
                content += ch.delta.content or ""
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                finish = ch.finish_reason or finish
        self.assertEqual(roles, ["assistant"])
        self.assertEqual(content, full.choices[0].message.content or "")
        self.assertEqual(reasoning, getattr(full.choices[0].message, "reasoning_content", None) or "")
        self.assertEqual(finish, full.choices[0].finish_reason)

    def test_chat_logprobs(self):
        r = self.server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, logprobs=True,
            top_logprobs=2, extra_body={"ignore_eos": True})
        entries = r.choices[0].logprobs.content
        self.assertEqual(len(entries), 5)
        for e in entries:
            self.assertEqual(len(e.top_logprobs), 2)
            self.assertAlmostEqual(e.top_logprobs[0].logprob, e.logprob, places=4)
            self.assertEqual(bytes(e.bytes).decode("utf-8", "replace"), e.token)

    def test_chat_with_tools(self):
        # A random model rarely writes a tool call; this checks the request path (tools rendered,
        # tool history accepted, stream well-formed). Parsing of streamed calls is unit-tested.
        c = self.server.client()
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="auto",
                                      max_tokens=8, temperature=0)
        self.assertEqual(len(r.choices), 1)
        n_stream = 0
        for chunk in c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=8,
                                               temperature=0, stream=True):
            n_stream += 1
        self.assertGreater(n_stream, 1)
        status, tok_with = self.server.json("POST", "/tokenize", {"messages": messages[:1], "tools": [WEATHER_TOOL]})
        status2, tok_without = self.server.json("POST", "/tokenize", {"messages": messages[:1]})
        self.assertGreater(tok_with["count"], tok_without["count"])

    def test_models_tokenize_detokenize(self):
        models = self.server.client().models.list()
        self.assertEqual([m.id for m in models.data], [MODEL])
        self.assertEqual(self.server.client().models.retrieve(MODEL).id, MODEL)
        st, err = self.server.json("GET", "/v1/models/no-such/model")
        self.assertEqual((st, err["error"]["code"]), (404, "model_not_found"))
        st, version = self.server.json("GET", "/version")
        self.assertEqual(st, 200)
        self.assertRegex(version["version"], r"^\d+\.\d+\.\d+$")
        status, tok = self.server.json("POST", "/tokenize", {"prompt": "Hello world"})
        self.assertEqual(status, 200)
        status, detok = self.server.json("POST", "/detokenize", {"tokens": tok["tokens"]})
        self.assertEqual(detok["prompt"], "Hello world")
        self.assertEqual(tok["max_model_len"], 2048)

    def test_debug_endpoints(self):
        self.server.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
        status, kernels = self.server.json("GET", "/debug/kernels")
        self.assertEqual(status, 200)
        ops = {e["op"] for e in kernels["entries"]}
        self.assertIn("linear", ops)
        self.assertTrue(all(e["condition"] for e in kernels["entries"]))  # the whole table, with rules
        used = [e for e in kernels["entries"] if e["count"] > 0]
        self.assertTrue(any(e["op"] == "linear" for e in used))
        self.assertTrue(all(e["entry"].endswith(".cpu") for e in used), used)
        self.assertTrue(any(e["count"] == 0 for e in kernels["entries"]))  # unused entries are listed too
        self.assertTrue(any(c["op"].startswith("attention") and c["count"] > 0 for c in kernels["counts"]))
        self.assertEqual(sum(e["count"] for e in kernels["entries"]), sum(c["count"] for c in kernels["counts"]))
        status, shapes = self.server.json("GET", "/debug/shapes")
        self.assertIn("linear", shapes["ops"])
        self.assertTrue(all(s["count"] > 0 for s in shapes["ops"]["linear"]))

    def test_metrics_move(self):
        m0 = self.server.metrics()
        key = lambda n: '%s{model_name="%s"}' % (n, MODEL)
        prompt = "A shared prefix that spans several KV blocks of sixteen tokens each, repeated. " * 2
        for _ in range(2):
            self.server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                                    extra_body={"ignore_eos": True})
        m1 = self.server.metrics()
        self.assertGreaterEqual(m1[key("vllm:time_to_first_token_seconds_count")] -
                                m0[key("vllm:time_to_first_token_seconds_count")], 2)
        self.assertGreaterEqual(m1[key("vllm:e2e_request_latency_seconds_count")] -
                                m0[key("vllm:e2e_request_latency_seconds_count")], 2)
        self.assertGreaterEqual(m1[key("vllm:inter_token_latency_seconds_count")] -
                                m0[key("vllm:inter_token_latency_seconds_count")], 4)
        self.assertGreaterEqual(m1[key("vllm:time_per_output_token_seconds_count")] -
                                m0[key("vllm:time_per_output_token_seconds_count")], 2)
        self.assertGreater(m1[key("vllm:prefix_cache_queries_total")], m0[key("vllm:prefix_cache_queries_total")])
        self.assertGreater(m1[key("vllm:prefix_cache_hits_total")], m0[key("vllm:prefix_cache_hits_total")])
        self.assertEqual(m1[key("vllm:generation_tokens_total")] - m0[key("vllm:generation_tokens_total")], 6)
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:num_preemptions_total"):
            self.assertIn(key(name), m1)
        # vLLM's request-level histograms (its Grafana dashboard reads these).
        for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                     "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                     "request_params_max_tokens"):
            self.assertGreaterEqual(m1[key("vllm:%s_count" % name)] - m0[key("vllm:%s_count" % name)], 2, name)
        self.assertGreater(m1[key("vllm:iteration_tokens_total_sum")], m0[key("vllm:iteration_tokens_total_sum")])
        decode = m1[key("vllm:request_decode_time_seconds_sum")] - m0[key("vllm:request_decode_time_seconds_sum")]
        inference = (m1[key("vllm:request_inference_time_seconds_sum")] -
                     m0[key("vllm:request_inference_time_seconds_sum")])
        self.assertGreater(decode, 0.0)
        self.assertGreaterEqual(inference, decode)
        self.assertTrue(any(k.startswith("vllm:cache_config_info{") and 'enable_prefix_caching="True"' in k
                            for k in m1))
        # Usage reports the cached prefix too.
        r = self.server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        self.assertGreater(r.usage.prompt_tokens_details.cached_tokens, 0)

    def test_n_choices_share_the_prompt(self):
        # The choices of one prompt compute it once: the others wait a step and hit the cache.
        key = '%s{model_name="%s"}'
        m0 = self.server.metrics()
        prompt = [(i * 11) % 400 + 5 for i in range(600)]
        r = self.server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=3,
                                                    extra_body={"ignore_eos": True})
        self.assertEqual(len(r.choices), 3)
        m1 = self.server.metrics()
        hits = m1[key % ("vllm:prefix_cache_hits_total", MODEL)] - m0[key % ("vllm:prefix_cache_hits_total", MODEL)]
        steps = (m1[key % ("vllm:iteration_tokens_total_sum", MODEL)] -
                 m0[key % ("vllm:iteration_tokens_total_sum", MODEL)])
        self.assertEqual(hits, 2 * (599 // 16) * 16)  # 16-token blocks in the fixture
        self.assertLess(steps, 600 + 2 * 16 + 3 * 2)   # one prompt, two tails, the decode tokens

    def test_client_disconnect_aborts(self):
        aborts0 = self.server.metric("vllm:request_success_total", 'finished_reason="abort"')
        disc0 = self.server.metric("m3:client_disconnects_total")
        sock = socket.create_connection(("127.0.0.1", self.server.port))
        body = json.dumps({"model": MODEL, "prompt": "Keep going", "max_tokens": 200, "stream": True,
                           "ignore_eos": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(4096)
        self.assertGreater(self.server.metric("m3:kv_cache_blocks_used"), 0)
        sock.close()
        deadline = time.time() + 20
        while time.time() < deadline:
            if self.server.metric("vllm:request_success_total", 'finished_reason="abort"') > aborts0:
                break
            time.sleep(0.05)
        self.assertEqual(self.server.metric("vllm:request_success_total", 'finished_reason="abort"'), aborts0 + 1)
        self.assertEqual(self.server.metric("m3:client_disconnects_total"), disc0 + 1)
        deadline = time.time() + 5
        while time.time() < deadline and self.server.metric("m3:kv_cache_blocks_used") > 0:
            time.sleep(0.05)
        self.assertEqual(self.server.metric("m3:kv_cache_blocks_used"), 0)  # its blocks were freed
        self.assertEqual(self.server.metric("vllm:num_requests_running"), 0)

    # ---- bad input (plain HTTP) ---------------------------------------------------------------

    def check_error(self, body, param_part, status=400, path="/v1/chat/completions", raw=None, etype=None,
                    param=None):
        st, payload = self.server.request("POST", path, body, raw=raw)
        self.assertEqual(st, status, payload)
        err = json.loads(payload)["error"]
        self.assertEqual(set(err), {"message", "type", "param", "code"})
        self.assertEqual(err["type"], etype or "invalid_request_error")
        if param_part:
            self.assertIn(param_part, err["message"])
            self.assertIn(param or param_part.split(".")[0].split("[")[0], err["param"] or "")
        return err

    def chat(self, **kw):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        body.update(kw)
        return body

    # ---- the Responses API -------------------------------------------------------------------

    def test_responses_create_stream_store_and_continue(self):
        import openai
        c = self.server.client()
        kw = dict(model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=5, temperature=0,
                  reasoning={"effort": "none"}, extra_body={"ignore_eos": True})
        r = c.responses.create(**kw)
        self.assertTrue(r.id.startswith("resp_"))
        self.assertEqual(r.object, "response")
        self.assertEqual((r.status, r.incomplete_details.reason), ("incomplete", "max_output_tokens"))
        self.assertEqual(r.usage.output_tokens, 5)
        self.assertEqual(r.usage.total_tokens, r.usage.input_tokens + 5)
        self.assertEqual(r.instructions, "Be brief.")
        self.assertEqual(r.max_output_tokens, 5)
        self.assertEqual([item.type for item in r.output], ["message"])
        # Streaming gives the same text through typed events, numbered in order.
        events = list(c.responses.create(stream=True, **kw))
        self.assertEqual([e.type for e in events[:2]], ["response.created", "response.in_progress"])
        self.assertEqual(events[-1].type, "response.incomplete")
        self.assertEqual([e.sequence_number for e in events], list(range(len(events))))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        self.assertEqual(text, r.output_text)
        self.assertEqual(events[-1].response.output_text, r.output_text)
        # Stored: retrieve, list the input, continue the conversation, delete.
        got = c.responses.retrieve(r.id)
        self.assertEqual((got.id, got.output_text, got.status), (r.id, r.output_text, "incomplete"))
        items = c.responses.input_items.list(r.id)
        self.assertEqual([(i.type, i.role, i.content[0].text) for i in items.data], [("message", "user", "Hello there")])
        follow = c.responses.create(model=MODEL, input="And then?", previous_response_id=r.id, max_output_tokens=2,
                                    reasoning={"effort": "none"}, extra_body={"ignore_eos": True})
        self.assertEqual(follow.previous_response_id, r.id)
        self.assertIsNone(follow.instructions)  # not carried over
        alone = c.responses.create(model=MODEL, input="And then?", max_output_tokens=2, reasoning={"effort": "none"},
                                   extra_body={"ignore_eos": True})
        # The history (the first input and its 5-token answer) precedes the new input.
        self.assertGreaterEqual(follow.usage.input_tokens, alone.usage.input_tokens + 5 + 2)
        c.responses.delete(r.id)
        with self.assertRaises(openai.NotFoundError):
            c.responses.retrieve(r.id)
        # store=false keeps nothing.
        nostore = c.responses.create(store=False, **kw)
        with self.assertRaises(openai.NotFoundError):
            c.responses.retrieve(nostore.id)
        self.check_error({"model": MODEL, "input": "x", "previous_response_id": r.id}, "not found",
                         path="/v1/responses", param="previous_response_id")

    def test_responses_json_schema_and_logprobs(self):
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                  "additionalProperties": False}
        r = self.server.client().responses.create(
            model=MODEL, input="A number as JSON", max_output_tokens=60, temperature=0, reasoning={"effort": "none"},
            text={"format": {"type": "json_schema", "name": "num", "schema": schema}},
            include=["message.output_text.logprobs"], top_logprobs=2)
        self.assertEqual(r.text.format.type, "json_schema")
        part = r.output[-1].content[0]
        if r.status == "completed":
            self.assertEqual(set(json.loads(part.text)), {"n"})
        self.assertEqual(len(part.logprobs), r.usage.output_tokens - (1 if r.status == "completed" else 0))
        for lp in part.logprobs:
            self.assertLessEqual(lp.logprob, 0.0)
            self.assertLessEqual(len(lp.top_logprobs), 2)

    def test_return_token_ids(self):
        c = self.server.client()
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
        body = r.model_dump()
        _, tok = self.server.json("POST", "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        self.assertEqual(body["prompt_token_ids"], tok["tokens"])
        ids = body["choices"][0]["token_ids"]
        self.assertEqual(len(ids), 4)
        _, detok = self.server.json("POST", "/detokenize", {"tokens": ids})
        self.assertEqual(detok["prompt"], r.choices[0].message.content)
        streamed = []
        for chunk in c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0, stream=True,
                                          extra_body={"return_token_ids": True, "ignore_eos": True}):
            d = chunk.model_dump()
            for ch in d["choices"]:
                if ch.get("prompt_token_ids") is not None:
                    self.assertEqual(ch["prompt_token_ids"], [5, 6, 7])
                streamed += ch.get("token_ids") or []
        full = c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True}).model_dump()
        self.assertEqual(streamed, full["choices"][0]["token_ids"])
        self.assertEqual(full["choices"][0]["prompt_token_ids"], [5, 6, 7])

    def test_load(self):
        st, r = self.server.json("GET", "/load")
        self.assertEqual(st, 200)
        self.assertIsInstance(r["server_load"], int)
        # A stream in flight counts.
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"model": MODEL, "prompt": "Hi", "max_tokens": 1500, "stream": True, "ignore_eos": True}),
            headers={"Content-Type": "application/json", "Authorization": "Bearer " + API_KEY})
        resp = conn.getresponse()
        resp.readline()
        self.assertGreaterEqual(self.server.json("GET", "/load")[1]["server_load"], 1)
        self.assertIn(b"[DONE]", resp.read())  # read to the end: no abort left behind for later tests
        conn.close()

    def test_invocations_and_token_strs(self):
        st, r = self.server.json("POST", "/invocations", self.chat())
        self.assertEqual((st, r["object"]), (200, "chat.completion"))
        st, r = self.server.json("POST", "/invocations", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        self.assertEqual((st, r["object"]), (200, "text_completion"))
        st, r = self.server.json("POST", "/invocations", {"model": MODEL, "input": "Hi", "max_output_tokens": 2})
        self.assertEqual((st, r["object"]), (200, "response"))
        self.check_error({"model": MODEL}, "/invocations", path="/invocations", param="body")
        st, r = self.server.json("POST", "/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
        self.assertEqual(st, 200)
        self.assertEqual(len(r["token_strs"]), r["count"])
        self.assertEqual("".join(r["token_strs"]).replace("\u0120", " "), "Hello world")

    def test_model_identity(self):
        msgs = [{"role": "user", "content": "hi"}]
        _, default = self.server.json("POST", "/tokenize", {"model": MODEL, "messages": msgs})
        _, bob = self.server.json("POST", "/tokenize", {"model": MODEL, "messages": msgs,
                                                        "chat_template_kwargs": {"model_identity": "You are Bob."}})
        text = lambda t: self.server.json("POST", "/detokenize", {"tokens": t["tokens"]})[1]["prompt"]
        self.assertIn("You are a helpful assistant.", text(default))
        self.assertIn("You are Bob.", text(bob))
        self.assertNotIn("You are a helpful assistant.", text(bob))
        self.check_error(self.chat(chat_template_kwargs={"model_identity": 3}), "chat_template_kwargs.model_identity")

    def test_continue_final_message(self):
        msgs = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon a time"}]
        body = dict(model=MODEL, messages=msgs, max_tokens=4, temperature=0, ignore_eos=True,
                    continue_final_message=True, add_generation_prompt=False)
        st, r = self.server.json("POST", "/v1/chat/completions", body)
        self.assertEqual(st, 200, r)
        self.assertEqual(r["usage"]["completion_tokens"], 4)
        # The prompt is the conversation with the last message left open: what /tokenize renders,
        # the closed form's tokens minus the end of the message.
        st, tok = self.server.json("POST", "/tokenize", {"model": MODEL, "messages": msgs, "continue_final_message": True})
        self.assertEqual(r["usage"]["prompt_tokens"], tok["count"])
        st, closed = self.server.json("POST", "/tokenize", {"model": MODEL, "messages": msgs,
                                                            "add_generation_prompt": False})
        self.assertEqual(closed["tokens"][:tok["count"]], tok["tokens"])
        self.assertGreater(closed["count"], tok["count"])
        self.check_error(dict(body, add_generation_prompt=True), "continue_final_message")
        self.check_error(dict(body, messages=msgs[:1]), "continue_final_message", param="messages")
        self.check_error(dict(body, response_format={"type": "json_object"}), "continue_final_message")

    def test_priority_needs_the_priority_policy(self):
        self.check_error(self.chat(priority=3), "--scheduling-policy priority", param="priority")
        self.assertEqual(self.server.json("POST", "/v1/chat/completions", self.chat(priority=0))[0], 200)
        # vLLM's command line for MiniMax models starts it too; the request id comes back.
        server = Server(api_key=None, extra=["--scheduling-policy", "priority", "--trust-remote-code",
                                             "--enable-auto-tool-choice", "--tool-call-parser", "minimax_m2",
                                             "--reasoning-parser", "minimax_m2_append_think", "--dtype", "auto",
                                             "--tensor-parallel-size", "1", "--enable-request-id-headers", "--enable-log-requests",
                                             "--max-log-len", "12", "--disable-log-stats"])
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("POST", "/v1/chat/completions", body=json.dumps(self.chat()),
                         headers={"Content-Type": "application/json", "X-Request-Id": "trace-42"})
            resp = conn.getresponse()
            body = json.loads(resp.read())
            conn.close()
            self.assertEqual((resp.status, resp.getheader("X-Request-Id"), body["id"]),
                             (200, "trace-42", "chatcmpl-trace-42"))
            st, r = server.json("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                                             "request_id": "from-body"})
            self.assertEqual((st, r["id"]), (200, "cmpl-from-body"))
            for prio in (-5, 0, 7):
                st, r = server.json("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                                                 "priority": prio, "ignore_eos": True})
                self.assertEqual((st, r["usage"]["completion_tokens"]), (200, 3), r)
            st, r = server.json("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "priority": "high"})
            self.assertEqual((st, r["error"]["param"]), (400, "priority"))
        finally:
            server.stop()
        log = open(server.log_path).read()
        self.assertIn("request chatcmpl-trace-42: 1 prompt(s) of", log)
        self.assertNotIn("Avg prompt throughput", log)  # --disable-log-stats
        self.assertIn("request cmpl-from-body", log)
        # What the server does not do stops it at once, naming the flag.
        for flags, name in ((["--tensor-parallel-size", "3"], "num_attention_heads 4 does not divide"),
                            (["--gpu-memory-utilization", "0.9"], "--kv-cache-memory"),
                            (["--tool-call-parser", "hermes"], "--tool-call-parser")):
            out = subprocess.run([ARGS.m3serve, "serve", ARGS.fixture, *flags], capture_output=True, text=True,
                                 timeout=60)
            self.assertNotEqual(out.returncode, 0, flags)
            self.assertIn(name, out.stderr + out.stdout)

    def test_seed_and_long_prefill_threshold(self):
        body = {"model": MODEL, "prompt": [(i * 5) % 300 + 3 for i in range(300)], "max_tokens": 8,
                "temperature": 1.0, "ignore_eos": True}
        texts = []
        for _ in range(2):  # two fresh servers, the same unseeded request
            server = Server(api_key=None, extra=["--seed", "1234", "--long-prefill-token-threshold", "64",
                                                 "--enable-chunked-prefill", "--log-stats-interval", "0.001"])
            try:
                key = 'vllm:iteration_tokens_total_bucket{model_name="%s",le="64"}' % MODEL
                before = server.metrics()[key]
                st, r = server.json("POST", "/v1/completions", body)
                self.assertEqual(st, 200, r)
                texts.append(r["choices"][0]["text"])
                # 300 prompt tokens in chunks of <= 64: five prefill steps, then the decode steps (the
                # last step's figures land just after its tokens).
                deadline = time.time() + 5
                while time.time() < deadline and server.metrics()[key] - before < 5 + 7:
                    time.sleep(0.05)
                self.assertGreaterEqual(server.metrics()[key] - before, 5 + 7)
            finally:
                server.stop()
            self.assertIn("Avg prompt throughput:", open(server.log_path).read())  # the periodic stats line
        self.assertEqual(texts[0], texts[1])

    def test_tensor_parallel(self):
        # Two ranks (threads, in-process all-reduce on the CPU): the same greedy text and tokens as
        # one, logprobs within the rounding of the reordered sums, the all-reduce in the trace.
        server = Server(api_key=None, extra=["--tensor-parallel-size", "2"])
        try:
            body = {"model": MODEL, "prompt": [(i * 7) % 400 + 3 for i in range(90)], "max_tokens": 24,
                    "temperature": 0, "logprobs": 1, "ignore_eos": True, "return_token_ids": True}
            st_a, a = self.server.json("POST", "/v1/completions", body)
            st_b, b = server.json("POST", "/v1/completions", body)
            self.assertEqual((st_a, st_b), (200, 200), (a, b))
            ca, cb = a["choices"][0], b["choices"][0]
            self.assertEqual((ca["text"], ca["token_ids"]), (cb["text"], cb["token_ids"]))
            for x, y in zip(ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"]):
                self.assertAlmostEqual(x, y, delta=1e-3)
            # Seeded sampling and a batch of concurrent requests run through the same ranks.
            seeded = dict(body, temperature=0.8, seed=5, logprobs=None)
            self.assertEqual(self.server.json("POST", "/v1/completions", seeded)[1]["choices"][0]["token_ids"],
                             server.json("POST", "/v1/completions", seeded)[1]["choices"][0]["token_ids"])
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                outs = list(pool.map(lambda i: server.json("POST", "/v1/completions", dict(body, prompt=[i + 3] * 20)),
                                     range(4)))
            self.assertTrue(all(st == 200 and r["usage"]["completion_tokens"] == 24 for st, r in outs), outs)
            status, kernels = server.json("GET", "/debug/kernels")
            self.assertEqual(status, 200)
            for op in ("all_reduce", "all_gather"):  # per layer; the vocab-parallel LM head's logits
                self.assertTrue(any(c["op"] == op and c["entry"] == op + ".in_process.cpu" and c["count"] > 0
                                    for c in kernels["counts"]), kernels["counts"])
        finally:
            server.stop()
        with open(server.log_path) as f:
            self.assertIn("x 2 ranks", f.read())

    def test_speculative_decoding(self):
        # ngram drafts change how many steps a request takes, never its output: the same greedy text,
        # token ids and logprobs as the plain server, stop strings honoured inside a multi-token step.
        spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                           "prompt_lookup_max": 3})
        server = Server(api_key=None, extra=["--speculative-config", spec, "--log-stats-interval", "0.001"])
        try:
            phrase = [17, 250, 33, 98, 4, 61, 120]
            prompt = (phrase + [9]) * 6 + phrase[:3]
            for extra in ({}, {"stop": ["e"]}):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0, "logprobs": 2,
                        "ignore_eos": True, "return_token_ids": True, **extra}
                st_a, a = self.server.json("POST", "/v1/completions", body)
                st_b, b = server.json("POST", "/v1/completions", body)
                self.assertEqual((st_a, st_b), (200, 200), (a, b))
                ca, cb = a["choices"][0], b["choices"][0]
                self.assertEqual(ca["text"], cb["text"])
                self.assertEqual(ca["token_ids"], cb["token_ids"])
                self.assertEqual(ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"])
                self.assertEqual((ca["finish_reason"], a["usage"]), (cb["finish_reason"], b["usage"]))
            # Structured output: the constraint sees the same tokens in the same order.
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "a b a b a b"}], "max_tokens": 24,
                    "temperature": 0, "response_format": {"type": "json_object"},
                    "chat_template_kwargs": {"thinking_mode": "disabled"}}
            st_a, a = self.server.json("POST", "/v1/chat/completions", chat)
            st_b, b = server.json("POST", "/v1/chat/completions", chat)
            self.assertEqual((st_a, st_b), (200, 200), (a, b))
            self.assertEqual(a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"])
            # Streamed: the chunks join to the same text.
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            status, payload = server.request("POST", "/v1/completions", body)
            self.assertEqual(status, 200)
            chunks = [json.loads(part[6:]) for part in payload.decode().split("\n\n") if part.startswith("data: {")]
            joined = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            self.assertEqual(joined, self.server.json("POST", "/v1/completions", dict(body, stream=False))[1]
                             ["choices"][0]["text"])
            name = 'vllm:spec_decode_num_draft_tokens_total{model_name="%s"}' % MODEL
            deadline = time.time() + 5
            while time.time() < deadline and server.metrics().get(name, 0) == 0:
                time.sleep(0.05)
            m = server.metrics()
            drafted = m[name]
            accepted = m['vllm:spec_decode_num_accepted_tokens_total{model_name="%s"}' % MODEL]
            self.assertGreater(drafted, 0)
            self.assertGreater(accepted, 0)
            self.assertLessEqual(accepted, drafted)
            self.assertIn('vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="%s",position="3"}' % MODEL, m)
            # One latency per step that gave tokens (vLLM's count): first-token plus inter-token
            # observations are the generated tokens less the accepted drafts.
            k = lambda n: '%s{model_name="%s"}' % (n, MODEL)
            observed = lambda m: (m[k("vllm:time_to_first_token_seconds_count")] +
                                  m[k("vllm:inter_token_latency_seconds_count")])
            expected = lambda m: (m[k("vllm:generation_tokens_total")] -
                                  m[k("vllm:spec_decode_num_accepted_tokens_total")])
            deadline = time.time() + 5
            while time.time() < deadline and observed(server.metrics()) != expected(server.metrics()):
                time.sleep(0.05)
            m = server.metrics()
            self.assertEqual(observed(m), expected(m))
        finally:
            server.stop()
        with open(server.log_path) as f:
            log = f.read()
        self.assertIn("speculative decoding: ngram, 4 draft tokens", log)
        self.assertIn("SpecDecoding metrics: Mean acceptance length:", log)
        for value, needle in (('{"method": "eagle3", "model": "/nonexistent", "num_speculative_tokens": 3}',
                               "speculative model"),
                              ('{"method": "eagle3", "num_speculative_tokens": 3}', "needs \"model\""),
                              ('{"method": "medusa", "num_speculative_tokens": 3}', "not supported"),
                              ("{nope", "not JSON"),
                              ('{"method": "ngram"}', "num_speculative_tokens is required"),
                              ('{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}', "unknown key")):
            out = subprocess.run([ARGS.m3serve, "serve", ARGS.fixture, "--speculative-config", value],
                                 capture_output=True, text=True, timeout=60)
            self.assertNotEqual(out.returncode, 0, value)
            self.assertIn(needle, out.stderr + out.stdout)

    def test_eagle3_speculative_decoding(self):
        # An EAGLE-3 draft (random weights, made by `m3serve make-draft`) reads the model's hidden
        # states after every step; its drafts are verified like ngram's, so the output is the plain
        # server's: same text, token ids and logprobs, greedy and seeded, streamed or not.
        draft = os.path.join(ARGS.work, "eagle3-draft")
        out = subprocess.run([ARGS.m3serve, "make-draft", "--target", ARGS.fixture, "--out", draft],
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        spec = json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": 3})
        server = Server(api_key=None, extra=["--speculative-config", spec])
        try:
            prompt = [301, 12, 77, 450, 8, 199, 64, 23] * 5  # no prefix shared with other tests
            for extra in ({"temperature": 0, "logprobs": 2}, {"temperature": 0.8, "seed": 11}):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "ignore_eos": True,
                        "return_token_ids": True, **extra}
                st_a, a = self.server.json("POST", "/v1/completions", body)
                st_b, b = server.json("POST", "/v1/completions", body)
                self.assertEqual((st_a, st_b), (200, 200), (a, b))
                ca, cb = a["choices"][0], b["choices"][0]
                self.assertEqual((ca["text"], ca["token_ids"]), (cb["text"], cb["token_ids"]))
                if "logprobs" in extra:
                    self.assertEqual(ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"])
            # Concurrent requests: each its own draft state, outputs unchanged.
            bodies = [{"model": MODEL, "prompt": prompt[i:] + [i], "max_tokens": 20, "temperature": 0,
                       "ignore_eos": True} for i in range(4)]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                outs = list(pool.map(lambda b: server.json("POST", "/v1/completions", b), bodies))
            for body, (st, r) in zip(bodies, outs):
                self.assertEqual(st, 200, r)
                self.assertEqual(r["choices"][0]["text"],
                                 self.server.json("POST", "/v1/completions", body)[1]["choices"][0]["text"])
            name = 'vllm:spec_decode_num_draft_tokens_total{model_name="%s"}' % MODEL
            deadline = time.time() + 5
            while time.time() < deadline and server.metrics().get(name, 0) == 0:
                time.sleep(0.05)
            self.assertGreater(server.metrics()[name], 0)
        finally:
            server.stop()
        with open(server.log_path) as f:
            self.assertIn("speculative decoding: EAGLE-3 draft", f.read())

    def test_kv_offloading(self):
        # A 24-block pool (384 tokens): two long prompts evict the first one's blocks, which come back
        # from host memory as a prefix hit with the same answer.
        server = Server(api_key=None, blocks=24, extra=["--kv-offloading-size", "0.01"])
        try:
            def ask(prompt):
                st, r = server.json("POST", "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                                 "temperature": 0, "logprobs": 1, "ignore_eos": True})
                self.assertEqual(st, 200, r)
                return r
            a = [(i * 7) % 400 + 3 for i in range(120)]
            first = ask(a)
            ask([(i * 11) % 400 + 5 for i in range(150)])
            ask([(i * 13) % 400 + 9 for i in range(150)])
            again = ask(a)
            self.assertEqual(again["usage"]["prompt_tokens_details"]["cached_tokens"], 112)  # 7 blocks of 16
            self.assertEqual(again["choices"][0]["text"], first["choices"][0]["text"])
            self.assertEqual(again["choices"][0]["logprobs"]["token_logprobs"],
                             first["choices"][0]["logprobs"]["token_logprobs"])
            m = server.metrics()
            self.assertGreater(m['m3:kv_offload_loaded_blocks_total{model_name="%s"}' % MODEL], 0)
            self.assertGreater(m['m3:kv_offload_stored_blocks_total{model_name="%s"}' % MODEL], 0)
            self.assertGreater(m['m3:kv_offload_blocks_total{model_name="%s"}' % MODEL], 0)
        finally:
            server.stop()
        with open(server.log_path) as f:
            self.assertIn("KV offloading:", f.read())
        for flags, needle in ((["--kv-offloading-size", "1", "--no-enable-prefix-caching"], "prefix caching"),
                              (["--kv-offloading-size", "1", "--kv-offloading-backend", "lmcache"], "native"),
                              (["--kv-offloading-size", "-1"], "--kv-offloading-size")):
            out = subprocess.run([ARGS.m3serve, "serve", ARGS.fixture, *flags], capture_output=True, text=True, timeout=60)
            self.assertNotEqual(out.returncode, 0, flags)
            self.assertIn(needle, out.stderr + out.stdout)

    def test_disaggregated_prefill(self):
        # A prefill server (kv_producer), a decode server (kv_consumer) and `m3serve disagg-proxy`:
        # through the proxy the decode server fetches the prompt's KV blocks instead of computing
        # them, and every answer (text, token ids, logprobs; streamed or not; chat too) is the plain
        # server's. A transfer the decode server cannot fetch is computed there (recompute), or
        # refused with 502 under kv_load_failure_policy fail.
        producer = Server(api_key=None, extra=["--kv-transfer-config", json.dumps({"kv_role": "kv_producer"})])
        consumer = Server(api_key=None, extra=["--kv-transfer-config", json.dumps({"kv_role": "kv_consumer"})])
        strict = Server(api_key=None, extra=["--kv-transfer-config",
                                             json.dumps({"kv_role": "kv_consumer", "kv_load_failure_policy": "fail"})])
        proxy = Proxy(producer.port, consumer.port)
        via_proxy = proxy.post

        try:
            prompt = [17, 402, 33, 250, 9, 118, 76, 301] * 9  # 72 tokens: 4 full blocks of 16 cross over
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 2,
                    "ignore_eos": True, "return_token_ids": True}
            st, d = via_proxy("/v1/completions", body)
            self.assertEqual(st, 200, d)
            st, ref = self.server.json("POST", "/v1/completions", body)
            self.assertEqual(st, 200, ref)
            cd, cr = d["choices"][0], ref["choices"][0]
            self.assertEqual((cd["text"], cd["token_ids"]), (cr["text"], cr["token_ids"]))
            self.assertEqual(cd["logprobs"]["token_logprobs"], cr["logprobs"]["token_logprobs"])
            self.assertEqual(d["usage"]["prompt_tokens_details"]["cached_tokens"], 64)
            self.assertEqual(d["usage"]["completion_tokens"], 12)
            # Streamed, and chat.
            st, chunks = via_proxy("/v1/completions", dict(body, prompt=prompt[1:] + [5], stream=True,
                                                             stream_options={"include_usage": True}), stream=True)
            self.assertEqual(st, 200)
            st, plain = self.server.json("POST", "/v1/completions", dict(body, prompt=prompt[1:] + [5]))
            self.assertEqual("".join(c["choices"][0]["text"] for c in chunks if c["choices"]), plain["choices"][0]["text"])
            self.assertEqual(chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"], 64)
            messages = [{"role": "user", "content": "Tell me about the river and the old mill by the bridge " * 4}]
            chat = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0}
            st, d = via_proxy("/v1/chat/completions", chat)
            self.assertEqual(st, 200, d)
            self.assertGreater(d["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            self.assertEqual(d["choices"][0]["message"]["content"],
                             self.server.json("POST", "/v1/chat/completions", chat)[1]["choices"][0]["message"]["content"])
            # The producer's view: blocks kept, fetched and acknowledged (none left held).
            pm, cm = producer.metrics(), consumer.metrics()
            key = '{model_name="%s"}' % MODEL
            self.assertGreater(pm["m3:kv_transfer_exported_blocks_total" + key], 0)
            self.assertGreater(cm["m3:kv_transfer_imported_blocks_total" + key], 0)
            self.assertEqual(cm["m3:kv_transfer_failures_total" + key], 0)
            # Errors of the request itself come back from the prefill server with their status.
            st, e = via_proxy("/v1/completions", dict(body, temperature=-1))
            self.assertEqual(st, 400, e)
            self.assertIn("temperature", e["error"]["message"])
            # A transfer that is not there: computed (recompute policy), or 502 (fail policy).
            gone = dict(body, prompt=prompt[2:] + [7, 8], kv_transfer_params={
                "do_remote_prefill": True, "remote_url": "http://127.0.0.1:%d" % producer.port, "transfer_id": "ab12"})
            st, r = consumer.json("POST", "/v1/completions", gone)
            self.assertEqual(st, 200, r)
            self.assertEqual(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            self.assertEqual(consumer.metrics()["m3:kv_transfer_failures_total" + key], 1)
            st, r = strict.json("POST", "/v1/completions", gone)
            self.assertEqual(st, 502, r)
            self.assertIn("ab12", r["error"]["message"])
            # Roles are checked: a plain server neither keeps nor fetches blocks.
            for params in ({"do_remote_decode": True}, gone["kv_transfer_params"]):
                st, r = self.server.json("POST", "/v1/completions", dict(body, kv_transfer_params=params))
                self.assertEqual(st, 400, r)
                self.assertIn("--kv-transfer-config", r["error"]["message"])
            st, r = producer.json("POST", "/v1/completions", dict(body, stream=True, kv_transfer_params={"do_remote_decode": True}))
            self.assertEqual(st, 400, r)
            st, r = producer.json("GET", "/v1/kv_transfer/0123abcd")
            self.assertEqual(st, 404, r)
        finally:
            proxy.stop()
            for s in (producer, consumer, strict):
                s.stop()
        for cfg, needle in (({"kv_role": "kv_server"}, "kv_role must be"),
                            ({"kv_role": "kv_producer", "kv_connector": "NixlConnector"}, "not built into m3serve"),
                            ({"kv_role": "kv_both", "kv_rank": 0}, "unknown key 'kv_rank'"),
                            ({"kv_role": "kv_producer"}, "needs prefix caching")):
            flags = ["--kv-transfer-config", json.dumps(cfg)]
            if cfg == {"kv_role": "kv_producer"}:
                flags.append("--no-enable-prefix-caching")
            out = subprocess.run([ARGS.m3serve, "serve", ARGS.fixture, *flags], capture_output=True, text=True, timeout=60)
            self.assertNotEqual(out.returncode, 0, cfg)
            self.assertIn(needle, out.stderr + out.stdout)
        out = subprocess.run([ARGS.m3serve, "disagg-proxy", "--prefill", "localhost:1", "--decode", "http://127.0.0.1:1"],
                             capture_output=True, text=True, timeout=60)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("is not an http://host:port URL", out.stderr + out.stdout)

    def test_disaggregated_prefill_device_memory(self):
        # M3CudaIpcConnector: exported pages stay in the producer's device memory until the consumer
        # copies them and acknowledges. A kv_both server is both ends here (on the CPU the memory is
        # shared within one process; tools/gpu_session54.sh runs two processes on a GPU). Slots come
        # back only when acknowledged; an export that does not fit goes through host memory.
        cfg = {"kv_connector": "M3CudaIpcConnector", "kv_role": "kv_both", "kv_buffer_size": 200000}
        server = Server(api_key=None, extra=["--kv-transfer-config", json.dumps(cfg)])
        proxy = Proxy(server.port, server.port)
        try:
            def prompt(seed):
                return [(seed * 31 + i * 17) % 480 + 11 for i in range(72)]  # 4 full blocks of 16

            def export(p):
                st, r = server.json("POST", "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 1,
                                                                "kv_transfer_params": {"do_remote_decode": True}})
                self.assertEqual(st, 200, r)
                return r["kv_transfer_params"]

            a = export(prompt(1))
            self.assertTrue(a["in_device_memory"])
            self.assertFalse(export(prompt(2))["in_device_memory"])  # a holds 4 of the 5 slots
            st, _ = server.request("DELETE", "/v1/kv_transfer/" + a["transfer_id"])
            self.assertEqual(st, 200)
            c = export(prompt(3))
            self.assertTrue(c["in_device_memory"])
            # The decode side copies c's pages into its KV cache, then acknowledges.
            body = {"model": MODEL, "prompt": prompt(3), "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                    "logprobs": 1}
            st, d = server.json("POST", "/v1/completions", dict(body, kv_transfer_params=c))
            self.assertEqual(st, 200, d)
            self.assertEqual(d["usage"]["prompt_tokens_details"]["cached_tokens"], 64)
            st, ref = self.server.json("POST", "/v1/completions", body)
            self.assertEqual(d["choices"][0]["text"], ref["choices"][0]["text"])
            self.assertEqual(d["choices"][0]["logprobs"]["token_logprobs"], ref["choices"][0]["logprobs"]["token_logprobs"])
            self.assertEqual(server.request("GET", "/v1/kv_transfer/" + c["transfer_id"])[0], 404)  # acknowledged
            # Through the proxy, twice: each export's slots come back for the next one.
            for seed in (4, 5):
                st, r = proxy.post("/v1/completions", dict(body, prompt=prompt(seed)))
                self.assertEqual(st, 200, r)
                self.assertEqual(r["usage"]["prompt_tokens_details"]["cached_tokens"], 64)
                self.assertEqual(r["choices"][0]["text"],
                                 self.server.json("POST", "/v1/completions", dict(body, prompt=prompt(seed)))[1]["choices"][0]["text"])
            self.assertTrue(export(prompt(6))["in_device_memory"])
            self.assertEqual(server.metric("m3:kv_transfer_failures_total"), 0)
        finally:
            proxy.stop()
            server.stop()

    def test_cors(self):
        def call(method, path, headers, body=None):
            conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=60)
            conn.request(method, path, body=json.dumps(body) if body else None, headers=headers)
            resp = conn.getresponse()
            out = (resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
            conn.close()
            return out
        origin = {"Origin": "http://ui.example"}
        # The preflight needs no API key; any origin is allowed by default, as in vLLM.
        st, h, body = call("OPTIONS", "/v1/chat/completions", {**origin, "Access-Control-Request-Method": "POST",
                                                                "Access-Control-Request-Headers": "authorization,content-type"})
        self.assertEqual((st, body), (200, b"OK"))
        self.assertEqual(h["access-control-allow-origin"], "*")
        self.assertIn("POST", h["access-control-allow-methods"])
        self.assertEqual(h["access-control-allow-headers"], "authorization,content-type")
        # Answers carry the origin header, a 401 too (the page must be able to read it).
        st, h, _ = call("POST", "/v1/chat/completions", {**origin, "Content-Type": "application/json",
                                                          "Authorization": "Bearer " + API_KEY}, self.chat())
        self.assertEqual((st, h.get("access-control-allow-origin")), (200, "*"))
        st, h, _ = call("GET", "/v1/models", origin)
        self.assertEqual((st, h.get("access-control-allow-origin")), (401, "*"))
        st, h, _ = call("GET", "/health", {})
        self.assertNotIn("access-control-allow-origin", h)  # not a cross-origin request

    def test_cors_restricted(self):
        server = Server(api_key=None, extra=["--allowed-origins", '["http://ok.example"]', "--allow-credentials"])
        try:
            def preflight(origin):
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
                conn.request("OPTIONS", "/v1/completions", headers={"Origin": origin,
                                                                    "Access-Control-Request-Method": "POST"})
                resp = conn.getresponse()
                out = (resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
                conn.close()
                return out
            st, h, _ = preflight("http://ok.example")
            self.assertEqual((st, h["access-control-allow-origin"], h["access-control-allow-credentials"]),
                             (200, "http://ok.example", "true"))
            st, h, body = preflight("http://evil.example")
            self.assertEqual((st, body), (400, b"Disallowed CORS origin"))
            self.assertNotIn("access-control-allow-origin", h)
        finally:
            server.stop()
        # A malformed flag stops the server before it loads the model, naming the flag.
        out = subprocess.run([ARGS.m3serve, "serve", ARGS.fixture, "--allowed-origins", '["x", 1]'],
                             capture_output=True, text=True, timeout=60)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("--allowed-origins", out.stderr + out.stdout)

    def test_responses_bad_inputs(self):
        path = "/v1/responses"
        self.check_error({"model": MODEL}, "input", path=path)
        self.check_error({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                         "input_image", path=path, param="input[0].content[0].type")
        self.check_error({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "web_search", path=path,
                         param="tools[0].type")
        self.check_error({"model": MODEL, "input": "x", "max_output_tokens": 5000}, "max_output_tokens", path=path)
        self.check_error({"model": MODEL, "input": "word " * 3000}, "maximum context length", path=path, param="input")
        self.check_error({"model": MODEL, "input": "x", "background": True}, "background", path=path)
        self.check_error(None, "malformed JSON", path=path, raw="{", param="body")
        self.check_error({"model": "nope", "input": "x"}, "does not exist", status=404, path=path,
                         etype="NotFoundError", param="model")
        st, payload = self.server.request("GET", "/v1/responses/resp_missing")
        self.assertEqual(st, 404, payload)
        self.assertEqual(json.loads(payload)["error"]["code"], "response_not_found")

    def test_bad_inputs(self):
        self.check_error(None, "", raw="{not json", path="/v1/chat/completions")
        self.check_error(None, "", raw="[1, 2]", path="/v1/completions")
        self.check_error(self.chat(temperature="hot"), "temperature")
        self.check_error(self.chat(max_tokens="5"), "max_tokens")
        self.check_error(self.chat(stream="yes"), "stream")
        self.check_error(self.chat(messages="hi"), "messages")
        self.check_error(self.chat(n=0), "n")
        self.check_error(self.chat(max_tokens=0), "max_tokens")
        self.check_error(self.chat(max_completion_tokens=-1), "max_completion_tokens")
        self.check_error(self.chat(temperature=-0.5), "temperature")
        self.check_error(self.chat(top_p=1.5), "top_p")
        self.check_error(self.chat(top_logprobs=3), "top_logprobs")
        self.check_error(self.chat(stop=[1]), "stop")
        self.check_error(self.chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role")
        self.check_error(self.chat(messages=[{"role": "user", "content": "x"},
                                             {"role": "tool", "tool_call_id": "c", "content": "r"}]), "messages[1]")
        self.check_error(self.chat(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools[0].function.name")
        self.check_error(self.chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
                         "tools[0].function.parameters")
        self.check_error(self.chat(tools=[{"type": "retrieval"}]), "tools[0].type")
        self.check_error(self.chat(tool_choice={"type": "function", "function": {"name": "nope"}},
                                   tools=[WEATHER_TOOL]), "tool_choice")
        self.check_error(self.chat(chat_template_kwargs={"thinking_mode": "sometimes"}), "thinking_mode")
        long_prompt = "word " * 3000
        self.check_error({"model": MODEL, "prompt": long_prompt, "max_tokens": 2}, "prompt", path="/v1/completions")
        self.check_error({"model": MODEL, "prompt": "hi", "max_tokens": 2100}, "max_tokens", path="/v1/completions")
        self.check_error({"model": MODEL, "prompt": [99999], "max_tokens": 2}, "", path="/v1/completions")
        self.check_error({"model": MODEL, "max_tokens": 2}, "prompt", path="/v1/completions")
        self.check_error(self.chat(logit_bias={"99999": 1}), "logit_bias")
        self.check_error(self.chat(logit_bias={"5": 150}), "logit_bias")
        self.check_error(self.chat(logit_bias={"x": 1}), "logit_bias")
        err = self.check_error(self.chat(model="gpt-9"), "gpt-9", status=404, etype="NotFoundError", param="model")
        self.assertEqual(err["param"], "model")
        # Unknown route, bad key, /health without a key.
        st, payload = self.server.request("GET", "/v1/nothing")
        self.assertEqual(st, 404)
        self.assertEqual(json.loads(payload)["error"]["type"], "NotFoundError")
        st, payload = self.server.request("GET", "/v1/models", auth=False)
        self.assertEqual(st, 401)
        self.assertEqual(json.loads(payload)["error"]["type"], "AuthenticationError")
        st, _ = self.server.request("GET", "/metrics", headers={"Authorization": "Bearer wrong"})
        self.assertEqual(st, 401)
        self.assertEqual(self.server.request("GET", "/health", auth=False)[0], 200)
        # The SDK surfaces these as typed errors.
        import openai
        with self.assertRaises(openai.BadRequestError):
            self.server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=0)
        with self.assertRaises(openai.NotFoundError):
            self.server.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])

    # ---- load --------------------------------------------------------------------------------

    def test_many_concurrent_streams(self):
        num = 1000
        self.server.close_clients()  # idle SDK connections from earlier tests
        gc.collect()
        body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True,
                           "ignore_eos": True}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer " +
                   API_KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: " +
                   str(len(body)).encode() + b"\r\n\r\n" + body)

        async def one():
            reader, writer = await asyncio.open_connection("127.0.0.1", self.server.port)
            writer.write(request)
            await writer.drain()
            data = await reader.read()
            writer.close()
            return data

        async def run_all():
            return await asyncio.wait_for(asyncio.gather(*[one() for _ in range(num)], return_exceptions=True), 120)

        results = asyncio.run(run_all())
        done = refused = 0
        for r in results:
            self.assertNotIsInstance(r, Exception, r)
            head = r.split(b"\r\n", 1)[0]
            if b" 200 " in head:
                self.assertIn(b"data: [DONE]", r)
                self.assertIn(b'"finish_reason":"length"', r)
                done += 1
            else:
                self.assertIn(b" 503 ", head)
                self.assertIn(b'"error"', r)
                refused += 1
        self.assertEqual(done + refused, num)
        self.assertGreater(done, 0)
        self.assertEqual(self.server.request("GET", "/health")[0], 200)
        print("\n1000 streams: %d completed, %d refused with 503" % (done, refused), file=sys.stderr)


NS = "]<]minimax[>["
SCRIPT = ("<mm:think>The user wants the weather.</mm:think>Checking now." + NS + "<tool_call>\n" + NS +
          "<invoke name=\"get_weather\">" + NS + "<city>San Francisco" + NS + "</city>" + NS + "<days>14" + NS +
          "</days>" + NS + "</invoke>\n" + NS + "</tool_call>")


class ToolCallTest(unittest.TestCase):
    """Known output through the real HTTP stack: m3serve_scripted (test-only) runs `serve` with
    an engine replaying SCRIPT as the model's tokens (a random model never writes a tool call)."""

    @classmethod
    def setUpClass(cls):
        path = os.path.join(ARGS.work, "tool_script.txt")
        with open(path, "w") as f:
            f.write(SCRIPT)
        cls.server = Server(script=path)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def request(self, **kw):
        return dict(model=MODEL, messages=[{"role": "user", "content": "Weather in SF for two weeks?"}],
                    tools=[WEATHER_TOOL], max_tokens=200, **kw)

    def test_tool_call_non_stream(self):
        r = self.server.client().chat.completions.create(**self.request())
        msg = r.choices[0].message
        self.assertEqual(msg.model_dump()["reasoning"], "The user wants the weather.")  # vLLM's current name too
        self.assertEqual(r.choices[0].finish_reason, "tool_calls")
        self.assertEqual(msg.reasoning_content, "The user wants the weather.")
        self.assertEqual(msg.content, "Checking now.")
        self.assertEqual(len(msg.tool_calls), 1)
        self.assertEqual(msg.tool_calls[0].type, "function")
        self.assertEqual(msg.tool_calls[0].function.name, "get_weather")
        self.assertEqual(json.loads(msg.tool_calls[0].function.arguments), {"city": "San Francisco", "days": 14})
        self.assertTrue(msg.tool_calls[0].id)

    def test_tool_call_streamed_arguments(self):
        calls, fragments, reasoning, content, finish = {}, 0, "", "", None
        for chunk in self.server.client().chat.completions.create(stream=True, **self.request()):
            for ch in chunk.choices:
                d = ch.delta
                reasoning += getattr(d, "reasoning_content", None) or ""
                content += d.content or ""
                for tc in d.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                    if tc.id:
                        entry["id"] = tc.id
                    if tc.function and tc.function.name:
                        entry["name"] = tc.function.name
                    if tc.function and tc.function.arguments:
                        entry["arguments"] += tc.function.arguments
                        fragments += 1
                finish = ch.finish_reason or finish
        self.assertEqual(reasoning, "The user wants the weather.")
        self.assertEqual(content, "Checking now.")
        self.assertEqual(list(calls), [0])
        self.assertEqual(calls[0]["name"], "get_weather")
        self.assertEqual(json.loads(calls[0]["arguments"]), {"city": "San Francisco", "days": 14})
        self.assertGreater(fragments, 3)  # the arguments arrive incrementally
        self.assertEqual(finish, "tool_calls")

    def test_tool_choice_none_drops_the_call(self):
        r = self.server.client().chat.completions.create(tool_choice="none", **self.request())
        self.assertIsNone(r.choices[0].message.tool_calls)
        self.assertEqual(r.choices[0].finish_reason, "stop")

    def test_responses_function_call_round_trip(self):
        c = self.server.client()
        tool = {"type": "function", **WEATHER_TOOL["function"]}
        r = c.responses.create(model=MODEL, input="Weather in SF for two weeks?", tools=[tool], max_output_tokens=200)
        self.assertEqual(r.status, "completed")
        self.assertEqual([item.type for item in r.output], ["reasoning", "message", "function_call"])
        self.assertEqual(r.output[0].content[0].text, "The user wants the weather.")
        self.assertEqual(r.output_text, "Checking now.")
        call = r.output[2]
        self.assertEqual(call.name, "get_weather")
        self.assertEqual(json.loads(call.arguments), {"city": "San Francisco", "days": 14})
        self.assertTrue(call.call_id.startswith("call_"))
        self.assertEqual(r.tools[0].name, "get_weather")
        # The tool's result goes back with the call's id; the conversation continues from the store.
        follow = c.responses.create(model=MODEL, previous_response_id=r.id, tools=[tool], max_output_tokens=200,
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": "{\"temp_c\": 18}"}])
        self.assertEqual(follow.status, "completed")
        items = c.responses.input_items.list(follow.id).data
        self.assertEqual([(i.type, i.call_id) for i in items], [("function_call_output", call.call_id)])
        self.assertGreater(follow.usage.input_tokens, r.usage.input_tokens + r.usage.output_tokens)
        # The same conversation sent whole (items as returned) renders the same prompt.
        whole = c.responses.create(model=MODEL, tools=[tool], max_output_tokens=200, input=[
            {"role": "user", "content": "Weather in SF for two weeks?"},
            *[item.model_dump(exclude_none=True) for item in r.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "{\"temp_c\": 18}"}])
        self.assertEqual(whole.usage.input_tokens, follow.usage.input_tokens)
        page = c.responses.input_items.list(whole.id, order="asc", limit=2)
        self.assertEqual([i.type for i in page.data], ["message", "reasoning"])
        self.assertTrue(page.has_more)
        self.assertEqual([i.type for i in c.responses.input_items.list(whole.id, order="asc", after=page.data[1].id)],
                         ["message", "function_call", "function_call_output"])

    def test_responses_stream_events(self):
        tool = {"type": "function", **WEATHER_TOOL["function"]}
        events = list(self.server.client().responses.create(
            model=MODEL, input="Weather?", tools=[tool], max_output_tokens=200, stream=True))
        types = [e.type for e in events]
        self.assertEqual(types[-1], "response.completed")
        self.assertEqual([e.item.type for e in events if e.type == "response.output_item.added"],
                         ["reasoning", "message", "function_call"])
        self.assertEqual(types.count("response.output_item.done"), 3)
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        self.assertEqual(reasoning, "The user wants the weather.")
        self.assertGreater(types.count("response.function_call_arguments.delta"), 3)  # incremental
        final = events[-1].response
        self.assertEqual(final.output[2].arguments, args)
        self.assertEqual(final.output_text, "Checking now.")

    def test_reasoning_sent_back_under_either_name(self):
        # The previous turn's reasoning comes back as `reasoning` (vLLM's name) or `reasoning_content`:
        # both render the same prompt.
        turn = lambda key: [{"role": "user", "content": "x"},
                            {"role": "assistant", "content": "ok", key: "Thought about it."},
                            {"role": "user", "content": "y"}]
        counts = [self.server.json("POST", "/tokenize", {"model": MODEL, "messages": turn(k)})[1]["tokens"]
                  for k in ("reasoning", "reasoning_content")]
        self.assertEqual(counts[0], counts[1])
        plain = self.server.json("POST", "/tokenize", {"model": MODEL, "messages": turn("other")})[1]["tokens"]
        self.assertNotEqual(counts[0], plain)

    def test_thinking_enabled_and_stop_string(self):
        r = self.server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=200, stop=["now"],
            extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}})
        self.assertEqual(r.choices[0].message.reasoning_content, "The user wants the weather.")
        self.assertEqual(r.choices[0].message.content, "Checking ")
        self.assertEqual(r.choices[0].finish_reason, "stop")


class SlowModelTest(unittest.TestCase):
    """A scripted model that takes 20 ms a step: long enough to leave in the middle."""

    def test_client_disconnect_aborts_a_plain_request(self):
        path = os.path.join(ARGS.work, "long_script.txt")
        with open(path, "w") as f:
            f.write("word " * 800)
        server = Server(api_key=None, script=path, script_extra=["--step-delay-ms", "20"])
        try:
            # Not streamed: the answer's leading spaces are the writes that notice the client is gone.
            sock = socket.create_connection(("127.0.0.1", server.port))
            body = json.dumps({"model": MODEL, "prompt": "Go", "max_tokens": 700}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            got = b""
            while b"\r\n\r\n" not in got or not got.split(b"\r\n\r\n", 1)[1]:
                got += sock.recv(4096)  # the headers, then the first probe (after 2 s)
            self.assertIn(b"Transfer-Encoding: chunked", got)
            self.assertEqual(server.metric("vllm:num_requests_running"), 1)
            sock.close()
            t0 = time.time()
            aborted = lambda: server.metric("vllm:request_success_total", 'finished_reason="abort"')
            # The disconnect is counted when the write fails; the abort when the engine thread ends it.
            while time.time() - t0 < 10 and (server.metric("m3:client_disconnects_total") < 1 or aborted() < 1):
                time.sleep(0.05)
            self.assertEqual(server.metric("m3:client_disconnects_total"), 1)
            # Aborted long before its 700 steps (14 s) would have ended.
            self.assertEqual(server.metric("vllm:request_success_total", 'finished_reason="abort"'), 1)
            self.assertEqual(server.metric("vllm:request_success_total", 'finished_reason="length"'), 0)
            self.assertLess(time.time() - t0, 8)
        finally:
            server.stop()


class ShutdownTest(unittest.TestCase):
    def test_sigterm_drains_in_flight(self):
        server = Server(api_key=None)
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"model": MODEL, "prompt": "Drain me", "max_tokens": 40, "stream": True, "ignore_eos": True}),
                headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.assertEqual(resp.status, 200)
            first = resp.readline()
            self.assertTrue(first.startswith(b"data: "), first)
            server.proc.send_signal(signal.SIGTERM)
            rest = resp.read()
            self.assertIn(b"[DONE]", rest)
            self.assertIn(b'"finish_reason":"length"', rest)
            self.assertEqual(server.proc.wait(30), 0)  # the idle keep-alive connection does not hold it up
            conn.close()
        finally:
            server.stop()


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--m3serve", required=True)
    parser.add_argument("--m3serve-scripted", required=True)
    parser.add_argument("--fixture", required=True)
    ARGS, rest = parser.parse_known_args()
    try:
        import openai  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        print("SKIP: python package missing: %s" % e)
        return 77
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # 1000 client sockets at once
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    ARGS.work = os.path.dirname(os.path.abspath(ARGS.fixture))
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "make_fixture.py"), ARGS.m3serve,
                    ARGS.fixture], check=True)
    prog = unittest.main(argv=[sys.argv[0], *rest], exit=False, verbosity=2)
    return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
