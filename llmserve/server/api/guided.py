"""Structured output in each API's words, as the engine's ``GuidedDecodingParams``.

OpenAI: ``response_format`` (``text``, ``json_object``, ``json_schema``); vLLM's extra fields
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and its newer
``structured_outputs`` object. TGI: ``parameters.grammar`` (``json`` with a schema as an object or
a string, ``regex``). At most one of them per request. The grammar is compiled here, in the HTTP
process (llguidance, no torch), so that one the library cannot take is a 4xx naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from llmserve.grammar import check_guided_decoding
from llmserve.sampling_params import GuidedDecodingParams, InvalidRequest
from llmserve.server.api.errors import APIError, validation_error

# vLLM's extra fields, by the GuidedDecodingParams field each one sets.
VLLM_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                      "guided_grammar": "grammar"}


def openai_guided_decoding(body: Any) -> tuple[GuidedDecodingParams | None, str]:
    """The request's constraint, checked, and the field it came from (for errors); None if the
    request has none (or ``response_format`` ``text``)."""
    given = [name for name in ("response_format", "structured_outputs", *VLLM_GUIDED_FIELDS)
             if getattr(body, name, None) is not None and not (name == "response_format" and _is_text(body.response_format))]
    if not given:
        return None, "response_format"
    if len(given) > 1:
        raise validation_error(f"give at most one of {', '.join(given)}: each constrains the whole output", given[1])
    field = given[0]
    value = getattr(body, field)
    if field == "response_format":
        params = _response_format(value)
    elif field == "structured_outputs":
        params = _structured_outputs(value)
    else:
        params = _guided(field, VLLM_GUIDED_FIELDS[field], value)
    check(params, field)
    return params, field


def tgi_guided_decoding(grammar: Any) -> GuidedDecodingParams | None:
    """TGI's ``parameters.grammar``, checked; None if absent."""
    if grammar is None:
        return None
    field = "grammar"
    if not isinstance(grammar, dict) or set(grammar) != {"type", "value"}:
        raise _invalid(field, 'must be {"type": "json" | "regex", "value": ...}')
    kind, value = grammar["type"], grammar["value"]
    if kind == "json":
        params = _guided(field, "json", value)
    elif kind == "regex":
        params = _guided(field, "regex", value)
    else:
        raise _invalid(field, f"type must be json or regex, got {kind!r}")
    check(params, field, quote=True)
    return params


def check(params: GuidedDecodingParams, field: str, quote: bool = False) -> None:
    """A 4xx naming ``field`` if the grammar library cannot compile ``params``."""
    try:
        check_guided_decoding(params)
    except InvalidRequest as e:
        raise validation_error(e.render({"guided_decoding": field}, quote), field) from None


def _is_text(response_format: Any) -> bool:
    return isinstance(response_format, dict) and response_format.get("type") == "text"


def _response_format(value: Any) -> GuidedDecodingParams:
    field = "response_format"
    if not isinstance(value, dict):
        raise _invalid(field, "must be an object")
    kind = value.get("type")
    if kind == "json_object":
        return GuidedDecodingParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise _invalid(field, 'json_schema must be {"name": ..., "schema": {...}, "strict": ...}')
        # OpenAI's default schema when none is given: any JSON object.
        schema = spec.get("schema")
        return GuidedDecodingParams(json_object=True) if schema is None else _guided(field, "json", schema)
    raise _invalid(field, f"type must be text, json_object or json_schema, got {kind!r}")


def _structured_outputs(value: Any) -> GuidedDecodingParams:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise _invalid(field, "must be an object")
    known = {k: v for k, v in value.items() if k in ("json", "regex", "choice", "grammar", "json_object") and v not in (None, False)}
    if len(known) != 1:
        raise _invalid(field, f"takes exactly one of json, regex, choice, grammar, json_object; got {sorted(known) or 'none'}")
    (kind, v), = known.items()
    return GuidedDecodingParams(json_object=True) if kind == "json_object" else _guided(field, kind, v)


def _guided(field: str, kind: str, value: Any) -> GuidedDecodingParams:
    """``GuidedDecodingParams`` of one kind from a request's value, its type checked."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise _invalid(field, f"the JSON schema is not JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise _invalid(field, "the JSON schema must be an object")
        # Not key-sorted: the grammar writes an object's properties in the schema's order.
        return GuidedDecodingParams(json=json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _invalid(field, "must be a non-empty list of non-empty strings")
        return GuidedDecodingParams(choice=tuple(value))
    if not isinstance(value, str) or not value:
        raise _invalid(field, f"the {kind} must be a non-empty string")
    return GuidedDecodingParams(**{kind: value})


def _invalid(field: str, message: str) -> APIError:
    return validation_error(f"`{field}` {message}", field)
