"""A thinking model's reasoning, apart from its answer: the server's `--reasoning-parser qwen3`.

The engine stops and counts tokens over the whole text; only the chat answer is split: the thinking
(<think>...</think>) goes to `reasoning_content`, as in vLLM, the rest to `content`. No imports.
"""

from collections.abc import Iterator
from dataclasses import replace

REASONING_PARSERS = {"qwen3": ("<think>", "</think>")}  # --reasoning-parser: its markers


class ReasoningParser:
    """Splits one choice's text, fed piece by piece, into its reasoning and its content. It thinks
    from its start if it opens with the start marker or the prompt ended with it, until the end
    marker; an output that starts otherwise is all answer, one cut while thinking all reasoning."""

    def __init__(self, name: str, prompt_tail: str):
        self.start, self.end = REASONING_PARSERS[name]
        self.state = "reasoning" if prompt_tail.rstrip().endswith(self.start) else "start"
        self.held = ""  # text that may be the beginning of a marker

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that this new text adds."""
        text, self.held = self.held + text, ""
        if self.state == "start":
            if len(text) < len(self.start) and self.start.startswith(text):  # can't tell yet
                self.held = text
                return "", ""
            opens = text.startswith(self.start)
            self.state = "reasoning" if opens else "content"
            text = text[len(self.start) :] if opens else text
        if self.state == "content":
            return "", text
        reasoning, closed, content = text.partition(self.end)
        if closed:
            self.state = "content"
            return reasoning, content
        keep = marker_start_at_end(reasoning, self.end)
        self.held = reasoning[len(reasoning) - keep :]
        return reasoning[: len(reasoning) - keep], ""

    def flush(self) -> tuple[str, str]:
        """At the end: held text was not a marker after all; it stays where it was."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)


def marker_start_at_end(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (all of it excepted)."""
    return next(
        (n for n in range(min(len(text), len(marker) - 1), 0, -1) if text.endswith(marker[:n])), 0
    )


def split_reasoning(deltas: Iterator, name: str, prompt_tail: str) -> Iterator:
    """The server's ChoiceDeltas with each choice's text split into `reasoning` and `text`."""
    parsers: dict[int, ReasoningParser] = {}
    for delta in deltas:
        parser = parsers.setdefault(delta.index, ReasoningParser(name, prompt_tail))
        reasoning, content = parser.feed(delta.text)
        if delta.finish_reason:
            rest = parser.flush()
            reasoning, content = reasoning + rest[0], content + rest[1]
        yield replace(delta, text=content, reasoning=reasoning)
