"""The JSON types request bodies are declared with, and the schema notes that state their bounds.

Request fields take their JSON types strictly (RequestModel): "10" is not a number, nor "yes" a
boolean (an integer is a number, though), and integers bound for the worker stay in llama.cpp's
range (INT32_MAX). An integral float (`2.0`) is an integer, as JSON Schema, pydantic's lax mode
and vLLM have it; `2.5` is not (JsonInt; token-id lists: integral_ids). The OpenAI bodies
(schemas.py) and the translated APIs' bodies (translate/*_schemas.py) are built of these.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
)

INT32_MAX = 2**31 - 1  # llama.cpp's integer settings; beyond it a value is a 400, never a 500


def schema_range(low: float, high: float) -> dict[str, Any]:
    """A number's bounds, for the schema only: params.py and the protocol check them, with
    their own messages (the schema and the checks must agree: tests/e2e/test_faults_gateway.py)."""
    return {"minimum": low, "maximum": high}


def _integral(value: Any) -> Any:
    """An integral float as the integer it is; anything else is left to the strict check."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def integral_ids(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Token ids checked as strict integers first, one fast pass over a million of them; only
    when that fails are integral floats among them taken as integers, and checked again."""
    try:
        return handler(value)
    except ValidationError:
        fixed = _without_integral_floats(value)
        if fixed is None:
            raise
        return handler(fixed)


def _without_integral_floats(value: Any) -> list | None:
    """A list of ids or of lists of ids with its integral floats as ints; None when it has
    none (then there is nothing to check again)."""
    if not isinstance(value, list):
        return None
    changed = False

    def fix(items: list) -> list:
        nonlocal changed
        out = list(items)
        for i, item in enumerate(out):
            if type(item) is float and item.is_integer():
                out[i], changed = int(item), True
        return out

    fixed = [fix(item) if isinstance(item, list) else item for item in fix(value)]
    return fixed if changed else None


JsonInt = Annotated[int, BeforeValidator(_integral)]
"""An integer field: `2.0` is taken as 2, `2.5` and `"2"` are refused."""

# A list stops at its first bad item: a million bad ids made an error each for two members of
# a union of lists, and FastAPI turns each error into a dict (21 s of the event loop).
FAIL_FAST = Field(fail_fast=True)
TokenIds = Annotated[list[int], FAIL_FAST]


def token_ids_schema(schema: dict[str, Any]) -> None:
    """The schema of prompts: no list may be empty, token ids start at 0 (the vocabulary's
    size bounds them above: http/openapi_bounds.py adds that to the served document)."""
    for variant in schema.get("anyOf", [schema]):
        while variant.get("type") == "array":
            variant["minItems"] = 1
            variant = variant["items"]
            if variant.get("type") == "integer":
                variant["minimum"] = 0


def ids_from_zero_schema(schema: dict[str, Any]) -> None:
    """A list of token ids, possibly empty: each at least 0 (the vocabulary bounds them
    above: http/openapi_bounds.py adds that bound to the served document)."""
    schema.setdefault("items", {})["minimum"] = 0


def only_null_schema(schema: dict[str, Any]) -> None:
    """A field declared only to be refused unless null: its schema allows null alone."""
    schema.pop("anyOf", None)
    schema["type"] = "null"


class RequestModel(BaseModel):
    """A request body or part of one: strict JSON types, no coercion from strings."""

    model_config = ConfigDict(strict=True)
