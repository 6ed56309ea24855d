"""Structured outputs: a request's output constrained to a JSON schema, by llguidance.

`response_format` and forced tool calls (tools.py) become `SamplingParams.json_schema`; each such
request gets its own matcher, and `apply_bitmasks` sets the logits its grammar forbids to -inf.
How, why llguidance, and what it costs: docs/structured-outputs.md. It imports no nanoflow module.
"""

import functools
import json

import numpy as np
import torch
from torch import Tensor

# compact JSON as json.dumps writes it: no whitespace a small model could emit forever
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}  # response_format json_object


def response_format_schema(response_format) -> dict | None:
    """The JSON schema that OpenAI's `response_format` asks for (None: free text)."""
    given = response_format if isinstance(response_format, dict) else {}
    if response_format is None or given.get("type") == "text":
        return None
    if given.get("type") == "json_object":
        return ANY_OBJECT
    spec = given.get("json_schema") if given.get("type") == "json_schema" else None
    if not isinstance(spec, dict):
        raise ValueError(
            '`response_format` must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name", "schema"}}'
        )
    schema = spec.get("schema", ANY_OBJECT)
    check_schema(schema, "response_format.json_schema.schema")
    return schema


def check_schema(schema, name: str) -> str:
    """The llguidance grammar of a JSON schema; a ValueError names the field (`name`) and says
    why the library rejects it."""
    if not isinstance(schema, dict):
        raise ValueError(f"{name}: a JSON schema must be an object")
    try:
        # the key keeps the properties' order: it is the order of the output's keys
        return _grammar(json.dumps(schema))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


@functools.lru_cache(maxsize=512)
def _grammar(schema: str) -> str:
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
    if error := LLMatcher.validate_grammar(grammar):
        raise ValueError(error)
    return grammar


class Grammars:
    """Makes each constrained request's matcher, over llguidance's view of the tokenizer: built at
    the first constrained request (0.2 s for a 49k vocabulary, 1.5 s for 150k), never otherwise."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's

    @functools.cached_property
    def lltokenizer(self):
        from llguidance import LLTokenizer

        return LLTokenizer(
            self.tokenizer.tk.to_str(),
            n_vocab=self.vocab_size,
            eos_token=self.tokenizer.eos_token_ids,
        )

    def matcher(self, schema: dict):
        from llguidance import LLMatcher

        return LLMatcher(self.lltokenizer, check_schema(schema, "json_schema"), log_level=0)


@functools.cache
def _executor():
    from llguidance import LLExecutor

    return LLExecutor()


def apply_bitmasks(logits: Tensor, reqs: list) -> Tensor:
    """-inf for every token that each constrained row's grammar forbids now; other rows as given."""
    from llguidance.torch import fill_next_token_bitmask_par

    rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
    vocab = logits.shape[-1]
    bitmask = torch.empty(len(rows), (vocab + 31) // 32, dtype=torch.int32)  # filled on the CPU
    fill_next_token_bitmask_par(
        _executor(), [(reqs[i].matcher, j) for j, i in enumerate(rows)], bitmask
    )
    # bit j of word w allows token 32 w + j: the words' bytes in order (little-endian), low bit 1st
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = torch.from_numpy(allowed).to(logits.device, torch.bool)
    if len(rows) == len(reqs):  # all constrained: no gather and scatter
        return torch.where(allowed, logits, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    return logits.index_put((index,), torch.where(allowed, logits[index], float("-inf")))
