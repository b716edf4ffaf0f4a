"""A model-harness pair as an MLflow 3 model: ``mlflow.pyfunc.load_model("models:/rsi-<lineage>@champion")``.

The logged model holds the LoRA adapter (none for the base pair) and the HCP harness folder; the base model is
logged once per base hash as a run artifact of the lineage's experiment and only *referenced* by the pair
(its URI in the model config), then downloaded when the model loads. ``predict`` renders task payloads through
the harness exactly as the cycle does (``Harness.prompt``), decodes greedily with the harness's limits on the
``hf`` backend and parses the reply with the harness's answer parser.

The model ships rsi itself: a wheel of the running rsi (``rsi.wheel``) lies in its artifacts and its
requirements name it beside the pinned versions of what logged it, so ``mlflow models serve --env-manager uv``
(or ``virtualenv``) rebuilds a working environment without the checkout. A signature and an input example
(payloads of the family's tasks) say what ``predict`` takes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
import weakref
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow.pyfunc

from rsi.wheel import rsi_wheel

if TYPE_CHECKING:
    from rsi.lineage import LineageRegistry

BASE_ARTIFACT = "base"
BASE_HASH_TAG, ROLE_TAG, PAIR_TAG = "rsi.base_model_hash", "rsi.role", "rsi.pair_id"
BASE_COMPLETE_TAG = "rsi.base_logged"  # set last: a base run without it was cut short
# What loading a pair needs, pinned to what logged it (torch with its local label: the CPU build); rsi itself is
# the wheel in the model's artifacts (the "rsi" on the package index is another project).
REQUIREMENTS = ("mlflow", "torch", "transformers", "peft", "tokenizers", "safetensors")
WHEEL_ARTIFACT = "rsi"
MODEL_CODE = "import mlflow\nfrom rsi.mlmodel import PairModel\n\nmlflow.models.set_model(PairModel())\n"


class PairModel(mlflow.pyfunc.PythonModel):
    """One model-harness pair: the referenced base, the adapter artifact (if any) and the harness artifact.

    ``predict`` takes task payloads (``[{"a": 12, "b": 34}]``), prompts (``[{"prompt": "..."}]``; bare prompt
    strings only where no signature is enforced), or a DataFrame of either (a ``prompt`` column, or one column
    per payload field); served, ``{"inputs": [...]}`` or ``{"dataframe_records": [...]}`` of the same. It returns
    one dict per input:
    ``prompt``, ``completion``, ``answer`` (the parsed value, None when the reply does not parse) and
    ``finish_reason``."""

    # predict reads lists and DataFrames itself, so MLflow's type-hint validation is off (as for MLflow's own
    # ChatModel) and model_input is unannotated: a hint would become an input schema that turns a DataFrame of
    # payloads into the list of its first column, and every hint MLflow cannot use, or none, draws a warning.
    _skip_type_hint_validation = True

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        from rsi.backends import get_backend
        from rsi.basemodel import model_hash
        from rsi.errors import UserError
        from rsi.hcp import load_harness

        config = context.model_config
        download_dir = tempfile.mkdtemp(prefix="rsi-base-")
        weakref.finalize(self, shutil.rmtree, download_dir, ignore_errors=True)
        base_dir = mlflow.artifacts.download_artifacts(artifact_uri=config["base_uri"], dst_path=download_dir)
        if model_hash(Path(base_dir)) != config["base_model_hash"]:
            raise UserError(f"the base model at {config['base_uri']} is not the one this pair was logged with "
                            f"(hash {config['base_model_hash']}); log the pair again against its base")
        self.harness = load_harness(context.artifacts["harness"])
        self.adapter = context.artifacts.get("adapter")
        self.backend = get_backend("hf", model_dir=base_dir)

    @property
    def pair(self) -> Any:
        """The pair answering: the harness, the base's backend and the adapter (``rsi.pair.Responder``)."""
        from rsi.pair import Responder

        return Responder(self.harness, self.backend, "pyfunc", self.adapter)

    def predict(self, context: Any, model_input, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        from rsi.models import Message
        from rsi.pair import sampling_params
        from rsi.parsers import get_parser

        items, greedy = _items(model_input), sampling_params(self.harness, seed=0, greedy=True)
        if self.harness.document.plan is not None and not any(isinstance(item, str) for item in items):
            return self._predict_planned(items, greedy)
        if self.harness.document.tools:
            return self._predict_episodes(items, greedy)
        prompts = [item if isinstance(item, str) else self.harness.prompt(item) for item in items]
        # a string is the user's message (in completion mode the model's input itself); a payload, the harness's
        # prompt messages
        conversations = [[Message(role="user", content=item)] if isinstance(item, str) else
                         [Message(role=r, content=c) for r, c in self.harness.prompt_messages(item)] for item in items]
        outputs = self.pair.ask(conversations, greedy)
        answer = self.harness.document.answer
        parse = get_parser(answer.parser)
        predictions = []
        for prompt, (completion, *_) in zip(prompts, outputs, strict=True):
            parsed = parse(completion.text, **answer.params)
            predictions.append({"prompt": prompt, "completion": completion.text,
                                "answer": parsed.value if parsed.ok else None,
                                "finish_reason": completion.finish_reason})
        return predictions


    def _predict_planned(self, payloads: list[dict[str, Any]], greedy) -> list[dict[str, Any]]:
        """Payloads under a harness with a plan: each posed through its calls; the answer is the composed one
        (None where a call gave none), the completion the calls' replies in order."""
        from rsi.errors import UserError

        pair = self.pair
        family = pair.family
        tasks = []
        for i, payload in enumerate(payloads):
            try:
                tasks.append(family.derive(payload))  # a task for its id; the plan gets the payload only
            except (KeyError, TypeError, ValueError) as exc:
                raise UserError(f"input {i}: {payload!r} is not a {family.name} task payload ({type(exc).__name__}: "
                                f"{exc}); pass payloads like the family's tasks, or prompt strings") from None
        done = pair.run(tasks, greedy)
        replies = {t.id: t.completion for t in done.trajectories}
        return [{"prompt": None, "completion": " ".join(replies[c] for c in path.calls), "answer": path.answer,
                 "calls": len(path.calls), "finish_reason": "stop" if path.answer is not None else "error"}
                for path in done.paths]


    def _predict_episodes(self, payloads: list[Any], greedy) -> list[dict[str, Any]]:
        """Payloads under a tool harness: each played as an episode on the family's environment; the prediction
        is its turns (calls and final reply), the final state (replayed from the calls) and the parsed answer."""
        from rsi.errors import UserError
        from rsi.hcp.syntax import parse_reply
        from rsi.models import Task
        from rsi.substrate import replay
        from rsi.tasks import DERIVED_SEED

        pair = self.pair
        family = pair.family
        tasks = []
        for i, payload in enumerate(payloads):
            try:
                if not isinstance(payload, dict):
                    raise TypeError("a tool harness plays task payloads, not prompt strings")
                family.environment.init(payload)
                level = family.level_of(payload) if family.level_of else 1
                tasks.append(Task(family=family.name, family_version=family.version, split=family.split_of(payload),
                                  level=max(1, level), seed=DERIVED_SEED, index=0, payload=payload, answer=None))
            except (KeyError, TypeError, ValueError) as exc:
                raise UserError(f"input {i}: {payload!r} is not a {family.name} task payload ({type(exc).__name__}: "
                                f"{exc}); pass payloads like the family's tasks") from None
        predictions = []
        for task, trajectory in zip(tasks, pair.episodes(tasks, greedy), strict=True):
            calls = [(c.id, c.name, c.arguments) for m in trajectory.messages for c in m.tool_calls]
            parsed = parse_reply(trajectory.completion, self.harness.document.answer)
            predictions.append({"turns": [m.content for m in trajectory.messages if m.role == "assistant"],
                                "calls": len(calls), "completion": trajectory.completion,
                                "answer": parsed.value if parsed.ok else None,
                                "final_state": replay(family.environment, task.payload, self.harness.tool_schemas,
                                                      calls).state,
                                "finish_reason": trajectory.finish_reason})
        return predictions


def _items(model_input: Any) -> list[str | dict[str, Any]]:
    """Prompt strings and task payloads from a list, one item, or a DataFrame (pyfunc hands one when the input
    meets the signature): a row with a ``prompt`` is that prompt, any other row a payload of its set fields."""
    if hasattr(model_input, "to_dict") and hasattr(model_input, "columns"):
        if model_input.columns.empty:  # the signature dropped every field: bare strings or unknown fields
            from rsi.errors import UserError

            raise UserError("the input has no payload field and no prompt: pass task payloads like the family's "
                            "tasks, or prompts as [{\"prompt\": \"...\"}]")
        if list(model_input.columns) == [0]:  # a DataFrame of prompt strings, by position
            return [str(p) for p in model_input[0].tolist()]
        rows = [{k: _plain(v) for k, v in row.items() if not _missing(v)}
                for row in model_input.to_dict(orient="records")]
        return [str(row["prompt"]) if "prompt" in row else row for row in rows]
    if isinstance(model_input, (str, dict)):
        return [model_input]
    return list(model_input)


def _missing(value: Any) -> bool:
    """A field a row leaves unset (a column another row has): None or NaN."""
    return value is None or (isinstance(value, float) and value != value)


def _plain(value: Any) -> Any:
    """JSON-like Python values for what pandas and numpy hand over (arrays, numpy scalars)."""
    return value.tolist() if hasattr(value, "tolist") else value


def pip_requirements(wheel: Path) -> list[str]:
    """The installed versions of what loading a pair imports (explicit: MLflow's inference is a slow subprocess)
    and rsi's ``wheel`` as the model holds it (a path relative to the model's folder, where MLflow installs)."""
    pins = []
    for name in REQUIREMENTS:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            pins.append(name)
    return [*pins, f"artifacts/{wheel.parent.name}/{wheel.name}"]


def log_base(registry: LineageRegistry, base_dir: Path, base_hash: str) -> str:
    """The base model's artifact URI (``runs:/<run>/base``), logged once per base hash into the lineage's
    experiment: a run carrying the hash is found again; one cut short (no completion tag) is logged afresh."""
    tags = {ROLE_TAG: "base", BASE_HASH_TAG: base_hash}
    found = registry.find_run(tags)
    if found is not None and found.data.tags.get(BASE_COMPLETE_TAG) == "true":
        return f"runs:/{found.info.run_id}/{BASE_ARTIFACT}"
    if found is not None:
        registry.client.delete_run(found.info.run_id)
    run = registry.client.create_run(registry.experiment_id, run_name=f"base-{base_hash[:12]}",
                                     tags=tags | {"mlflow.parentRunId": registry.lineage_run_id()})
    run_id = run.info.run_id
    registry.client.log_artifacts(run_id, str(base_dir), BASE_ARTIFACT)
    registry.client.set_tag(run_id, BASE_COMPLETE_TAG, "true")
    registry.client.set_terminated(run_id)
    return f"runs:/{run_id}/{BASE_ARTIFACT}"


def log_candidate(
    registry: LineageRegistry,
    run_id: str,
    base_uri: str,
    adapter_dir: Path | str | None,
    harness_dir: Path | str,
    *,
    pair_id: str,
    base_hash: str,
    name: str = "candidate",
) -> str:
    """Log one pair as an MLflow 3 model into run ``run_id`` and return its model URI (``models:/m-...``).

    The adapter is copied with ``base_model_name_or_path`` set to ``base_uri`` (a local path would not
    exist on another machine). A model already logged for ``pair_id`` in this experiment is returned again,
    so a rerun after a crash does not log the pair twice."""
    # READY is checked here: the SQL store of MLflow 3.17 matches nothing on a "status = 'READY'" filter.
    found = registry.client.search_logged_models([registry.experiment_id],
                                                 filter_string=f"tags.`{PAIR_TAG}` = '{pair_id}'")
    ready = [m for m in found if str(m.status) == "READY"]
    if ready:
        return f"models:/{ready[0].model_id}"
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = {"harness": str(harness_dir)}
        if adapter_dir is not None:
            artifacts["adapter"] = str(portable_adapter(Path(adapter_dir), Path(tmp) / "adapter", base_uri))
        code = Path(tmp) / "pair_model.py"  # models from code: the class is imported, not unpickled
        code.write_text(MODEL_CODE)
        wheel = rsi_wheel()  # once per rsi source digest
        artifacts[WHEEL_ARTIFACT] = str(wheel.parent)
        examples = example_payloads(harness_dir)
        with registry.resumed_run(run_id):
            info = mlflow.pyfunc.log_model(
                name=name, python_model=str(code), artifacts=artifacts,
                model_config={"base_uri": base_uri, "base_model_hash": base_hash},
                pip_requirements=pip_requirements(wheel), signature=signature(harness_dir, examples),
                input_example=examples,
                tags={PAIR_TAG: pair_id, BASE_HASH_TAG: base_hash, "rsi.base_uri": base_uri})
    return info.model_uri


def example_payloads(harness_dir: Path | str) -> list[dict[str, Any]]:
    """Payloads of the harness's family (a train task of levels 1 and 2): the model's input example."""
    from rsi.hcp import load_harness
    from rsi.tasks import get_family

    family = get_family(load_harness(harness_dir).document.family)
    return [family.task("train", 0, level, 0).payload for level in (1, 2)]


def signature(harness_dir: Path | str, examples: list[dict[str, Any]]) -> Any:
    """What ``predict`` takes, a payload's fields or a ``prompt`` (each optional, so either fits), and what it
    returns under this harness (a tool harness's episodes and a plan's calls say more than a reply)."""
    from mlflow.models import ModelSignature, infer_signature
    from mlflow.types.schema import AnyType, ColSpec, Schema

    from rsi.hcp import load_harness

    document = load_harness(harness_dir).document
    with warnings.catch_warnings():  # MLflow's hint about integer columns: a payload's numbers are never missing
        warnings.simplefilter("ignore", UserWarning)
        fields = [ColSpec(c.type, c.name, required=False) for c in infer_signature(examples).inputs.inputs]
    outputs = {"completion": "string", "answer": AnyType(), "finish_reason": "string"}
    if document.tools:
        outputs |= {"turns": AnyType(), "calls": "long", "final_state": AnyType()}
    else:
        outputs |= {"prompt": "string"} | ({"calls": "long"} if document.plan is not None else {})
    return ModelSignature(inputs=Schema([*fields, ColSpec("string", "prompt", required=False)]),
                          outputs=Schema([ColSpec(t, n, required=False) for n, t in outputs.items()]))


def portable_adapter(adapter_dir: Path, out_dir: Path, base_uri: str) -> Path:
    """A copy of the adapter whose config names the base by its MLflow URI instead of a local path (the
    adapter's hash ignores that field, so the copy is the same adapter)."""
    shutil.copytree(adapter_dir, out_dir)
    config_file = out_dir / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = base_uri
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))
    return out_dir
