"""The frozen base model of a lineage run: its recipe, directory and hash, and the generation backend on it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from rsi.config import Settings
from rsi.hcp import Harness
from rsi.run.config import CycleConfig

log = logging.getLogger("rsi.cycle")
# A log record's ``extra`` for a step of long work: a terminal shows it as the live line, a pipe or file never gets it
PROGRESS = {"progress": True}


def stepping(message: str, steps: int, *args: Any) -> Callable[[int, float], None]:
    """A callback for steps 1..``steps`` of long work that logs ``message`` (formatted with ``*args``, the step, the
    steps and the loss) as progress at the first and last step and every tenth of the way."""
    def step(done: int, loss: float) -> None:
        if done == 1 or done % max(1, steps // 10) == 0 or done == steps:
            log.info(message, *args, done, steps, loss, extra=PROGRESS)
    return step


class Base:
    """Built lazily: naming a run's base loads no model; the backend is made on first use and closed with it."""

    def __init__(self, config: CycleConfig, settings: Settings, harness: Harness):
        self.config, self.settings, self.harness = config, settings, harness
        self.adapters = settings.home / "adapters" / config.lineage  # where the lineage's adapters are written

    @cached_property
    def recipe(self) -> Any:
        from rsi.basemodel import BaseRecipe

        return BaseRecipe(**self.config.base_recipe)

    @property
    def levels(self) -> tuple[int, ...]:
        """The levels the base is pretrained on in this lineage's family (a joint base trains several families,
        each at its own levels)."""
        return self.recipe.trained_levels(self.config.family)

    @cached_property
    def dir(self) -> Path:
        """The base model's directory: the harness's own base (a GGUF file converted once), else rsi's built-in
        base, built from the recipe on first use."""
        from rsi.basemodel import base_dir_for, ensure_base

        external = self.harness.base_model_dir(self.settings.home)
        if external is not None:
            return external

        log.info("base model: %s (built once, then cached)", base_dir_for(self.settings, self.recipe))
        return ensure_base(self.settings, self.recipe, progress=lambda step, steps, loss: stepping(
            "base model: step %d/%d, loss %.4f", steps)(step, loss), device=self.config.train.device)

    @cached_property
    def hash(self) -> str:
        from rsi.basemodel import model_hash

        return model_hash(self.dir)

    @cached_property
    def backend(self) -> Any:
        """The generation backend; ``openai`` talks to ``RSI_ENGINE_URL`` when set (a running vLLM server that
        serves rsi's base as ``RSI_ENGINE_MODEL`` and can read the adapter folders: they are loaded by path),
        else to rsi's own engine, started if it is not running."""
        from rsi.backends import get_backend

        if self.config.backend == "openai" and self.settings.engine_url:
            return get_backend("openai", base_url=self.settings.engine_url, model=self.settings.engine_model,
                               api_key=self.settings.engine_api_key, tokenizer_dir=self.dir)
        if self.config.backend == "openai":
            from rsi import engine

            state = engine.start(self.dir, self.settings.home, spec=self.config.engine)
            return get_backend("openai", base_url=state.base_url, tokenizer_dir=self.dir)
        if self.config.backend == "hf":
            return get_backend("hf", model_dir=self.dir, device=self.config.train.device)
        return get_backend(self.config.backend, model_dir=self.dir)

    def close(self) -> None:
        if "backend" in self.__dict__:
            self.backend.close()
