"""Check objects against the generated CRDs offline, the way the API server would.

The API server applies structural defaults, validates the OpenAPI schema, then evaluates
the CEL rules. This module does the same with ``jsonschema`` (Draft 4, the dialect of
OpenAPI v3.0 schemas) and ``cel-python``, both from the ``dev`` extra. Tests use it to show
that the CRDs and the pydantic models accept and reject the same objects.
"""

from __future__ import annotations

import copy
from typing import Any

from tessera.api.crd import RESOURCES, crd


def openapi_schema(kind: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the CRD for ``kind``."""
    for info in RESOURCES:
        if info.kind == kind:
            return crd(info)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]
    raise KeyError(f"no Tessera CRD for kind {kind!r}; kinds: {[i.kind for i in RESOURCES]}")


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """A copy of ``value`` with the schema's defaults filled in, as the API server's defaulting does."""
    value = copy.deepcopy(value)
    _default_in_place(schema, value)
    return value


def _default_in_place(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default_in_place(sub, value[name])
        if isinstance(schema.get("additionalProperties"), dict):
            for item in value.values():
                _default_in_place(schema["additionalProperties"], item)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default_in_place(schema["items"], item)


def _as_cel_json(schema: dict[str, Any], value: Any) -> Any:
    """``value`` with numbers of ``type: number`` fields as floats, as CEL sees them on the server."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        return {
            k: _as_cel_json(props.get(k) or (extra if isinstance(extra, dict) else {}), v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_as_cel_json(schema.get("items", {}), v) for v in value]
    return value


def _unknown_fields(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Fields the schema does not declare (kubectl's strict field validation rejects them)."""
    problems: list[str] = []
    if isinstance(value, dict) and "properties" in schema:
        for name, item in value.items():
            where = f"{path}.{name}".lstrip(".")
            if name in schema["properties"]:
                problems += _unknown_fields(schema["properties"][name], item, where)
            else:
                problems.append(f'{where}: unknown field "{where}"')
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for name, item in value.items():
            problems += _unknown_fields(schema["additionalProperties"], item, f"{path}.{name}")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            problems += _unknown_fields(schema["items"], item, f"{path}[{index}]")
    return problems


def _cel_problems(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    import celpy

    problems: list[str] = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            problems.append(f"{path or '<root>'}: {rule['message']}")
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                problems += _cel_problems(sub, value[name], f"{path}.{name}".lstrip("."))
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            problems += _cel_problems(schema["items"], item, f"{path}[{index}]")
    return problems


def server_side_problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server would reject ``obj`` (a Tessera custom resource as JSON); empty if it accepts it."""
    import jsonschema

    schema = openapi_schema(str(obj.get("kind")))
    defaulted = apply_defaults(schema, obj)
    validator = jsonschema.Draft4Validator(schema)
    problems = _unknown_fields(schema, obj, "") + [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(defaulted), key=lambda e: list(map(str, e.absolute_path)))
    ]
    if problems:  # CEL runs only on objects that pass the schema, as on the server
        return problems
    return _cel_problems(schema, _as_cel_json(schema, defaulted), "")
