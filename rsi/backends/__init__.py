"""Generation backends: ``hf`` (in-process transformers + PEFT) and ``openai`` (HTTP: rsi's vLLM engine).

Each is a ``rsi.plugins`` plugin of kind "backend" (another package's by entry point in ``rsi.backends``),
registered lazily: its heavy imports happen when it is built, not at package import.
"""

from rsi import plugins
from rsi.backends.base import Completion, GenerationBackend, SamplingParams

__all__ = ["Completion", "GenerationBackend", "SamplingParams", "get_backend"]

plugins.add("backend", "hf", plugins.lazy("rsi.backends.hf:HFBackend"))
plugins.add("backend", "openai", plugins.lazy("rsi.backends.openai:OpenAIBackend"))


def get_backend(name: str, **kwargs) -> GenerationBackend:
    """Build the backend registered as ``name``."""
    return plugins.get("backend", name)(**kwargs)
