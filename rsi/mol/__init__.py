"""Mixture-of-LoRA serving: the specialist registry, routers and the OpenAI-compatible proxy (``rsi serve``)."""
