"""The HCP documents rsi ships: ``<family>/<version>/hcp.toml`` and its templates.

A package (with its documents as package data) so that an install without a source checkout finds them;
``rsi.hcp.resolve_harness`` looks them up by id (``addition/v2``) or family (the newest version)."""
