"""rsi: recursive self-improvement of model-harness pairs.

Importing this package is cheap on purpose: torch, transformers, mlflow and prefect are imported
only by the modules that run models, log lineages or orchestrate flows.
"""

from pathlib import Path

__version__ = "0.1.0"

# The repository's top-level folders flows/, task_generators/, migrations/ and harness_versions/ are rsi's
# subpackages rsi.flows, rsi.task_generators, ...: the wheel puts them under rsi/ (pyproject.toml's package-dir),
# and in a checkout (rsi/ beside pyproject.toml and flows/) the checkout's root is searched for them too.
_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "flows" / "cycle.py").is_file():
    __path__.append(str(_CHECKOUT))
