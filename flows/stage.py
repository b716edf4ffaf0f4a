"""One stage of a generation, run in this process from its ``RunContext``'s JSON and the ids and results it takes:
what a deployment or a remote worker does with a stage, and how ``tests/test_stage_process.py`` shows that no
stage reaches state through a module global.

    python -m rsi.flows.stage REQUEST.json    # prints the stage's result as JSON

A request is ``{"context": RunContext, "stage": "train", "number": 1, "inputs": {"champ": ..., "selected": ...}}``:
the inputs are the stage's parameters after ``run`` and ``number`` (``flows/cycle.py``), as the JSON of their
types; the context must name the lease holder and token the stage writes under."""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any, get_type_hints

from pydantic import BaseModel

from rsi.flows import cycle
from rsi.errors import UserError
from rsi.run import RunContext, open_run

STAGES = {"discover": cycle.discover, "search": cycle.search_harness, "execute": cycle.execute, "audit": cycle.audit,
          "select": cycle.select_stage, "train": cycle.train, "evaluate": cycle.evaluate_gate,
          "register": cycle.register}


def run_stage(request: dict[str, Any]) -> BaseModel:
    """Build the run from the request's context, call the stage's function with its typed inputs, close the run."""
    if request.get("stage") not in STAGES:
        raise UserError(f"stage {request.get('stage')!r}: expected one of {', '.join(STAGES)}")
    fn = STAGES[request["stage"]].fn
    hints = get_type_hints(fn, globalns=vars(cycle))
    names = list(inspect.signature(fn).parameters)[2:]  # after run and number
    given = request.get("inputs", {})
    args = [adapt(hints[name], given.get(name)) for name in names]
    with open_run(RunContext.model_validate(request["context"])) as run:
        return fn(run, int(request["number"]), *args)


def adapt(kind: Any, value: Any) -> Any:
    """A stage input from its JSON: the result model the parameter names (None where it may be absent)."""
    if value is None:
        return None
    model = next(t for t in getattr(kind, "__args__", (kind,)) if isinstance(t, type) and issubclass(t, BaseModel))
    return model.model_validate(value)


def main(argv: list[str]) -> int:
    """Run the stage REQUEST.json names and print its result; a request that cannot be read is an error naming
    the file and what it must hold, not a traceback."""
    if len(argv) != 1:
        print("usage: python -m rsi.flows.stage REQUEST.json", file=sys.stderr)
        return 2
    try:
        with open(argv[0], encoding="utf-8") as f:
            request = json.load(f)
        if not isinstance(request, dict) or not {"stage", "context", "number"} <= set(request):
            raise ValueError("it must be a JSON object with stage, context, number (and inputs)")
        result = run_stage(request)
    except (OSError, ValueError, UserError) as exc:  # ValueError: pydantic's too (a context or an input)
        print(f"error: stage request {argv[0]}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.model_dump(mode="json")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
