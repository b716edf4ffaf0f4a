"""Built-in task families, one module each, registered in pyproject.toml under ``rsi.task_generators``."""
