"""Parse multi-document YAML into typed Tessera resources, with errors that say where and what is allowed."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from tessera.api.base import API_VERSION
from tessera.api.llm_service import LLMService
from tessera.api.request_class import RequestClass
from tessera.api.serving_pool import ServingPool

Resource = ServingPool | LLMService | RequestClass
KINDS: dict[str, type[BaseModel]] = {
    "ServingPool": ServingPool,
    "LLMService": LLMService,
    "RequestClass": RequestClass,
}


class SpecError(ValueError):
    """A document could not be read as a Tessera resource; the message lists every problem found."""


def _model_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model class that holds the field at ``loc`` (JSON names), or None when it is not a model."""
    current: Any = model
    for part in loc:
        current = _unwrap(current)
        if isinstance(part, int) or current is None:
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        fields = {f.alias or n: f for n, f in current.model_fields.items()}
        if part not in fields:
            return None
        current = fields[part].annotation
    current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    """The model inside Optional[...] / list[...] / dict[str, ...], else the annotation itself."""
    while True:
        origin = typing.get_origin(annotation)
        if origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = args[0] if len(args) == 1 else None
        elif origin in (list, dict):
            annotation = typing.get_args(annotation)[-1]
        elif origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        else:
            return annotation


def _field_line(node: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    """1-based line of the YAML node at ``loc``, or of the deepest ancestor that exists."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        child = None
        if isinstance(node, yaml.MappingNode):
            child = next((v for k, v in node.value if k.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
        if child is None:
            break
        node, line = child, child.start_mark.line + 1
    return line


def _describe(model: type[BaseModel], error: Any) -> str:
    """One error as 'field.path: what is wrong (what is allowed)'."""
    loc = tuple(error["loc"])
    path = (
        ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in loc).replace(".[", "[") or "(document)"
    )
    kind, message = error["type"], error["msg"]
    if kind == "extra_forbidden":
        parent = _model_at(model, loc[:-1])
        allowed = sorted(f.alias or n for n, f in parent.model_fields.items()) if parent else []
        message = f"unknown field; allowed fields here: {', '.join(allowed)}"
    elif kind == "missing":
        message = "required field is missing"
    elif kind == "value_error":
        message = message.removeprefix("Value error, ")
    shown = error.get("input")
    if (
        kind not in ("missing", "extra_forbidden")
        and not isinstance(shown, dict)
        and repr(shown) not in message
    ):
        message += f" (got {shown!r})"
    return f"{path}: {message}"


def _iter_documents(text: str) -> typing.Iterator[tuple[int, yaml.Node, Any]]:
    """Each non-empty YAML document as (1-based start line, node, decoded data)."""
    loader = yaml.SafeLoader(text)
    try:
        while loader.check_node():
            node = loader.get_node()
            data = loader.construct_document(node) if node is not None else None
            if data is not None:  # an empty document ("---" at the end) holds nothing
                yield node.start_mark.line + 1, node, data
    finally:
        loader.dispose()


def parse_document(data: Any, node: yaml.Node | None = None, where: str = "document") -> Resource:
    """Validate one decoded document (a dict) as a Tessera resource.

    Raises SpecError naming ``where``, the object, each field at fault (with its line when ``node``
    is given) and what is allowed.
    """
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a mapping with apiVersion, kind, metadata and spec; got {data!r}")
    kind, api_version = data.get("kind"), data.get("apiVersion")
    if kind not in KINDS:
        raise SpecError(
            f"{where}: kind {kind!r} is not a Tessera resource; allowed kinds: {', '.join(KINDS)}"
        )
    if api_version != API_VERSION:
        raise SpecError(f"{where} ({kind}): apiVersion {api_version!r} is not supported; use {API_VERSION}")
    model = KINDS[kind]
    try:
        return typing.cast(Resource, model.model_validate(data))
    except ValidationError as err:
        name = (data.get("metadata") or {}).get("name") if isinstance(data.get("metadata"), dict) else None
        lines = []
        for e in err.errors():
            line = _field_line(node, tuple(e["loc"])) if node is not None else None
            lines.append(f"  - {_describe(model, e)}" + (f" [line {line}]" if line else ""))
        title = f"{where} ({kind} {name!r})" if name else f"{where} ({kind})"
        raise SpecError(f"{title} is invalid:\n" + "\n".join(lines)) from None


def load_documents(path_or_text: str | Path) -> list[Resource]:
    """Parse multi-document YAML (a file path or the YAML text) into typed Tessera resources.

    ``kind: List`` documents (as ``kubectl get -o yaml`` writes) contribute their items. Raises
    SpecError listing every invalid document, each with the fields at fault and what is allowed.
    """
    source = "<text>"
    one_line = "\n" not in str(path_or_text)
    looks_like_path = one_line and str(path_or_text).endswith((".yaml", ".yml", ".json"))
    if isinstance(path_or_text, Path) or looks_like_path or (one_line and Path(path_or_text).is_file()):
        source = str(path_or_text)
        try:
            text = Path(path_or_text).read_text()
        except OSError as err:
            raise SpecError(f"{source}: cannot read: {err.strerror}") from None
    else:
        text = path_or_text
    resources: list[Resource] = []
    problems: list[str] = []
    try:
        for index, (line, node, data) in enumerate(_iter_documents(text), start=1):
            where = f"{source}: document {index} (line {line})"
            if isinstance(data, dict) and data.get("kind") == "List":
                item_nodes = dict((k.value, v) for k, v in node.value).get("items")
                entries = [
                    (
                        item,
                        item_nodes.value[i] if isinstance(item_nodes, yaml.SequenceNode) else None,
                        f"{where} item {i}",
                    )
                    for i, item in enumerate(data.get("items") or [])
                ]
            else:
                entries = [(data, node, where)]
            for item, item_node, item_where in entries:
                try:
                    resources.append(parse_document(item, item_node, item_where))
                except SpecError as err:
                    problems.append(str(err))
    except yaml.YAMLError as err:
        raise SpecError(f"{source}: not valid YAML: {err}") from None
    if problems:
        raise SpecError("\n".join(problems))
    return resources
