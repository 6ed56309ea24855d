"""nanoflow: a small, readable LLM serving engine that keeps streamed text flowing under bursts."""

from .engine import LLM, Output
from .request import SamplingParams

__all__ = ["LLM", "Output", "SamplingParams"]
