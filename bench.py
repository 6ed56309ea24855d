"""Benchmarks for nanoflow.

`python bench.py --vs-transformers`: offline generation speed of `LLM.generate` beside HuggingFace
transformers' `generate` on the same checkpoint, same prompts, same greedy decoding, in one process.
"""

import argparse
import random
import time

import torch

from nanoflow import LLM, SamplingParams


def vs_transformers(ckpt: str | None, batch_sizes: list[int], prompt_len: int, new_tokens: int) -> None:
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from nanoflow.model import demo_checkpoint

    path = Path(ckpt) if ckpt else demo_checkpoint()
    hf_kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    hf = AutoModelForCausalLM.from_pretrained(path.parent if hf_kwargs else path, dtype=torch.float32, **hf_kwargs).eval()
    llm = LLM(path, dtype="float32")
    rng = random.Random(0)
    vocab = llm.engine.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    print(f"{'prompts':>8} {'nanoflow tok/s':>15} {'transformers tok/s':>19} {'ratio':>6}")
    for n in batch_sizes:
        prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(n)]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        t = time.perf_counter()
        llm.generate(prompts, params)
        ours = n * new_tokens / (time.perf_counter() - t)
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(torch.tensor(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                        do_sample=False, pad_token_id=0)
        theirs = n * new_tokens / (time.perf_counter() - t)
        print(f"{n:>8} {ours:>15.1f} {theirs:>19.1f} {ours / theirs:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="checkpoint folder or .gguf (default: the demo model)")
    ap.add_argument("--vs-transformers", action="store_true", help="compare LLM.generate with transformers' generate")
    ap.add_argument("--batch-sizes", default="1,16", help="prompts per generate call, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.vs_transformers:
        vs_transformers(args.ckpt, [int(b) for b in args.batch_sizes.split(",")], args.prompt_len, args.new_tokens)
    else:
        ap.print_help()


if __name__ == "__main__":
    main()
