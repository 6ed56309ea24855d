"""nanoflow: a small, readable LLM serving engine that keeps streamed text flowing under bursts.
It may import engine and sched (the public names); no module of nanoflow imports it."""

from .engine import LLM, Output
from .request import SamplingParams

__all__ = ["LLM", "Output", "SamplingParams"]
