"""HCP (Harness Context Protocol) documents: ``harness_versions/<family>/<version>/hcp.toml``.

A document names the model it drives, its prompt templates, decoding, tools, limits, the answer
format and the contract the auditor checks. Documents are untrusted input: ``load_harness`` validates
all of it (templates stay inside the harness folder and are rendered on sample tasks of the family,
parser parameters and tool schemas are typed, the contract holds the rules a verdict needs, every field
is one rsi honours) and raises a ``UserError`` naming the file, the field and what was expected.

The rooms, each importing only those before it: ``document`` (the schema and the protocol's constants),
``harness`` (a loaded version and what it renders), ``syntax`` (tool calls and replies as the model writes
them), ``plays`` (the harness played with right answers: a plan's calls, the expert's episode) and ``load``
(reading and validating a folder).
"""

from rsi.hcp.document import (CONTRACT_RULES, CONTRACT_VERSIONS, EPISODE_RULES, LEGACY_CONTRACTS, REQUIRED_RULES,
                              SAMPLE_LEVELS, SAMPLE_SEED, SAMPLE_TASKS, Answer, HCPDocument, required_rules)
from rsi.hcp.harness import Harness, PromptMessage, TemplateRenderError, template_env
from rsi.hcp.load import load_harness, resolve_harness, shipped_harnesses

__all__ = ["CONTRACT_RULES", "CONTRACT_VERSIONS", "EPISODE_RULES", "LEGACY_CONTRACTS", "REQUIRED_RULES",
           "SAMPLE_LEVELS", "SAMPLE_SEED", "SAMPLE_TASKS", "Answer", "HCPDocument", "Harness", "PromptMessage",
           "TemplateRenderError", "load_harness", "required_rules", "resolve_harness", "shipped_harnesses",
           "template_env"]
