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
    """A registry row: which lineage, what it is for, the levels of its family its routing examples come from, and
    the API key (by name) it is private to, or None: every key's."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    lineage: str
    description: str = ""
    levels: tuple[int, ...] = DEFAULT_LEVELS
    owner_key: str | None = None


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
                   levels: tuple[int, ...] = DEFAULT_LEVELS, owner_key: str | None = None) -> Specialist:
    """Admit ``lineage`` as a specialist (named after it by default), private to the active key named
    ``owner_key`` if given; a name in use, an unknown lineage or no such key is a user error."""
    from pydantic import ValidationError

    from rsi.store.schema import Lineage, SpecialistRow

    try:
        spec = Specialist(name=name or lineage, lineage=lineage, description=description, levels=tuple(levels),
                          owner_key=owner_key)
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
        if owner_key is not None:
            _active_key(s, owner_key)
        s.add(SpecialistRow(name=spec.name, lineage=lineage, description=description, levels=list(spec.levels),
                            owner_key=owner_key))
    return spec


def _active_key(session: Any, name: str) -> None:
    """A specialist is private to an active key only; else a user error naming the fix."""
    from rsi.store.schema import ApiKeyRow

    row = session.get(ApiKeyRow, name)
    if row is None or row.revoked_at is not None:
        active = ", ".join(session.scalars(select(ApiKeyRow.name).where(ApiKeyRow.revoked_at.is_(None))
                                           .order_by(ApiKeyRow.name))) or "none"
        fix = (f"create it with `rsi keys create {name}`" if row is None
               else "it is revoked: create another with `rsi keys create NAME` and pass --key NAME")
        raise UserError(f"--key {name!r}: no active API key has that name (active keys: {active}); {fix}")


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
    return Specialist(name=row.name, lineage=row.lineage, description=row.description, levels=tuple(row.levels),
                      owner_key=row.owner_key)


def visible(champions: dict[str, Champion], owner: str | None) -> dict[str, Champion]:
    """The champions the key named ``owner`` may use: the public ones and those private to it (None: the public
    ones only). Another key's private specialist is, to this key, a name that does not exist."""
    return {name: c for name, c in champions.items() if c.specialist.owner_key in (None, owner)}


class Registry:
    """The specialists and their champions as the proxy sees them, cached by each lineage's newest promoted
    generation and the key a specialist is private to (thread-safe). A specialist whose champion cannot be served
    (its base model missing or rebuilt, its adapter row empty) is left out and logged, not fatal to the others; the
    failure is remembered for that generation, so requests do not repeat it (``broken`` says why)."""

    def __init__(self, store: Store, home: Path) -> None:
        self.store, self.home = store, Path(home)
        self._lock = threading.Lock()
        # (specialist, generation number, the key it is private to) -> champion or why not: admitted again for
        # another key, it is another entry, never a champion cached with its old owner
        self._cache: dict[tuple[str, int, str | None], Champion | str] = {}
        self._base_hashes: dict[Path, str] = {}  # a base directory's model hash, read once (it reads every weight)

    def champions(self) -> dict[str, Champion]:
        """Every specialist that has a servable champion now (its lineage's newest promoted pair, or before any
        promotion the start pair of a lineage started from an adapter), by name, in name order."""
        from rsi.store.schema import Generation, Lineage, SpecialistRow

        with self.store.session() as s:
            newest = (select(Generation.lineage, func.max(Generation.number).label("number"))
                      .where(Generation.status == "promoted").group_by(Generation.lineage).subquery())
            rows = s.execute(select(SpecialistRow, newest.c.number, Lineage.spec)
                             .outerjoin(newest, newest.c.lineage == SpecialistRow.lineage)
                             .join(Lineage, Lineage.name == SpecialistRow.lineage).order_by(SpecialistRow.name)).all()
            # nothing promoted yet: a lineage started from an adapter serves its start pair (generation 0)
            wanted = {(row.name, number or 0, row.owner_key): _spec(row) for row, number, spec in rows
                      if number is not None or spec.get("start_adapter")}
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

    def broken(self, owner: str | None = None) -> dict[str, str]:
        """Specialists left out at the last look, with why: the public ones and those private to key ``owner``."""
        with self._lock:
            return {key[0]: c for key, c in self._cache.items()
                    if isinstance(c, str) and key[2] in (None, owner)}

    def _base_hash(self, base: Path) -> str:
        from rsi.basemodel import model_hash

        if base not in self._base_hashes:
            self._base_hashes[base] = model_hash(base)
        return self._base_hashes[base]


def _champion(session: Any, spec: Specialist, number: int, home: Path, base_hash: Callable[[Path], str]) -> Champion:
    from rsi.basemodel import BaseRecipe, base_dir_for
    from rsi.store.harnesses import stored_harness
    from rsi.store.schema import Generation, Lineage, PairRow

    if number == 0:  # the start pair, saved when a run of the lineage opened it
        start = session.get(Lineage, spec.lineage).spec.get("start_adapter")
        pair = session.scalars(select(PairRow).where(PairRow.adapter_uri == start)
                               .order_by(PairRow.created_at)).first()
        if pair is None:
            raise UserError(f"lineage {spec.lineage!r}: its start adapter {start} has no pair in the state DB yet "
                            f"(a run of the lineage stores it: `rsi run --lineage {spec.lineage}`)")
    else:
        gen = session.scalars(select(Generation).where(Generation.lineage == spec.lineage,
                                                       Generation.number == number,
                                                       Generation.status == "promoted")).one()
        pair = session.get(PairRow, gen.candidate_pair_id)
        if pair is None or not pair.adapter_uri:
            raise UserError(f"lineage {spec.lineage!r}: promoted generation {gen.number} has no adapter in the state "
                            "DB")
    harness = stored_harness(session, pair.harness_hash, home)
    recipe = BaseRecipe(**session.get(Lineage, spec.lineage).spec.get("base_recipe", {}))
    from rsi.config import Settings

    base = harness.base_model_dir(home) or base_dir_for(Settings(home=home), recipe)
    if not (base / "config.json").is_file() or base_hash(base) != pair.base_model_hash:
        raise UserError(f"specialist {spec.name!r}: the base model of lineage {spec.lineage!r} (hash "
                        f"{pair.base_model_hash[:12]}) is not at {base}; run `rsi base build` with its profile")
    return Champion(spec, number, pair.id, Path(pair.adapter_uri), harness, base)
