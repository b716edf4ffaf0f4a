"""One registry for every way to extend rsi.

A plugin is an object registered under a kind and a name. Inside rsi a module registers its own with the
decorator (``@plugin("parser", "integer")``); another package registers by entry point in the group
``rsi.<kind>s`` of its own distribution (``[project.entry-points."rsi.families"]  sums = "mypkg.sums:family"``),
loaded the first time the kind is asked for. Nothing else changes: a new family, parser or proposer touches no
file of rsi.

    kind         what is registered                                  group
    family       a ``rsi.tasks.TaskFamily``                          rsi.families (and rsi.task_generators)
    proposer     ``(harness, space, evidence) -> [Proposal]``      rsi.proposers
    parser       a ``rsi.parsers.ParserSpec`` (function, params)     rsi.parsers
    backend      ``(**kwargs) -> GenerationBackend``                 rsi.backends
    runner       ``(run) -> Runner`` (rsi.runners)                   rsi.runners
    trainer      ``fit(...)`` (rsi.train)                            rsi.trainers
    router       a ``rsi.mol.routers.Router`` class                  rsi.routers
    curriculum   ``(accuracy, spec, target) -> top level``           rsi.curricula
    selection    ``(candidates, spec) -> kept`` (rsi.select)          rsi.selections
    profile      a profile's settings (rsi.run.config)               rsi.profiles
    pretraining  how the built-in base learns a family               rsi.pretraining
                 (rsi.basemodel.Episodes: its attributes)

A registration may be ``lazy("module:attribute")``: the object is imported when first used, so listing the
backends does not import torch. Asking for a name nobody registered is a ``UserError`` naming the known ones.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, NamedTuple, TypeVar

from rsi.errors import UserError

T = TypeVar("T")

GROUPS: dict[str, tuple[str, ...]] = {
    "family": ("rsi.families", "rsi.task_generators"),  # rsi.task_generators: the group before this registry
    "proposer": ("rsi.proposers",),
    "parser": ("rsi.parsers",),
    "backend": ("rsi.backends",),
    "runner": ("rsi.runners",),
    "trainer": ("rsi.trainers",),
    "router": ("rsi.routers",),
    "curriculum": ("rsi.curricula",),
    "selection": ("rsi.selections",),
    "profile": ("rsi.profiles",),
    "pretraining": ("rsi.pretraining",),
}
# The module of rsi that registers a kind's own plugins, imported before the kind is read.
OWN: dict[str, str] = {"proposer": "rsi.proposers", "parser": "rsi.parsers", "backend": "rsi.backends",
                       "runner": "rsi.runners", "trainer": "rsi.train", "router": "rsi.mol.routers",
                       "curriculum": "rsi.curriculum", "selection": "rsi.select",
       "profile": "rsi.run.config"}
NOUNS = {"family": ("task family", "families"), "proposer": ("harness proposer", "proposers"),
         "parser": ("answer parser", "parsers"), "backend": ("generation backend", "backends"),
         "runner": ("runner", "runners"), "trainer": ("trainer", "trainers"), "router": ("router", "routers"),
         "curriculum": ("curriculum rule", "rules"), "selection": ("selection policy", "policies"),
         "profile": ("profile", "profiles"), "pretraining": ("base pretraining", "pretrainings")}

_registry: dict[str, dict[str, Any]] = {kind: {} for kind in GROUPS}
_from_entry_points: dict[str, dict[str, Any]] = {}  # kind -> name -> EntryPoint, read once per kind
_owned: set[str] = set()  # kinds whose rsi module has registered its own (get is on hot paths: a parser per reply)


class Lazy(NamedTuple):
    """A registration imported when first used: ``module:attribute``."""

    target: str

    def load(self) -> Any:
        module, _, attribute = self.target.partition(":")
        obj = importlib.import_module(module)
        for part in attribute.split(".") if attribute else ():
            obj = getattr(obj, part)
        return obj


def lazy(target: str) -> Lazy:
    return Lazy(target)


def plugin(kind: str, name: str) -> Callable[[T], T]:
    """Register the decorated object as the ``kind`` plugin ``name`` (a later registration replaces it)."""

    def register(obj: T) -> T:
        add(kind, name, obj)
        return obj

    return register


def add(kind: str, name: str, obj: Any) -> None:
    _check_kind(kind)
    _registry[kind][name] = obj


def registry(kind: str) -> dict[str, Any]:
    """The live mapping of ``kind``'s plugins registered so far in this process (rsi's own, and those of other
    packages once loaded); ``names`` and ``get`` also read the entry points."""
    _check_kind(kind)
    return _registry[kind]


def names(kind: str) -> list[str]:
    """Every name registered for ``kind``, rsi's own and other packages', sorted."""
    _check_kind(kind)
    _own(kind)
    return sorted(set(_registry[kind]) | set(_entry_points(kind)))


def get(kind: str, name: str) -> Any:
    """The ``kind`` plugin ``name``; unknown, a ``UserError`` naming the known ones (and the closest)."""
    _check_kind(kind)
    _own(kind)
    if name not in _registry[kind]:
        found = _entry_points(kind).get(name)
        if found is None:
            known = names(kind)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            noun, plural = NOUNS[kind]
            raise UserError(f"unknown {noun} {name!r}{hint}; known {plural}: {', '.join(known) or 'none installed'}")
        try:
            _registry[kind][name] = found.load()
        except Exception as exc:  # another package's code: report which entry point failed, not a traceback
            raise UserError(f"{NOUNS[kind][0]} {name!r} (entry point {found.value!r} in {found.group}) failed to load: "
                            f"{type(exc).__name__}: {exc}") from None
    obj = _registry[kind][name]
    if isinstance(obj, Lazy):
        obj = _registry[kind][name] = obj.load()
    return obj


def known(kind: str, name: str) -> str:
    """``name`` when ``kind`` has a plugin of that name, else a ``ValueError`` naming the known ones (for a config
    field's validator: the config's error then names the field)."""
    if name not in names(kind):
        noun, plural = NOUNS[kind]
        raise ValueError(f"unknown {noun} {name!r}; known {plural}: {', '.join(names(kind))}")
    return name


def reload_entry_points() -> None:
    """Read the entry points again (a distribution installed while this process runs)."""
    _from_entry_points.clear()


def _check_kind(kind: str) -> None:
    if kind not in GROUPS:
        raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(GROUPS)}")


def _own(kind: str) -> None:
    if kind not in _owned:
        if kind in OWN:
            importlib.import_module(OWN[kind])
        _owned.add(kind)


def _entry_points(kind: str) -> dict[str, Any]:
    if kind not in _from_entry_points:
        found: dict[str, Any] = {}
        for group in reversed(GROUPS[kind]):  # the first group's entry wins a name both declare
            found |= {ep.name: ep for ep in entry_points(group=group)}
        _from_entry_points[kind] = found
    return _from_entry_points[kind]
