"""Prefect flows of rsi: the cycle stage by stage (``rsi-cycle``) and generations of it (``rsi-lineage``)."""
