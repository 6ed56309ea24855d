"""The engine step loop and the public Python API (`LLM`), in vLLM's shape.

`Engine.step()` schedules (sched.py), gets the logits from the runner (runner.py), samples,
and postprocesses (append, detokenize, check stops, free blocks); `LLM.generate` and api.py
drive it. It may import any module but the server's and the bench's.
"""

import argparse
import atexit
import gc
import logging
import os
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from . import dist
from .grammar import Grammars, check_schema
from .kv import KVPool, kv_block_bytes
from .model import ModelConfig, Shard, demo_checkpoint, generation_config, load_model
from .policies import POLICIES, TokenFlowConfig, make_policy
from .request import Request, RequestStatus, SamplingParams
from .runner import Batch, ModelRunner
from .sampler import sample, token_logprobs
from .sched import Policy, Scheduler
from .swap import Swapper
from .tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("nanoflow")
atexit.register(gc.unfreeze)  # LLM() freezes its heap: exit's last collection frees it all

CPU_KV_FRACTION = 0.25  # of available RAM for the KV pool on CPU: the OS and weights need the rest
CPU_KV_MAX_BYTES = 2 << 30  # ...but no more: a CPU serves a handful of requests at a time
IDLE_WAIT_S = 0.001  # a step with nothing to run sleeps this long before the next try
THREADS_CHECK_S = 1.0  # how often a CPU engine looks at what the rest of the machine computes
# others' CPU use in cores: above BUSY the engine leaves them a core, below IDLE takes it back
OTHERS_BUSY, OTHERS_IDLE = 0.5, 0.2
DEFAULT_READ_RATE = 8.0  # tokens/s: a fast silent reader (~360 words/min)
READ_RATE_MIN, READ_RATE_MAX = 1.0, 100.0  # clamped: nobody buys priority with a huge rate
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def knob(default, help: str, **flag):
    """A config field that is also a command-line flag (`flag`: argparse's type, choices)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass
class EngineConfig:
    """The engine's knobs: `LLM(**fields)`, and the flags of serve.py and bench.py (`add_flags`)."""

    device: str | None = knob(None, "cuda, cuda:1 or cpu (default: cuda when available)")
    dtype: str | torch.dtype = knob(
        "auto",
        "float32, bfloat16, float16 or auto: the checkpoint's "
        "16-bit one (or bf16) on GPU, nanoflow.model.CPU_DTYPE on CPU",
    )
    block_size: int = knob(16, "tokens per KV block", type=int)
    num_kv_blocks: int | None = knob(None, "KV blocks (default: what free memory holds)", type=int)
    policy: str | Policy = knob("tokenflow", "fcfs: vLLM's and SGLang's", choices=list(POLICIES))
    max_num_seqs: int = knob(256, "requests in one step at most", type=int)
    max_num_batched_tokens: int = knob(2048, "tokens per step at most", type=int)
    host_kv_gb: float = knob(4.0, "host memory for KV swapped out of the device (GB)", type=float)
    read_rate: float = knob(DEFAULT_READ_RATE, "tokens/s of a reader who declares none", type=float)
    tokenflow: TokenFlowConfig | None = knob(
        None,
        f"TokenFlow's constants (docs/scheduling.md; defaults: {TokenFlowConfig()})",
        type=TokenFlowConfig.parse,
        metavar="KEY=VALUE,...",
    )
    max_model_len: int | None = knob(
        None,
        "longest prompt + output in tokens (default: the "
        "model's context, at most what the KV pool holds)",
        type=int,
    )
    gpu_memory_utilization: float = knob(0.9, "GPU share for weights + KV cache", type=float)
    enforce_eager: bool = knob(False, "no CUDA graphs (a CPU never has them)", action="store_true")
    tensor_parallel_size: int = knob(1, "GPUs (one process each) that split every layer", type=int)
    enable_prefix_caching: bool = knob(
        True,
        "reuse the KV of prompt prefixes computed before",
        action=argparse.BooleanOptionalAction,
    )
    cpu_threads: int | None = knob(
        None,
        "torch threads on a CPU (default: one per core, one fewer while other processes compute)",
        type=int,
    )

    def __post_init__(self):
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} not in (0, 1]")

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser, names: list[str] | None = None) -> None:
        """One --flag per field (or per field in `names`), with the field's default."""
        for f in fields(cls):
            if names is None or f.name in names:
                default = "" if f.default in (None, False) else " (default: %(default)s)"
                parser.add_argument(
                    "--" + f.name.replace("_", "-"),
                    default=f.default,
                    **{**f.metadata, "help": f.metadata["help"] + default},
                )

    @staticmethod
    def flag_values(args: argparse.Namespace, names: list[str] | None = None) -> dict:
        """The fields' values from the flags that `add_flags(parser, names)` made."""
        return {
            f.name: getattr(args, f.name)
            for f in fields(EngineConfig)
            if names is None or f.name in names
        }


