"""Policy names (as used in configuration and bench rows) mapped to their classes and settings models.

Each policy has a typed, frozen settings model beside its class: the product settings a worker
configuration or an LLMService may give it (``scheduling.settings``), validated at load time with
an error that names the policy, the field at fault and what the policy accepts. Research ablations
stay constructor keywords only: the benches build those variants by calling the class directly.

Modules are imported lazily so that a policy's heavy dependencies (torch for the
ELIS predictor, PuLP for QLM) load only when that policy is used.
"""

from __future__ import annotations

import importlib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

from tessera.core.policy import Policy


class PolicySettings(BaseModel):
    """Base of every policy's settings: camelCase in configuration files (snake_case accepted too),
    unknown fields refused, no coercion between types (``"50"`` is not a number), immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True, frozen=True
    )

    def policy_kwargs(self) -> dict[str, Any]:
        """The constructor keywords these settings stand for."""
        return {name: getattr(self, name) for name in type(self).model_fields}


class NoSettings(PolicySettings):
    """A policy without settings."""


# name -> ("module:Class", "module:Settings"). Each later policy adds one line here.
POLICIES: dict[str, tuple[str, str]] = {
    "fcfs": ("tessera.core.baselines:FCFS", "tessera.core.registry:NoSettings"),
    "edf": ("tessera.core.baselines:EDF", "tessera.core.baselines:EDFSettings"),
    "priority": ("tessera.core.baselines:ClassPriority", "tessera.core.baselines:PrioritySettings"),
    "sjf-oracle": ("tessera.core.baselines:SJFOracle", "tessera.core.registry:NoSettings"),
    "srtf-oracle": ("tessera.core.baselines:SRTFOracle", "tessera.core.baselines:SRTFOracleSettings"),
    "isrtf": ("tessera.core.policies.isrtf:ISRTF", "tessera.core.policies.isrtf:ISRTFSettings"),
    "isrtf-tail": ("tessera.core.policies.isrtf:TailISRTF", "tessera.core.policies.isrtf:TailISRTFSettings"),
    "qoe": ("tessera.core.policies.qoe:AndesQoE", "tessera.core.policies.qoe:QoESettings"),
    "qlm": ("tessera.core.policies.qlm:QLMPolicy", "tessera.core.policies.qlm.policy:QLMSettings"),
    "seallm": ("tessera.core.policies.seallm:DoublingBudget", "tessera.core.policies.seallm:SeaLLMSettings"),
    "round-robin-sharing": (
        "tessera.core.policies.seallm:RoundRobinSharing",
        "tessera.core.policies.seallm:RoundRobinSharingSettings",
    ),
}


def _load(name: str, target: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"policy {name!r} is not available in this build ({exc})") from exc
    return getattr(module, attr)


def _entry(name: str) -> tuple[str, str]:
    entry = POLICIES.get(name)
    if entry is None:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}")
    return entry


def policy_class(name: str) -> type[Policy]:
    """The class registered under ``name``; ValueError naming the known policies otherwise."""
    return _load(name, _entry(name)[0])


def settings_model(name: str) -> type[PolicySettings]:
    """The settings model registered under ``name``; ValueError naming the known policies otherwise."""
    return _load(name, _entry(name)[1])


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # bounds of a member of a union (an optional number) are said here
        return " ".join([_type_name(args[0]), _bounds(args[1:])]).strip()
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names + (["null"] if type(None) in args else []))
    if origin in (dict, Mapping):
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        fields = ", ".join(
            f"{f.alias or n}: {_type_name(f.annotation)}" for n, f in annotation.model_fields.items()
        )
        return "{" + fields + "}"
    return {int: "integer", float: "number", bool: "boolean", str: "string"}.get(annotation, str(annotation))


_BOUNDS = {
    annotated_types.Gt: ">",
    annotated_types.Ge: ">=",
    annotated_types.Lt: "<",
    annotated_types.Le: "<=",
}


def _bounds(metadata: typing.Iterable[Any]) -> str:
    """The numeric bounds among a field's metadata, as ``>= 0 and < 1``."""
    found = []
    for m in metadata:
        for item in getattr(m, "metadata", [m]):  # a pydantic FieldInfo carries its constraints inside
            for kind, op in _BOUNDS.items():
                if isinstance(item, kind):
                    found.append(f"{op} {getattr(item, type(item).__name__.lower())}")
    return " and ".join(found)


@dataclass(frozen=True, slots=True)
class SettingDoc:
    """One setting of a policy as the reference and the error messages describe it."""

    name: str  # as written in configuration files (camelCase)
    kind: str  # type and bounds, e.g. "number >= 0"
    default: str  # repr of the default; "required" when there is none
    description: str


def setting_docs(name: str) -> list[SettingDoc]:
    """Each setting of policy ``name``: its name, type with bounds, default and description."""
    docs = []
    for field_name, info in settings_model(name).model_fields.items():
        default = "required" if info.is_required() else repr(info.get_default(call_default_factory=True))
        kind = " ".join([_type_name(info.annotation), _bounds(info.metadata)]).strip()
        docs.append(SettingDoc(info.alias or field_name, kind, default, info.description or ""))
    return docs


def describe_settings(name: str) -> str:
    """What policy ``name`` accepts in ``scheduling.settings``: each field, its type, bounds and default."""
    docs = setting_docs(name)
    if not docs:
        return f"policy {name!r} takes no settings"
    parts = [
        f"{d.name} ({d.kind}{'' if d.default == 'required' else f', default {d.default}'})" for d in docs
    ]
    return f"policy {name!r} accepts: " + "; ".join(parts)


def validate_settings(
    name: str, settings: Mapping[str, Any] | PolicySettings | None = None
) -> PolicySettings:
    """``settings`` checked against policy ``name``'s settings model.

    ValueError naming the policy, each field at fault and every field the policy accepts with its
    type, for an unknown policy, an unknown field, a wrong type or a value out of bounds.
    """
    model = settings_model(name)
    if isinstance(settings, model):
        return settings
    if isinstance(settings, PolicySettings):
        raise ValueError(f"policy {name!r} takes {model.__name__}, not {type(settings).__name__}")
    try:
        return model.model_validate(dict(settings or {}))
    except ValidationError as err:
        problems = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                problems.append(f"unknown setting {where!r}")
            else:
                problems.append(f"setting {where!r}: {e['msg']} (got {e['input']!r})")
        raise ValueError(
            f"bad settings for policy {name!r}: {'; '.join(problems)}. {describe_settings(name)}"
        ) from None


def make_policy(
    name: str, settings: Mapping[str, Any] | PolicySettings | None = None, **kwargs: Any
) -> Policy:
    """Instantiate the policy ``name`` with its settings (a settings model, or its fields as a mapping
    or as keywords), validated first (``validate_settings``); research ablations that are not
    settings are constructor keywords of the class itself (``policy_class(name)(...)``)."""
    if settings is not None and kwargs:
        raise TypeError("give the settings either as a mapping or as keywords, not both")
    checked = validate_settings(name, settings if settings is not None else kwargs)
    return policy_class(name)(**checked.policy_kwargs())
