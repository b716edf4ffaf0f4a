"""The harnesses of a lineage run: its starting one and every one its pairs carry, loaded once from the state
DB's harness store, with the highest level each can pose under the curriculum."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rsi.curriculum import CurriculumSpec
from rsi.evaluate import expressible
from rsi.hcp import Harness
from rsi.store import Store
from rsi.tasks import TaskFamily


class Harnesses:
    def __init__(self, store: Store, home: Path, start: Harness, family: TaskFamily, curriculum: CurriculumSpec):
        self.store, self.home, self.start, self.family, self.spec = store, home, start, family, curriculum
        self._loaded: dict[str, Harness] = {start.hash: start}
        self._max_levels: dict[str, int] = {}  # harness hash -> max_level

    def of(self, pair: Any) -> Harness:
        """The harness a pair (anything with a ``harness_hash``) carries, or the one an id@version or hash
        names."""
        ref = pair if isinstance(pair, str) else pair.harness_hash
        if ref not in self._loaded:
            from rsi.store.harnesses import stored_harness

            with self.store.session() as s:
                harness = stored_harness(s, ref, self.home)
            self._loaded[ref] = self._loaded.setdefault(harness.hash, harness)
        return self._loaded[ref]

    def max_level(self, harness: Harness) -> int:
        """The highest level both the curriculum allows and the harness can render (its format has a width).
        Computed once per harness: a plan's dry run renders every call of a task at each level up to the cap."""
        if harness.hash not in self._max_levels:
            level = 0
            while level < self.spec.max_level and expressible(harness, self.family, level + 1):
                level += 1
            self._max_levels[harness.hash] = level
        return self._max_levels[harness.hash]

    def curriculum(self, harness: Harness) -> CurriculumSpec:
        return self.spec.model_copy(update={"max_level": self.max_level(harness)})
