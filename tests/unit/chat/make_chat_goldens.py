#!/usr/bin/env python3
"""Renders varied conversations through the real MiniMax-M3 chat_template.jinja with jinja2,
set up the way HF transformers' apply_chat_template does, and writes goldens for the C++ test.

Usage: make_chat_goldens.py TEMPLATE_PATH OUT_JSON
Writes OUT_JSON.SKIP (with the reason) instead when the template or jinja2 is missing.
"""
import json
import os
import sys

NS = "]<]minimax[>["

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "strict": True,
    "description": "Search the web.\nReturns JSON with \\\"results\\\"; 支持中文 😀",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "max_results": {"type": "number", "default": 5.0},
        "filters": {"type": "object", "properties": {
            "site": {"type": "string"}, "after": {"type": ["string", "null"]}}},
        "tags": {"type": "array", "items": {"type": "string"}},
        "safe": {"type": "boolean"}}, "required": ["query"]}}}
NOPARAM = {"type": "function", "function": {"name": "now", "description": "Current time."}}
CALL_WEATHER = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}
CALL_SEARCH = {"id": "call_2", "type": "function", "function": {"name": "search_web", "arguments": {
    "query": "m3 \"serving\" <fast> & cheap", "max_results": 2.5, "safe": False,
    "filters": {"site": "example.com", "after": None, "nested": {"deep": [1, {"x": True}]}},
    "tags": ["a", "b", None, 3, -4.25e-7, 1e16, 12345678901234], "ignored": None}}}
CALL_STRING_ARGS = {"id": "call_3", "type": "function", "function": {
    "name": "search_web", "arguments": json.dumps({"zeta": 1, "alpha": [True, False], "mid": {"b": 2, "a": 1}})}}
CALL_FLAT = {"name": "now", "arguments": {}}

U = lambda text: {"role": "user", "content": text}
A = lambda text, **kw: dict({"role": "assistant", "content": text}, **kw)
T = lambda text: {"role": "tool", "content": text}

