"""OpenAI's Responses API (`/v1/responses`), stateless, as a translation like anthropic.py's.

`chat_body` turns a Responses body into a chat body, `Translation` the chat chunks into
Responses' events and Response. Nothing is stored: `previous_response_id`, `conversation`,
`store` and `background` are refused. It may import anthropic.
"""

import uuid
from collections.abc import Iterator

from .anthropic import blocks, chat_tool_choice, chat_tools, listed, obj, text_of

SAME = ("model", "stream", "temperature", "top_p", "parallel_tool_calls", "read_rate")  # as chat's
TEXT_PARTS = ("input_text", "output_text")
STATUSES = {"length": "incomplete", "abort": "incomplete"}  # by finish_reason; else "completed"
ITEM_TYPES = {"text": "message", "thinking": "reasoning", "call": "function_call"}
# what a Response echoes of its request where the request says nothing
ECHOED = {"instructions": None, "max_output_tokens": None, "temperature": None, "top_p": None}
ECHOED.update(tools=[], tool_choice="auto", parallel_tool_calls=True, reasoning=None, metadata={})


def chat_body(body: dict) -> dict:
    """The chat body that asks what a Responses body asks; a ValueError says what is wrong."""
    for name in ("previous_response_id", "conversation", "store", "background"):
        if body.get(name) not in (None, False):
            raise ValueError(f"`{name}`: nanoflow stores no responses; send all in `input`")
    chat = {name: body[name] for name in SAME if body.get(name) is not None}
    chat["messages"] = chat_messages(body.get("input"))
    if body.get("instructions"):
        chat["messages"].insert(0, {"role": "system", "content": body["instructions"]})
    chat.update(max_tokens=body.get("max_output_tokens"), stream_options={"include_usage": True})
    chat["tools"] = chat_tools(body.get("tools"), "function", "parameters")
    if body.get("tool_choice") is not None:
        choice = body["tool_choice"]
        chat["tool_choice"] = chat_tool_choice(obj(choice).get("type", choice), choice)
    given = obj(body.get("text")).get("format")
    if obj(given).get("type") == "json_schema":  # its fields sit a level up of chat's json_schema
        given = {"type": "json_schema", "json_schema": {"schema": given.get("schema")}}
    chat["response_format"] = given
    effort = obj(body.get("reasoning")).get("effort")
    if effort is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    return chat


def chat_messages(given) -> list[dict]:
    """`input`, text or a list of items, as chat messages; a function_call joins the assistant
    message before it (or starts one), as chat puts calls in an assistant message."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages = []
    for i, item in enumerate(listed(given, "`input`, if not a string,")):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            text = text_of(item.get("content"), f"input[{i}].content", TEXT_PARTS)
            messages.append({"role": item.get("role"), "content": text})
        elif kind == "function_call":
            function = {"name": item.get("name"), "arguments": item.get("arguments")}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            call = {"id": item.get("call_id"), "type": "function", "function": function}
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            text = text_of(item.get("output"), f"input[{i}].output", TEXT_PARTS)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind != "reasoning":  # earlier reasoning is not shown to the model again
            raise ValueError(f"input[{i}]: nanoflow reads no {kind!r} items")
    return messages


class Translation:
    """One answer's chat chunks as Responses stream events, which build `whole`, the Response.
    Each event is to be sent as it comes: the objects in it change later."""

    def __init__(self, body: dict, reply):
        self.whole = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "output": []}
        self.whole.update(created_at=reply.created, model=reply.model, status="in_progress")
        self.whole.update({k: v if body.get(k) is None else body[k] for k, v in ECHOED.items()})
        self.whole["text"] = {"format": obj(body.get("text")).get("format") or {"type": "text"}}
        self.whole.update(error=None, incomplete_details=None, store=False, usage=None)
        self.num_prompt = reply.num_prompt
        self.sequence_number = 0
        # the last item's place in events: its index; with its id; with its content part's index
        self.at = self.item_at = self.part_at = {}

    def events(self, chunks: Iterator[dict]) -> Iterator[tuple[str, dict]]:
        """(event type, data) pairs: response.created to .completed (or .incomplete) or an error."""
        yield self._event("response.created", response={**self.whole, "output": []})
        yield self._event("response.in_progress", response={**self.whole, "output": []})
        output = self.whole["output"]
        for step, kind, value in blocks(chunks):
            if step == "error":
                yield self._event("error", code=value["code"], message=value["message"], param=None)
            elif step == "start":
                output.append(new_item(kind, value))
                self.at = {"output_index": len(output) - 1}
                self.item_at = {"item_id": output[-1]["id"], **self.at}
                self.part_at = {**self.item_at, "content_index": 0}
                yield self._event("response.output_item.added", item=output[-1], **self.at)
                if kind != "call":  # a message or reasoning item's one content part
                    output[-1]["content"].append(new_part(kind))
                    part = output[-1]["content"][0]
                    yield self._event("response.content_part.added", part=part, **self.part_at)
            elif step == "delta":
                yield self._delta(output[-1], value)
            elif step == "stop":  # an item that max_output_tokens cut is incomplete
                yield from self._done(output[-1], STATUSES.get(value, "completed"))
            else:
                yield self._end(kind, value)

    def _event(self, kind: str, **data) -> tuple[str, dict]:
        self.sequence_number += 1
        return kind, {"type": kind, "sequence_number": self.sequence_number - 1, **data}

    def _delta(self, item: dict, text: str) -> tuple[str, dict]:
        if item["type"] == "function_call":
            item["arguments"] += text
            return self._event("response.function_call_arguments.delta", delta=text, **self.item_at)
        part = item["content"][0]
        part["text"] += text
        return self._event(f"response.{part['type']}.delta", delta=text, **self.part_at)

    def _done(self, item: dict, status: str) -> Iterator[tuple[str, dict]]:
        if item["type"] == "function_call":
            done = {"name": item["name"], "arguments": item["arguments"]}
            yield self._event("response.function_call_arguments.done", **done, **self.item_at)
        else:
            part = item["content"][0]
            yield self._event(f"response.{part['type']}.done", text=part["text"], **self.part_at)
            yield self._event("response.content_part.done", part=part, **self.part_at)
        item["status"] = status
        yield self._event("response.output_item.done", item=item, **self.at)

    def _end(self, reason: str, usage: dict) -> tuple[str, dict]:
        tokens = {"input_tokens": self.num_prompt, "output_tokens": usage["completion_tokens"]}
        self.whole["usage"] = {**tokens, "total_tokens": usage["total_tokens"]}
        self.whole["status"] = STATUSES.get(reason, "completed")
        if reason == "length":
            self.whole["incomplete_details"] = {"reason": "max_output_tokens"}
        return self._event(f"response.{self.whole['status']}", response=self.whole)


def new_item(kind: str, head) -> dict:
    item = {"type": ITEM_TYPES[kind], "status": "in_progress"}
    if kind == "call":
        call = {"call_id": head["id"], "name": head["function"]["name"], "arguments": ""}
        return {**item, "id": f"fc_{uuid.uuid4().hex}", **call}
    if kind == "text":
        return {**item, "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "content": []}
    return {**item, "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": []}


def new_part(kind: str) -> dict:
    if kind == "text":
        return {"type": "output_text", "text": "", "annotations": []}
    return {"type": "reasoning_text", "text": ""}
