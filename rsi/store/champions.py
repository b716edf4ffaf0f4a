"""A lineage's current champion as the state DB records it: what `rsi eval --lineage` scores and what
`rsi harness repair --lineage` repairs for."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def champion_pair(lineage: str) -> tuple[Path, Any, dict[str, Any], str]:
    """The adapter directory, the harness, the lineage's recorded config and the base model hash of a lineage's
    current champion, from the state DB."""
    from sqlalchemy import select

    from rsi.config import get_settings
    from rsi.errors import UserError
    from rsi.store import open_store
    from rsi.store.harnesses import stored_harness
    from rsi.store.schema import Generation, Lineage, PairRow

    store = open_store()
    try:
        with store.session() as s:
            gen = s.scalars(select(Generation).where(Generation.lineage == lineage, Generation.status == "promoted")
                            .order_by(Generation.number.desc())).first()
            pair = s.get(PairRow, gen.candidate_pair_id) if gen else None
            if pair is None or not pair.adapter_uri:
                raise UserError(f"lineage {lineage!r} has no promoted champion in the state DB; run `rsi run` first")
            return (Path(pair.adapter_uri), stored_harness(s, pair.harness_hash, get_settings().home),
                    dict(s.get(Lineage, lineage).spec), pair.base_model_hash)
    finally:
        store.dispose()