class Engine:
    """Owns the model runner, KV pool and scheduler; `step()` advances every request."""

    def __init__(
        self,
        runner: ModelRunner | None,
        config: ModelConfig,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        read_rate: float = DEFAULT_READ_RATE,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        threads: "CpuThreads | None" = None,
    ):
        self.runner = runner
        self.config = config
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.clock = scheduler.clock
        self.read_rate = read_rate
        self.device = runner.device if runner else torch.device("cpu")
        self.max_model_len = _max_model_len(
            max_model_len, config.max_position_embeddings, self.kv.num_blocks * self.kv.block_size
        )
        window = config.sliding_window
        if window and self.max_model_len > window:
            raise ValueError(
                f"this model attends only to its last {window} tokens "
                f"(sliding_window), which nanoflow does not implement: serve it with "
                f"max_model_len <= {window} (now {self.max_model_len})"
            )
        if not enforce_eager and self.device.type == "cuda":
            runner.capture(scheduler.max_num_seqs, self.max_model_len, cuda_graphs=True)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.grammars = Grammars(tokenizer, config.vocab_size)
        self.threads = threads

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request that passed `check_prompt`, the door of LLM and the server."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        rate = clamp_read_rate(params.read_rate or self.read_rate)
        arrival = self.clock() if arrival_time is None else arrival_time
        req = Request(list(prompt_token_ids), params, arrival_time=arrival, read_rate=rate)
        if request_id is not None:
            req.request_id = request_id
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if params.json_schema is not None:  # each request (each of n choices) its own
            req.matcher = self.grammars.matcher(params.json_schema)
        self.requests[req.request_id] = req
        self.detokenizers[req.request_id] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(req)
        return req

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """A ValueError if the engine cannot serve this request: every caller's one door."""
        vocab = self.config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the context is "
                f"{self.max_model_len} (max_model_len): generation needs one more"
            )
        if not all(t < vocab for t in [*params.logit_bias, *params.stop_token_ids]):
            raise ValueError(f"logit_bias and stop_token_ids name token ids in [0, {vocab})")
        if params.json_schema is not None:
            check_schema(params.json_schema, "json_schema")

    def abort(self, request_id: str) -> None:
        """Stop a request now (a client went away); its blocks are freed at once."""
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def stats(self, buffer_signal: bool = False) -> dict[str, int]:
        """Counters since start, the queues and pools now, and (if asked) the buffer signal."""
        s = self.scheduler
        swapper = s.swapper
        host = swapper.host if swapper else None
        return {
            "preemptions": 0,
            "resumes_load": 0,
            "resumes_recompute": 0,
            "bytes_to_host": 0,
            "bytes_to_device": 0,
            "blocks_written_through": 0,
            "blocks_demoted": 0,
            "prefix_queried_tokens": 0,
            "prefix_hit_tokens": 0,
            "prefix_host_hit_tokens": 0,
            **s.counters,
            **(swapper.counters if swapper else {}),
            "running": len(s.running),
            "waiting": len(s.waiting),
            "preempted": sum(r.status == RequestStatus.PREEMPTED for r in s.waiting),
            "device_blocks_free": self.kv.num_free,
            "device_blocks_cached": len(self.kv.evictable),
            "device_blocks_total": self.kv.num_blocks,
            "host_blocks_free": host.num_free if host else 0,
            "host_blocks_total": host.num_blocks if host else 0,
            **(s.buffer_signal() if buffer_signal else {}),
        }

    def step(self) -> list[Request]:
        """One engine iteration; returns the requests that produced a token or finished."""
        if self.threads:
            self.threads.adapt()
        batch = Batch.of(self.scheduler.schedule())
        if not batch.reqs:
            self.idle()
            return []
        # the rates learn the step's own time: a decision's cost must not read as a slower device
        start = self.clock()
        self.wait_for_loads(batch)
        tokens = self.run(batch)
        self.postprocess(batch, tokens)
        self.scheduler.after_step(
            self.clock() - start, batch.num_prefill_tokens, len(batch.sampled)
        )
        return batch.sampled

    def idle(self) -> None:
        """Nothing could run (all wait for a transfer or an interval): don't spin a core."""
        if self.has_unfinished():
            time.sleep(IDLE_WAIT_S)

    def wait_for_loads(self, batch: "Batch") -> None:
        """The compute stream waits for the host-to-device KV copies of these requests."""
        for req in batch.reqs:
            if req.load_event is not None:
                torch.cuda.current_stream(self.device).wait_event(req.load_event)
                req.load_event = None

    def run(self, batch: "Batch") -> list[int]:
        """The runner's logits; one sampled token per request in `batch.sampled`."""
        logits = self.runner.run(batch)
        tokens = sample(logits, batch.sampled, self.tokenizer.eos_token_ids)
        self._record_logprobs(batch.sampled, logits, tokens)
        return tokens

    def _record_logprobs(
        self, reqs: list[Request], logits: torch.Tensor, tokens: list[int]
    ) -> None:
        asked = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
        if not asked:
            return
        for req, (logprob, top) in zip(reqs, token_logprobs(logits, tokens, max(asked))):
            if req.params.logprobs is not None:
                req.logprobs.append((logprob, top[: req.params.logprobs]))

    def postprocess(self, batch: "Batch", tokens: list[int]) -> None:
        """Advance each request past its computed tokens; append the sampled ones' token."""
        for req, n in zip(batch.reqs, batch.query_lens):
            req.num_computed_tokens += n
        now = self.clock()  # one step makes its tokens at one moment (ties stay ties)
        for req, token in zip(batch.sampled, tokens):
            self._append_token(req, token, now)

    def _append_token(self, req: Request, token: int, now: float) -> None:
        req.append(token, now)
        if req.matcher is not None:
            req.matcher.consume_token(token)
        eos = token in req.params.stop_token_ids or (
            token in self.tokenizer.eos_token_ids and not req.params.ignore_eos
        )
        full = req.num_tokens >= self.max_model_len
        done = eos or req.num_output_tokens >= req.params.max_tokens or full
        detokenizer = self.detokenizers[req.request_id]
        before = len(req.output_text)
        req.output_text += detokenizer.step(req.output_token_ids)
        if done:  # a partial character held back so far belongs to the output now
            req.output_text += detokenizer.flush(req.output_token_ids)
        if req.num_output_tokens >= req.params.min_tokens and self._cut_at_stop_string(req, before):
            self._finish(req, "stop")
        elif done:
            self._finish(req, "stop" if eos else "length")

    @staticmethod
    def _cut_at_stop_string(req: Request, before: int) -> bool:
        """Truncate output_text before the first stop string that the new text completed."""
        found = {req.output_text.find(s, max(0, before - len(s) + 1)): s for s in req.params.stop}
        hits = [i for i in found if i >= 0]
        if hits:
            req.output_text = req.output_text[: min(hits)]
            req.stop_reason = found[min(hits)]
        return bool(hits)

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        req.matcher = None
        del self.requests[req.request_id], self.detokenizers[req.request_id]


