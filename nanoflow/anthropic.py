"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) as a translation.

`chat_body` turns a Messages body into a chat body, which serve.py runs as any; `Translation` turns
the chat chunks into Anthropic's events and Message. It imports nothing; responses.py imports it.
"""

import json
import uuid
from collections.abc import Iterator
from contextlib import suppress

# chat's finish_reason in Anthropic's words (a stop string's "stop" is "stop_sequence")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
SAME = ("model", "stream", "temperature", "top_p", "top_k", "read_rate")  # as chat names them
# Anthropic's tool_choice types and Responses' tool_choice strings, as chat's; "tool" names one
TOOL_CHOICES = {"auto": "auto", "any": "required", "required": "required", "none": "none"}
THINKING = {"enabled": True, "adaptive": True, "disabled": False}  # its type: enable_thinking
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 503: "overloaded_error"}


def chat_body(body: dict) -> dict:
    """The chat body that asks what a Messages body asks; a ValueError says what is wrong."""
    if type(body.get("max_tokens")) is not int:
        raise ValueError("`max_tokens` is required: the most tokens to generate, an integer")
    system = body.get("system")
    messages = [{"role": "system", "content": text_of(system, "`system`")}] if system else []
    for i, message in enumerate(listed(body.get("messages"), "`messages`")):
        messages += chat_messages(i, message)
    chat = {name: body[name] for name in SAME if body.get(name) is not None}
    chat.update(messages=messages, max_tokens=body["max_tokens"], stop=body.get("stop_sequences"))
    chat["tools"] = chat_tools(body.get("tools"), "custom", "input_schema")
    chat["stream_options"] = {"include_usage": True}
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = chat_tool_choice(obj(choice).get("type"), choice)
        chat["parallel_tool_calls"] = obj(choice).get("disable_parallel_tool_use") is not True
    if body.get("thinking") is not None:
        if obj(body["thinking"]).get("type") not in THINKING:
            raise ValueError('`thinking` must be {"type": "enabled", "adaptive" or "disabled"}')
        chat["chat_template_kwargs"] = {"enable_thinking": THINKING[body["thinking"]["type"]]}
    return chat


def obj(value) -> dict:  # a value that is not an object has no fields
    return value if isinstance(value, dict) else {}


def listed(value, where: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list")
    return value


def text_of(content, where: str, kinds: tuple = ("text",)) -> str:
    """Content given as a string or as a list of text blocks (of these types), as one string."""
    if isinstance(content, str):
        return content
    blocks = content if isinstance(content, list) else [None]
    if not all(obj(b).get("type") in kinds and isinstance(b.get("text"), str) for b in blocks):
        raise ValueError(f"{where} must be a string or a list of {' or '.join(kinds)} blocks")
    return "\n".join(b["text"] for b in blocks)


def chat_messages(i: int, message) -> list[dict]:
    """One turn as chat messages: its tool results (role "tool") first, then its text with its
    tool_use blocks as tool_calls. Earlier thinking is not shown to the model again."""
    role, content = obj(message).get("role"), obj(message).get("content")
    if role not in ("user", "assistant"):
        raise ValueError(f'messages[{i}].role must be "user" or "assistant", not {role!r}')
    texts, calls, results = [], [], []
    given = [{"type": "text", "text": content}] if isinstance(content, str) else content
    for j, block in enumerate(listed(given, f"messages[{i}].content")):
        kind, where = obj(block).get("type"), f"messages[{i}].content[{j}]"
        if kind == "text":
            texts.append(text_of([block], where))
        elif kind == "tool_use" and role == "assistant":
            function = {"name": block.get("name"), "arguments": json.dumps(block.get("input"))}
            calls.append({"id": block.get("id"), "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            text, call_id = text_of(block.get("content", ""), where), block.get("tool_use_id")
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind not in ("thinking", "redacted_thinking"):
            raise ValueError(f"{where}: nanoflow reads no {role} {kind!r} blocks")
    turn = {"role": role, "content": "\n".join(texts), **({"tool_calls": calls} if calls else {})}
    return results + ([turn] if texts or calls else [])


def chat_tools(tools, kind: str, schema: str) -> list[dict]:
    out = []
    for i, tool in enumerate(listed(tools or [], "`tools`")):
        if not isinstance(tool, dict) or tool.get("type", "custom") != kind:
            raise ValueError(f"tools[{i}] must have type {kind!r}: nanoflow runs no built-in tools")
        function = {"name": tool.get("name"), "description": tool.get("description", "")}
        out.append({"type": "function", "function": {**function, "parameters": tool.get(schema)}})
    return out


def chat_tool_choice(kind, choice) -> str | dict:
    if kind in ("tool", "function"):
        return {"type": "function", "function": {"name": choice.get("name")}}
    if not (isinstance(kind, str) and kind in TOOL_CHOICES):
        raise ValueError(f"`tool_choice` must be one of {', '.join(TOOL_CHOICES)} or name a tool")
    return TOOL_CHOICES[kind]


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def blocks(chunks: Iterator[dict]) -> Iterator[tuple[str, str, object]]:
    """A chat answer's chunks as blocks of kind "thinking", "text" or "call" (a tool call):
    ("start", kind, call head or text), ("delta", kind, text or arguments), ("stop", kind,
    finish_reason if it is the last), then ("end", finish_reason, usage); or ("error", "",
    chat's error)."""
    kind, reason, usage = None, None, None
    for chunk in chunks:
        if "error" in chunk:
            yield "error", "", chunk["error"]
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            reason = choice["finish_reason"] or reason
            for part, value in delta_parts(choice["delta"]):
                if part == "call" or (part != kind and part != "arguments"):
                    if kind:
                        yield "stop", kind, None
                    kind = part
                    yield "start", kind, value
                if part != "call":
                    yield "delta", kind, value
    if kind:
        yield "stop", kind, reason
    yield "end", reason, usage


def delta_parts(delta: dict) -> list[tuple[str, object]]:
    parts = [("thinking", delta.get("reasoning_content")), ("text", delta.get("content"))]
    for call in delta.get("tool_calls", []):
        parts.append(("call", call if "id" in call else None))
        parts.append(("arguments", call["function"].get("arguments")))
    return [(part, value) for part, value in parts if value]


def event(kind: str, **data) -> tuple[str, dict]:
    return kind, {"type": kind, **data}


class Translation:
    """One answer's chat chunks as Anthropic's stream events, which build `whole`, the
    Message. Each event is to be sent as it comes: the objects in it change later."""

    def __init__(self, body: dict, reply):
        self.reply = reply
        self.whole = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant"}
        self.whole.update(model=reply.model, content=[], stop_reason=None, stop_sequence=None)
        self.whole["usage"] = {"input_tokens": reply.num_prompt, "output_tokens": 0}
        self.arguments = ""  # the open tool_use block's input so far, as JSON text

    def events(self, chunks: Iterator[dict]) -> Iterator[tuple[str, dict]]:
        """(event type, data) pairs, from message_start to message_stop or an error."""
        yield event("message_start", message={**self.whole, "content": []})
        yield event("ping")
        content = self.whole["content"]
        for step, kind, value in blocks(chunks):
            if step == "error":
                status = 400 if value["type"] == "invalid_request_error" else 500
                yield "error", error_body(status, value["message"])
            elif step == "start":
                block = new_block(kind, value)
                content.append(block)
                yield event("content_block_start", index=len(content) - 1, content_block=block)
            elif step == "delta":
                yield event("content_block_delta", index=len(content) - 1, delta=self._delta(value))
            elif step == "stop":
                if kind == "call":
                    with suppress(ValueError):  # no whole JSON (cut by max_tokens): input stays {}
                        content[-1]["input"] = json.loads(self.arguments)
                    self.arguments = ""
                yield event("content_block_stop", index=len(content) - 1)
            else:
                yield from self._end(kind, value)

    def _delta(self, text: str) -> dict:
        block = self.whole["content"][-1]
        if block["type"] == "tool_use":
            self.arguments += text
            return {"type": "input_json_delta", "partial_json": text}
        block[block["type"]] += text  # a text or thinking block: its field named alike
        return {"type": f"{block['type']}_delta", block["type"]: text}

    def _end(self, reason: str, usage: dict) -> Iterator[tuple[str, dict]]:
        stop = self.reply.stop_reason if reason == "stop" else None
        self.whole["stop_reason"] = "stop_sequence" if stop else STOP_REASONS.get(reason, reason)
        self.whole["stop_sequence"] = stop
        output = {"output_tokens": usage["completion_tokens"]}
        self.whole["usage"].update(output)
        delta = {"stop_reason": self.whole["stop_reason"], "stop_sequence": stop}
        yield event("message_delta", delta=delta, usage=output)
        yield event("message_stop")


def new_block(kind: str, head) -> dict:
    if kind == "call":
        return {"type": "tool_use", "id": head["id"], "name": head["function"]["name"], "input": {}}
    return {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
