"""Generation backends: ``hf`` (in-process transformers + PEFT) and, later, ``openai`` (HTTP)."""

from rsi.backends.base import Completion, GenerationBackend, SamplingParams

__all__ = ["Completion", "GenerationBackend", "SamplingParams", "get_backend"]


def get_backend(name: str, **kwargs) -> GenerationBackend:
    """Build a backend by name; heavy imports happen here, not at package import."""
    from rsi.errors import UserError

    if name == "hf":
        from rsi.backends.hf import HFBackend

        return HFBackend(**kwargs)
    if name == "openai":
        from rsi.backends.openai import OpenAIBackend

        return OpenAIBackend(**kwargs)
    raise UserError(f"unknown generation backend {name!r}; known backends: hf, openai")
