"""Tool calling: OpenAI's `tools` and `tool_choice` in, `tool_calls` out.

`ToolRequest.of` checks a chat request's tools; "required" or a named function constrains the
output (grammar.py). `parse_tool_calls` reads a model's calls back (Hermes' and Qwen's
`<tool_call>` blocks, Llama 3's bare JSON), `ToolCallStream` a stream's. The details:
docs/structured-outputs.md. It may import grammar and reasoning.
"""

import json
import re
import uuid
from dataclasses import dataclass, field

from .grammar import check_schema
from .reasoning import marker_start_at_end

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3 may open its calls with it
BARE_STARTS = ("{", "[", PYTHON_TAG)
CALL_BLOCK = re.compile(f"{re.escape(CALL_START)}(.*?)(?:{re.escape(CALL_END)}|$)", re.S)
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolRequest:
    """A chat request's offered functions and how it lets the model use them."""

    tools: list[dict]  # as the body gives them: {"type": "function", "function": {...}}
    choice: str  # "auto", "required", or the name of the function to call
    parallel: bool = True  # several calls in one answer

    @classmethod
    def of(cls, body: dict, template: str | None) -> "ToolRequest | None":
        """The request's tools, None if none or "none"; a ValueError names the field."""
        tools = body.get("tools")
        choice = body.get("tool_choice")
        if not tools:
            if choice not in (None, "none", "auto"):
                raise ValueError("`tool_choice` needs `tools`")
            return None
        if not isinstance(tools, list):
            raise ValueError('`tools` must be a list of {"type": "function", "function": {...}}')
        names = [_check_tool(i, t) for i, t in enumerate(tools)]
        if len(set(names)) < len(names):
            raise ValueError("`tools` names a function twice")
        choice = _tool_choice(choice, names)
        if choice == "none":
            return None
        if choice in (None, "auto") and not knows_tools(template):
            raise ValueError(
                '`tool_choice: "auto"` lets the model decide, but this model\'s chat '
                'template cannot show it tools: use "required" or name a function'
            )
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise ValueError("`parallel_tool_calls` must be true or false")
        return cls(tools, choice or "auto", parallel)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def json_schema(self) -> dict | None:
        """The constraint on the output: none for "auto"; a named function's arguments; for
        "required", an array of calls {"name", "arguments"} of offered functions."""
        params = {
            t["function"]["name"]: t["function"].get("parameters", NO_PARAMETERS)
            for t in self.tools
        }
        if self.choice != "required":
            return params.get(self.choice)
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": p},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, p in params.items()
        ]
        # each function's $defs move to the root, where its "#/$defs/..." references point
        defs = {k: v for p in params.values() for k, v in p.get("$defs", {}).items()}
        return {
            "type": "array",
            "items": {"anyOf": call},
            "minItems": 1,
            **({"$defs": defs} if defs else {}),
            **({} if self.parallel else {"maxItems": 1}),
        }


