"""The specialist registry: lineages admitted to Mixture-of-LoRA serving, each answered by its current champion.

Admitting a specialist is a row in the state DB (``rsi_specialists``), not code. Its champion is resolved from
the state DB (the lineage's newest promoted generation), so a promotion reaches a running proxy without a
restart: ``Registry.champions`` asks the DB which generation is newest on every call (one small query) and
loads a champion's harness again only when that generation changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select

from rsi.errors import UserError

if TYPE_CHECKING:
    from rsi.hcp import Harness
    from rsi.store import Store

log = logging.getLogger(__name__)
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
DEFAULT_LEVELS = (1, 2, 3, 4, 5, 6)


class Specialist(BaseModel):
    """A registry row: which lineage, what it is for, the levels of its family its routing examples come from."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    lineage: str
    description: str = ""
    levels: tuple[int, ...] = DEFAULT_LEVELS


@dataclass(frozen=True)
class Champion:
    """A specialist's current champion pair, live: its adapter directory, harness and base model directory."""

    specialist: Specialist
    generation: int
    pair_id: str
    adapter_dir: Path
    harness: Harness
    base_dir: Path


def add_specialist(store: Store, lineage: str, name: str | None = None, description: str = "",
                   levels: tuple[int, ...] = DEFAULT_LEVELS) -> Specialist:
    """Admit ``lineage`` as a specialist (named after it by default); a name in use or an unknown lineage is a
    user error."""
    from pydantic import ValidationError

    from rsi.store.schema import Lineage, SpecialistRow

    try:
        spec = Specialist(name=name or lineage, lineage=lineage, description=description, levels=tuple(levels))
    except ValidationError:
        raise UserError(f"specialist name {name or lineage!r}: use lowercase letters, digits, '_', '.', '-' "
                        "(at most 63, starting with a letter or digit); pass --name") from None
    if spec.name in ("auto", "base"):  # the proxy's own model names (rsi/auto routes, rsi/base is the base)
        raise UserError(f"specialist name {spec.name!r} is reserved (rsi/{spec.name} is the proxy's own model); "
                        "pass another --name")
    with store.session() as s:
        if s.get(Lineage, lineage) is None:
            known = ", ".join(s.scalars(select(Lineage.name).order_by(Lineage.name))) or "none"
            raise UserError(f"lineage {lineage!r} is not in the state DB (lineages: {known}); run `rsi run` first")
        if s.get(SpecialistRow, spec.name) is not None:
            raise UserError(f"specialist {spec.name!r} exists already; `rsi specialists remove {spec.name}` first "
                            "or pass another --name")
        s.add(SpecialistRow(name=spec.name, lineage=lineage, description=description, levels=list(spec.levels)))
    return spec


def list_specialists(store: Store) -> list[Specialist]:
    from rsi.store.schema import SpecialistRow

    with store.session() as s:
        return [_spec(row) for row in s.scalars(select(SpecialistRow).order_by(SpecialistRow.name))]


def remove_specialist(store: Store, name: str) -> None:
    from rsi.store.schema import SpecialistRow

    with store.session() as s:
        row = s.get(SpecialistRow, name)
        if row is None:
            known = ", ".join(s.scalars(select(SpecialistRow.name).order_by(SpecialistRow.name))) or "none"
            raise UserError(f"no specialist {name!r} (specialists: {known}); `rsi specialists list` shows them")
        s.delete(row)


def _spec(row: Any) -> Specialist:
    return Specialist(name=row.name, lineage=row.lineage, description=row.description, levels=tuple(row.levels))


class Registry:
    """The specialists and their champions as the proxy sees them, cached by each lineage's newest promoted
    generation (thread-safe). A specialist whose champion cannot be served (its base model missing or rebuilt,
    its adapter row empty) is left out and logged, not fatal to the others; the failure is remembered for that
    generation, so requests do not repeat it (``broken`` says why)."""

    def __init__(self, store: Store, home: Path) -> None:
        self.store, self.home = store, Path(home)
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, int], Champion | str] = {}  # (specialist, generation number) -> champion or why not
        self._base_hashes: dict[Path, str] = {}  # a base directory's model hash, read once (it reads every weight)

    def champions(self) -> dict[str, Champion]:
        """Every specialist that has a servable promoted champion now, by name, in name order."""
        from rsi.store.schema import Generation, SpecialistRow

        with self.store.session() as s:
            newest = (select(Generation.lineage, func.max(Generation.number).label("number"))
                      .where(Generation.status == "promoted").group_by(Generation.lineage).subquery())
            rows = s.execute(select(SpecialistRow, newest.c.number).join(newest, newest.c.lineage == SpecialistRow.lineage)
                             .order_by(SpecialistRow.name)).all()
            wanted = {(row.name, number): _spec(row) for row, number in rows}
            with self._lock:
                for key, spec in wanted.items():
                    if key not in self._cache:
                        try:
                            self._cache[key] = _champion(s, spec, key[1], self.home, self._base_hash)
                        except UserError as exc:
                            log.warning("specialist %s is not served: %s", spec.name, exc)
                            self._cache[key] = str(exc)
                self._cache = {key: self._cache[key] for key in wanted}
                return {key[0]: c for key, c in self._cache.items() if isinstance(c, Champion)}

    def broken(self) -> dict[str, str]:
        """Specialists left out at the last look, with why."""
        with self._lock:
            return {key[0]: c for key, c in self._cache.items() if isinstance(c, str)}

    def _base_hash(self, base: Path) -> str:
        from rsi.basemodel import model_hash

        if base not in self._base_hashes:
            self._base_hashes[base] = model_hash(base)
        return self._base_hashes[base]


def _champion(session: Any, spec: Specialist, number: int, home: Path, base_hash: Callable[[Path], str]) -> Champion:
    from rsi.basemodel import BaseRecipe, base_dir_for
    from rsi.store.harnesses import stored_harness
    from rsi.store.schema import Generation, Lineage, PairRow

    gen = session.scalars(select(Generation).where(Generation.lineage == spec.lineage, Generation.number == number,
                                                   Generation.status == "promoted")).one()
    pair = session.get(PairRow, gen.candidate_pair_id)
    if pair is None or not pair.adapter_uri:
        raise UserError(f"lineage {spec.lineage!r}: promoted generation {gen.number} has no adapter in the state DB")
    harness = stored_harness(session, pair.harness_hash, home)
    recipe = BaseRecipe(**session.get(Lineage, spec.lineage).spec.get("base_recipe", {}))
    from rsi.config import Settings

    base = harness.base_model_dir(home) or base_dir_for(Settings(home=home), recipe)
    if not (base / "config.json").is_file() or base_hash(base) != pair.base_model_hash:
        raise UserError(f"specialist {spec.name!r}: the base model of lineage {spec.lineage!r} (hash "
                        f"{pair.base_model_hash[:12]}) is not at {base}; run `rsi base build` with its profile")
    return Champion(spec, gen.number, pair.id, Path(pair.adapter_uri), harness, base)
