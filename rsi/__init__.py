"""rsi: recursive self-improvement of model-harness pairs.

Importing this package is cheap on purpose: torch, transformers, mlflow and prefect are imported
only by the modules that run models, log lineages or orchestrate flows.
"""

__version__ = "0.1.0"