def _tool_choice(choice, names: list[str]) -> str | None:
    """`tool_choice` as a word ("none", "auto", "required") or the name of an offered function."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise ValueError(f"`tool_choice` names {name!r}, which `tools` does not offer")
        return name
    if choice not in (None, "none", "auto", "required"):
        raise ValueError(
            '`tool_choice` must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )
    return choice


def knows_tools(template: str | None) -> bool:
    """Whether a chat template shows tools and calls (Llama 3.1+, Qwen2.5+, Hermes' all do)."""
    return "tool_call" in (template or "")


def _check_tool(i: int, tool) -> str:
    f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(f, dict):
        raise ValueError(
            f'tools[{i}] must be {{"type": "function", "function": {{"name", "parameters"}}}}'
        )
    name = f.get("name")
    if not (isinstance(name, str) and NAME.fullmatch(name)):
        raise ValueError(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}: {name!r}")
    check_schema(f.get("parameters", NO_PARAMETERS), f"tools[{i}].function.parameters")
    return name


def template_messages(messages: list[dict], given: list[dict], template: str) -> list[dict]:
    """`messages` with the `given` ones' `tool_calls` and `tool_call_id`: as HuggingFace passes them
    to a template that knows tools, as `<tool_call>` text in the content of one that does not."""
    knows = knows_tools(template)
    out = []
    for i, (m, g) in enumerate(zip(messages, given)):
        calls = [_message_call(i, j, c) for j, c in enumerate(g.get("tool_calls") or [])]
        if calls and knows:
            m = {**m, "tool_calls": [{"type": "function", "function": c} for c in calls]}
        elif calls:
            text = [f"{CALL_START}\n{json.dumps(c)}\n{CALL_END}" for c in calls]
            m = {**m, "content": "\n".join([m["content"], *text]).strip()}
        if knows and isinstance(g.get("tool_call_id"), str):
            m = {**m, "tool_call_id": g["tool_call_id"]}
        out.append(m)
    return out


def _message_call(i: int, j: int, call) -> dict:
    f = call.get("function") if isinstance(call, dict) else None
    args = f.get("arguments", "{}") if isinstance(f, dict) else None
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        args = None
    if not (isinstance(f.get("name") if f else None, str) and isinstance(args, dict)):
        raise ValueError(
            f"messages[{i}].tool_calls[{j}] needs function.name and function."
            "arguments (a JSON object, or that object as a string)"
        )
    return {"name": f["name"], "arguments": args}


def parse_tool_calls(text: str, names: list[str]) -> tuple[str, list[dict]]:
    """(content, OpenAI tool_calls) of a model's answer, the content being the text around the calls
    as it is; ("the text", []) unless every call found is a valid call of an offered function."""
    if CALL_START in text:
        pieces = CALL_BLOCK.split(text)
        content, blocks = "".join(pieces[::2]), pieces[1::2]
    else:
        bare = text.strip().removeprefix(PYTHON_TAG)
        content = ""
        blocks = _bare_json(bare) if bare.startswith(("{", "[")) else None
    calls = [_call(b) for b in blocks or []]
    if not calls or not all(c and c[0] in names for c in calls):
        return text, []
    return content, [new_call(name, json.dumps(args)) for name, args in calls]


def _bare_json(text: str) -> list | None:
    """Llama 3's answer's JSON values: objects, arrays of them, split by ';' or spaces."""
    decoder = json.JSONDecoder()
    values = []
    at = 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values += value if isinstance(value, list) else [value]
        at = len(text) - len(text[at:].lstrip().removeprefix(";").lstrip())
    return values


def _call(block) -> tuple[str, dict] | None:
    """(name, arguments) of one call, given as JSON text or a parsed value."""
    if isinstance(block, str):
        try:
            block = json.loads(block)
        except ValueError:
            return None
    if not isinstance(block, dict):
        return None
    args = block.get("arguments", block.get("parameters"))
    return (block.get("name"), args) if isinstance(args, dict) else None


def new_call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


@dataclass
class ToolCallStream:
    """One choice's text in, chat message deltas out. A named function's arguments stream as the
    model writes them; other calls are held from where they may start and parsed at the end."""

    tools: ToolRequest
    text: str = ""
    sent: int = 0  # characters of text sent as content
    calls: list = field(default_factory=list)

    def feed(self, text: str) -> dict:
        """The delta to send for new text: content, arguments, or nothing yet."""
        self.text += text
        if self.tools.choice not in ("auto", "required"):
            if self.calls:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            self.calls = [new_call(self.tools.choice, "")]
            function = {"name": self.tools.choice, "arguments": text}
            return {"tool_calls": [{"index": 0, **self.calls[0], "function": function}]}
        stripped = self.text.lstrip()
        if not self.sent and any(
            s.startswith(stripped) or stripped.startswith(s) for s in BARE_STARTS
        ):
            return {}  # a bare JSON call may be starting
        end = self._content_end()
        piece = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return {"content": piece} if piece else {}

    def _content_end(self) -> int:
        """Where a call starts, or may start (a prefix of its tag ends the text); else the end."""
        at = self.text.find(CALL_START, self.sent)
        if at >= 0:
            return at
        return len(self.text) - marker_start_at_end(self.text, CALL_START)

    def finish(self) -> list[dict]:
        """The held text's deltas: each call's id and name, then its arguments; or the content."""
        if self.tools.choice not in ("auto", "required"):
            return []
        content = self._parse(self.text[self.sent :])
        deltas = [{"content": content}] if content.strip() else []
        for i, c in enumerate(self.calls):
            head = {"index": i, **c, "function": {"name": c["function"]["name"], "arguments": ""}}
            arguments = {"index": i, "function": {"arguments": c["function"]["arguments"]}}
            deltas += [{"tool_calls": [head]}, {"tool_calls": [arguments]}]
        return deltas

    def message(self, text: str) -> dict:
        """The whole answer's content and tool_calls (OpenAI's content is null beside calls)."""
        if self.tools.choice not in ("auto", "required"):
            self.text = text
            self.calls = [new_call(self.tools.choice, text)]
            return {"content": None, "tool_calls": self.calls}
        content = self._parse(text)
        if not self.calls:
            return {"content": content}
        return {"content": content.strip() or None, "tool_calls": self.calls}

    def _parse(self, text: str) -> str:
        """The content of `text`; its calls go to self.calls, only the first without
        parallel_tool_calls (as vLLM: the others are dropped)."""
        content, calls = parse_tool_calls(text, self.tools.names)
        self.calls = calls if self.tools.parallel else calls[:1]
        return content

    def finish_reason(self, reason: str) -> str:
        """ "tool_calls" if the answer ended (not cut by max_tokens) in complete calls: a
        named function's arguments cut by a stop string are not a call to make."""
        named = self.tools.choice not in ("auto", "required")
        complete = self.calls and (not named or is_object(self.text))
        return "tool_calls" if complete and reason == "stop" else reason


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
