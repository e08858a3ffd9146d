"""/openapi.json with what only the served vocabularies know: the largest token id.

A token id beyond the vocabulary is a 400; the static schema can say only "from 0". Each
/openapi.json is the static document with the bound of the smallest vocabulary served (so
every id the document allows is valid on every model), once a vocabulary is known.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from ..models.catalogue import Catalogue

# (schema, property) pairs that take token ids of the request's vocabulary (api/fields.py
# states them as integers from 0, at any depth of lists).
TOKEN_ID_FIELDS = (
    ("DetokenizeRequest", "tokens"),
    ("CompletionRequest", "prompt"),
    ("EmbeddingRequest", "input"),
)


def _bound_ids(node: Any, last: int) -> None:
    """Every integer-from-0 schema under node gets `last` as its maximum."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0:
            node["maximum"] = last
        for value in node.values():
            _bound_ids(value, last)
    elif isinstance(node, list):
        for value in node:
            _bound_ids(value, last)


def with_token_bound(schema: dict[str, Any], n_tokens: int) -> dict[str, Any]:
    """A copy of an OpenAPI document whose token ids stop at n_tokens - 1."""
    bounded = copy.deepcopy(schema)
    components = bounded.get("components", {}).get("schemas", {})
    for name, field in TOKEN_ID_FIELDS:
        prop = components.get(name, {}).get("properties", {}).get(field)
        if prop is not None:
            _bound_ids(prop, n_tokens - 1)
    return bounded


def install_token_bounds(app: FastAPI, catalogue: Catalogue) -> None:
    """Serve /openapi.json (and the docs pages' copy) with the served vocabularies' bound."""
    static: Callable[[], dict[str, Any]] = app.openapi  # FastAPI's, built once and cached

    def openapi() -> dict[str, Any]:
        served = (catalogue.get(name) for name in catalogue.names())
        sizes = [model.vocab.n_tokens for model in served if model is not None]
        return with_token_bound(static(), min(sizes)) if sizes else static()

    app.openapi = openapi  # type: ignore[method-assign]