@dataclass
class Output:
    """What `LLM.generate` returns for each prompt."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str


class LLM:
    """Offline batched generation: `LLM().generate(["Hello"], SamplingParams(temperature=0))`.
    Options are `EngineConfig` fields: `LLM(ckpt, num_kv_blocks=64)` or `LLM(ckpt, config)`."""

    def __init__(
        self, ckpt: str | Path | None = None, config: EngineConfig | None = None, **options
    ):
        c = replace(config or EngineConfig(), **options)
        device = torch.device(c.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        ckpt = ckpt or demo_checkpoint()
        tp = c.tensor_parallel_size
        # tensor parallel ranks on a CPU share its cores out between them (dist.py)
        threads = CpuThreads(c.cpu_threads) if device.type == "cpu" and tp == 1 else None
        shard = dist.launch(ckpt, device, tp) if tp > 1 or dist.torchrun_rank() else Shard()
        try:
            model, self.tokenizer = load_model(ckpt, device, _dtype(c.dtype), shard)
        except BaseException:
            # e.g. a size that does not divide the heads: the started workers must not linger
            dist.shutdown()
            raise
        self.generation_config = generation_config(ckpt)
        dtype = model.model.embed_tokens.weight.dtype
        shape = model.kv_block_shape(c.block_size)
        block_bytes = kv_block_bytes(*shape, dtype)
        blocks = c.num_kv_blocks or _blocks_that_fit(device, block_bytes, c.gpu_memory_utilization)
        kv = KVPool(blocks, *shape, dtype, device)
        host_blocks = int(c.host_kv_gb * (1 << 30)) // block_bytes
        host = KVPool(host_blocks, *shape, dtype, device, host=True) if host_blocks else None
        ranks = dist.Ranks(kv, host_blocks) if tp > 1 else None
        swapper = Swapper(kv, host, ranks) if host_blocks else None
        scheduler = Scheduler(
            kv,
            c.max_num_seqs,
            c.max_num_batched_tokens,
            time.monotonic,
            make_policy(c.policy, c.tokenflow),
            swapper,
            c.enable_prefix_caching,
        )
        self.engine = Engine(
            ModelRunner(model, kv, ranks),
            model.config,
            self.tokenizer,
            scheduler,
            c.read_rate,
            c.max_model_len,
            c.enforce_eager,
            threads,
        )
        if threads:
            log.info("compute: %s", threads.describe())
        gc.unfreeze()  # what an earlier LLM left in cycles may go now
        gc.collect()
        gc.freeze()  # what lives on (weights, tokenizer) leaves full collections: ~150-ms pauses

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Output]:
        """Generate for every prompt (text or token ids), batched; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(ids, params)

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[Output]:
        """`generate` for conversations ([{"role", "content"}, ...]) through the chat template;
        chat_template_kwargs are its variables (e.g. Qwen3's `enable_thinking=False`)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        kwargs = chat_template_kwargs or {}
        return self._run(
            [self.tokenizer.apply_chat_template(c, **kwargs) for c in conversations], params
        )

    def _run(self, prompt_ids: list[list[int]], params) -> list[Output]:
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompt_ids)
        if len(params) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(params)} SamplingParams")
        for i, (ids, p) in enumerate(zip(prompt_ids, params)):
            try:
                self.engine.check_prompt(ids, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        reqs = [self.engine.add_request(ids, p) for ids, p in zip(prompt_ids, params)]
        while self.engine.has_unfinished():
            self.engine.step()
        return [
            Output(
                r.request_id, r.prompt_token_ids, r.output_text, r.output_token_ids, r.finish_reason
            )
            for r in reqs
        ]


class CpuThreads:
    """Torch's threads on a CPU: one per core while the machine is otherwise idle, one fewer while
    other processes compute. A step is ~1,000 small ops, each ending at a barrier where all threads
    meet: a thread that shares its core with another process arrives a time slice late, and the
    step runs several times slower than on one thread fewer (docs/results.md, "Threads")."""

    def __init__(self, fixed: int | None = None):
        self.fixed = fixed
        self.cores = os.cpu_count() or 1
        self.checked_at = time.monotonic()
        self.busy_at_check = busy_cpu_seconds()
        self.own_at_check = time.process_time()
        torch.set_num_threads(fixed or self.cores)

    def adapt(self) -> None:
        """Once a THREADS_CHECK_S: leave others a core, or take it back when they idle."""
        now = time.monotonic()
        if self.fixed or self.busy_at_check is None or now - self.checked_at < THREADS_CHECK_S:
            return
        busy, own = busy_cpu_seconds(), time.process_time()
        others = (busy - self.busy_at_check - (own - self.own_at_check)) / (now - self.checked_at)
        self.checked_at = now
        self.busy_at_check = busy
        self.own_at_check = own
        if others > OTHERS_BUSY:
            torch.set_num_threads(max(1, self.cores - 1))
        elif others < OTHERS_IDLE:
            torch.set_num_threads(self.cores)

    def describe(self) -> str:
        if self.fixed:
            return f"{self.fixed} torch threads (--cpu-threads)"
        return (
            f"{torch.get_num_threads()} torch threads of {self.cores} cores, one fewer while "
            "other processes compute"
        )


def busy_cpu_seconds() -> float | None:
    """CPU seconds all processes of this machine used since boot (Linux; elsewhere None)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _, _, irq, softirq = map(int, f.readline().split()[1:8])
    except OSError:
        return None
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def clamp_read_rate(rate: float) -> float:
    return min(max(rate, READ_RATE_MIN), READ_RATE_MAX)


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype, or None for auto (load_model picks)."""
    if dtype in (None, "auto") or isinstance(dtype, torch.dtype):
        return None if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _max_model_len(asked: int | None, context: int, pool_tokens: int) -> int:
    if asked is not None and not 0 < asked <= context:
        raise ValueError(f"max_model_len must be in [1, {context}] (the model's context): {asked}")
    wanted = asked or context
    if pool_tokens < wanted:
        log.info("max_model_len lowered from %d to %d tokens (the KV pool)", wanted, pool_tokens)
    return min(wanted, pool_tokens)


def _blocks_that_fit(device: torch.device, block_bytes: int, utilization: float) -> int:
    """Size the KV pool from the memory that is free now (after the weights are loaded)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # what the weights (and anyone else) use now counts against the share
        budget = free - total * (1 - utilization)
    else:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = min(available * CPU_KV_FRACTION, CPU_KV_MAX_BYTES)
    return max(1, int(budget // block_bytes))
