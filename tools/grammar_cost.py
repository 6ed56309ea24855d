"""Constrained decoding's cost inside the engine (docs/structured-outputs.md).

    python tools/grammar_cost.py [--device cpu] [--ckpt PATH] [--dtype auto]

A decode step at batch 32 with every row constrained by a JSON schema against none (alternating
rounds, same prompts), the bitmask work alone, the unconstrained rows' check, and schema compiles.
"""

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.timing import seconds  # noqa: E402
from nanoflow import LLM, SamplingParams, grammar  # noqa: E402


# a schema that keeps a batch constrained through the timed steps: 64 strings at least
LONG_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 64}
CALL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}


def grammar_cost(args: argparse.Namespace, batch: int = 32, steps: int = 8) -> None:
    """Constrained decoding's cost: a decode step at `batch` with every row constrained vs none
    (alternating, same prompts), the bitmask work alone, the unconstrained rows' check, compiles."""
    llm = LLM(args.ckpt, device=args.device, dtype=args.dtype, num_kv_blocks=batch * 24)
    engine, times = llm.engine, {True: [], False: []}
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": f"List {i} fruits."}])
        for i in range(batch)
    ]
    for round_ in range(4):  # alternate, so that a busy machine slows both alike
        constrained = round_ % 2 == 0
        params = SamplingParams(
            temperature=0,
            max_tokens=300,
            ignore_eos=True,
            json_schema=LONG_SCHEMA if constrained else None,
        )
        reqs = [engine.add_request(p, params) for p in prompts]
        while any(r.num_output_tokens == 0 for r in reqs):  # prefill
            engine.step()
        times[constrained] += [seconds(engine.step) for _ in range(steps)]
        if constrained:
            logits = torch.zeros(batch, engine.config.vocab_size)
            masks = seconds(functools.partial(grammar.apply_bitmasks, logits, reqs))
        for r in reqs:
            engine.abort(r.request_id)
    check = seconds(lambda: any(r.params.json_schema is not None for r in reqs)) * 1e6
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"decode step at batch {batch}, median of {2 * steps}: unconstrained {off * 1e3:.1f} ms, "
        f"every row constrained {on * 1e3:.1f} ms (+{(on - off) * 1e3:.1f} ms); bitmasks filled "
        f"and applied alone: {masks * 1e3:.2f} ms; an unconstrained step's check: {check:.1f} us"
    )
    for name, schema in [("long array", LONG_SCHEMA), ("tool call", CALL_SCHEMA)]:
        grammar._grammar.cache_clear()
        matcher = functools.partial(engine.grammars.matcher, schema)
        cold = seconds(matcher)
        print(
            f"schema {name}: compile + matcher {cold * 1e3:.2f} ms cold, "
            f"{seconds(matcher) * 1e3:.2f} ms cached"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ckpt", help="checkpoint folder or .gguf (default: the demo model)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    grammar_cost(ap.parse_args())