CASES = [
    ("user_only_undefined_mode", [U("Hello!")], None, {}),
    ("system_enabled", [{"role": "system", "content": "Be terse."}, U("2+2?")], None, {"thinking_mode": "enabled"}),
    ("developer_disabled", [{"role": "developer", "content": "Answer in French."}, U("Hi")], None, {"thinking_mode": "disabled"}),
    ("root_system_adaptive", [{"role": "root", "content": "ROOT PROMPT"}, {"role": "system", "content": "dev prompt"}, U("q")], None, {"thinking_mode": "adaptive"}),
    ("root_only", [{"role": "root", "content": "Only root."}, U("x")], None, {"thinking_mode": "enabled"}),
    ("root_developer_list", [{"role": "root", "content": [{"type": "text", "text": "R1 "}, {"type": "text", "text": "R2"}]},
                             {"role": "developer", "content": [{"type": "text", "text": "D"}, "plain", {"type": "image"}]}, U("u")], None, {}),
    ("user_multimodal", [U([{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": " and "},
                            {"type": "video"}, {"type": "audio"}, "tail"])], None, {"thinking_mode": "disabled"}),
    ("history_reasoning_content", [U("a"), A("answer A", reasoning_content="think A"), U("b")], None, {"thinking_mode": "enabled"}),
    ("history_inline_think", [U("a"), A("<mm:think>\ninline reasoning\n</mm:think>\n\nvisible"), U("b")], None, {}),
    ("history_inline_odd", [U("a"), A("\n\npre<mm:think>r1<mm:think>r2\n</mm:think>mid</mm:think>\n\nend\n"), U("b")], None, {}),
    ("reasoning_empty_string_keeps_content", [U("a"), A("x</mm:think>y", reasoning_content=""), U("b")], None, {}),
    ("reasoning_null", [U("a"), A("no think", reasoning_content=None), U("b")], None, {"thinking_mode": "adaptive"}),
    ("tools_advertised", [U("weather?")], [WEATHER, SEARCH, NOPARAM], {"thinking_mode": "enabled"}),
    ("tool_call_roundtrip", [U("weather in Paris?"), A(None, tool_calls=[CALL_WEATHER]),
                             {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}],
     [WEATHER], {"thinking_mode": "enabled"}),
    ("tool_call_nested_args", [U("search"), A("Let me search.", reasoning_content="need search", tool_calls=[CALL_SEARCH, CALL_STRING_ARGS]),
                               T("r1"), T("r2")], [SEARCH], {}),
    ("tool_call_flat_no_function", [U("time?"), A("", tool_calls=[CALL_FLAT]), T("12:00")], [NOPARAM], {"thinking_mode": "disabled"}),
    ("grouped_tool_results", [U("both"), A(None, tool_calls=[CALL_WEATHER, CALL_FLAT]), T("sunny"), T("noon"), T("extra"),
                              U("thanks"), A("You're welcome.")], [WEATHER, NOPARAM], {}),
    ("tool_content_parts", [U("q"), A(None, tool_calls=[CALL_WEATHER]),
                            T([{"type": "text", "text": "part1 "}, {"type": "image"}, {"output": "out"}, {"type": "video"},
                               "str", {"type": "text", "text": "end"}])], [WEATHER], {}),
    ("tool_after_user_after_call", [U("q"), A(None, tool_calls=[CALL_WEATHER]), U("interject"), T("late result")], [WEATHER], {}),
    ("no_generation_prompt", [U("hi"), A("hello")], None, {"add_generation_prompt": False}),
    ("continue_last_assistant", [U("hi"), A("partial")], None, {"add_generation_prompt": False, "thinking_mode": "enabled"}),
    ("empty_system_defaults", [{"role": "system", "content": ""}, U("x")], None, {}),
    ("empty_root_defaults", [{"role": "root", "content": ""}, {"role": "developer", "content": None}, U("x")], None, {"thinking_mode": "disabled"}),
    ("model_identity", [U("who are you")], None, {"model_identity": "You are M3-Bot."}),
    ("mid_conversation_system_ignored", [U("a"), {"role": "system", "content": "late system"}, A("b"), {"role": "developer", "content": "late dev"}, U("c")], None, {}),
    ("unicode_content", [{"role": "system", "content": "Réponds en 中文 😀"}, U("こんにちは\n\t\"quoted\" \\ back"), A("你好！👋")], None, {"thinking_mode": "adaptive"}),
    ("numeric_content", [U(42), A(3.5), U(True)], None, {}),
    ("empty_tool_calls_list", [U("a"), A("plain", tool_calls=[]), U("b")], None, {}),
    ("everything", [{"role": "root", "content": "root"}, {"role": "developer", "content": "dev"},
                    U([{"type": "text", "text": "img:"}, {"type": "image"}]),
                    A("I'll check.", reasoning_content="Plan: call tools.", tool_calls=[CALL_WEATHER, CALL_SEARCH]),
                    T("sunny"), T([{"type": "text", "text": "results"}]),
                    A("<mm:think>summarise</mm:think>Done: sunny."), U("again"),
                    A(None, tool_calls=[CALL_STRING_ARGS]), T("ok")], [WEATHER, SEARCH, NOPARAM], {"thinking_mode": "enabled"}),
    ("empty_messages", [], None, {}),
    ("tools_empty_list", [U("x")], [], {"thinking_mode": "disabled"}),
    ("float_args", [U("f"), A(None, tool_calls=[{"type": "function", "function": {"name": "search_web", "arguments": {
        "a": 1.0, "b": 0.1, "c": 100.0, "d": 1e-05, "e": 123456789.125, "f": -0.0, "g": 1e100, "h": 0, "i": [], "j": {}}}}]), T("ok")],
     [SEARCH], {}),
]
ERROR_CASES = [
    ("tool_without_call", [U("a"), T("orphan")], None, {}),
    ("tool_after_plain_assistant", [U("a"), A(None, tool_calls=[CALL_WEATHER]), T("r"), A("done"), T("orphan")], None, {}),
]


def hf_environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2 import TemplateError

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def preprocess(messages):
    """What OpenAI-compatible servers do before templating: string arguments -> dict."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for call in m.get("tool_calls") or []:
            body = call.get("function") or call
            if isinstance(body.get("arguments"), str):
                body["arguments"] = json.loads(body["arguments"])
    return out


def main():
    template_path, out_path = sys.argv[1], sys.argv[2]
    if not os.path.exists(template_path) and os.environ.get("M3_SHARED_DIR"):
        # A worktree outside the main checkout's parent: take the shared dir from the env.
        template_path = os.path.join(os.environ["M3_SHARED_DIR"], "data", "minimax-m3", "chat_template.jinja")
    skip_path = out_path + ".SKIP"
    if os.path.exists(skip_path):
        os.remove(skip_path)
    reason = None
    if not os.path.exists(template_path):
        reason = "chat template not found at " + template_path
    else:
        try:
            import jinja2  # noqa: F401
        except ImportError as e:
            reason = "python package 'jinja2' not importable: %s" % e
    if reason:
        with open(skip_path, "w") as f:
            f.write(reason)
        print("skip:", reason)
        return 0
    env = hf_environment()
    with open(template_path, encoding="utf-8") as f:
        template = env.from_string(f.read())
    goldens = []
    for name, messages, tools, options in CASES + ERROR_CASES:
        kwargs = {"messages": preprocess(messages), "tools": tools,
                  "add_generation_prompt": options.get("add_generation_prompt", True)}
        for key in ("thinking_mode", "model_identity"):
            if key in options:
                kwargs[key] = options[key]
        entry = {"name": name, "messages": messages, "tools": tools, "options": options}
        try:
            entry["expected"] = template.render(**kwargs)
        except Exception as e:  # the template raised: the C++ side must return an error
            entry["error"] = str(e)
        goldens.append(entry)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(goldens, f, ensure_ascii=False, indent=1)
    print("wrote %d chat goldens to %s" % (len(goldens), out_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
