"""A request's JSON Schema as this server reads it, rewritten before llguidance compiles it.

1. Strict by default, as vLLM's default grammar backend (xgrammar) reads a schema: an object schema that
   says nothing about further properties allows only the properties it lists (`additionalProperties:
   false`), and an array schema that says nothing about further items allows only its `prefixItems`
   (`items: false`). JSON Schema itself allows anything unlisted, which lets a weak model write the
   object a client asked for and then invent keys until its token budget runs out; clients that send a
   pydantic model's schema expect exactly that model back. An explicit `additionalProperties` or `items`
   (`true`, or a schema) keeps its meaning, and a schema that only refers to or combines others (`$ref`,
   `allOf`, `anyOf`, `oneOf`) without listing anything itself is left to them. Each part of an `allOf` is
   closed on its own, as in xgrammar: parts that add properties to one another need
   `additionalProperties: true`.
2. `\\d` in `pattern` and in `patternProperties` keys means an ASCII digit (`ascii_digits`).
The walk follows JSON Schema's subschema keywords only, so values under `enum`, `const`, `default` or
`examples` that look like schemas are data and stay as they are.
"""

from __future__ import annotations

# Keywords whose value is one schema, a list of schemas, or a map from names (or patterns) to schemas.
_ONE = frozenset({"additionalProperties", "additionalItems", "items", "contains", "not", "if", "then", "else",
                  "propertyNames", "unevaluatedProperties", "unevaluatedItems"})
_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})  # `items` as a list: drafts before 2020-12
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"})
_COMBINERS = ("$ref", "allOf", "anyOf", "oneOf")


def prepare_schema(schema, strict: bool = True):
    """The schema with `ascii_digits` applied to its patterns and, with `strict`, every object and array
    schema closed to what it lists (see the module docstring). The input is not modified."""
    if not isinstance(schema, dict):
        return schema  # true / false, or a non-schema value under `dependencies`
    out = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = ascii_digits(value)
        elif key in _MAPS and isinstance(value, dict):
            rename = ascii_digits if key == "patternProperties" else str
            out[key] = {rename(name): prepare_schema(sub, strict) for name, sub in value.items()}
        elif key in _LISTS and isinstance(value, list):
            out[key] = [prepare_schema(sub, strict) for sub in value]
        elif key in _ONE:
            out[key] = prepare_schema(value, strict)
        else:
            out[key] = value
    if strict:
        _close(out)
    return out


def _close(schema: dict) -> None:
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else set()
    untyped = "type" not in schema
    combines = any(key in schema for key in _COMBINERS)
    lists_properties = "properties" in schema or "patternProperties" in schema
    if ("object" in types or untyped and lists_properties) and (lists_properties or not combines) \
            and "additionalProperties" not in schema and "unevaluatedProperties" not in schema:
        schema["additionalProperties"] = False
    lists_items = "prefixItems" in schema
    if ("array" in types or untyped and lists_items) and (lists_items or not combines) \
            and "items" not in schema and "unevaluatedItems" not in schema:
        schema["items"] = False
    if isinstance(schema.get("items"), list) and "additionalItems" not in schema:
        schema["additionalItems"] = False  # the older spelling of prefixItems


def ascii_digits(regex: str) -> str:
    """`\\d` as [0-9] and `\\D` as [^0-9]: the meaning JSON Schema's regex dialect (ECMA-262) and most
    users give them. llguidance's regexes are Unicode-aware, where `\\d` also matches digits of other
    scripts — valid output that a client checking for ASCII digits would reject."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if nxt == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif nxt == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)
