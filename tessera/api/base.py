"""Shared pieces of the Tessera API: the model base class, metadata, conditions, quantities."""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic.json_schema import GetJsonSchemaHandler, JsonSchemaValue
from pydantic_core import CoreSchema

from tessera.api.rules import Rule, cel_validations

GROUP = "tessera.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# DNS-1123 label: names the operator can reuse in the names of the Services, StatefulSets and
# ConfigMaps it creates. Kubernetes itself checks object names as DNS-1123 subdomains, which
# differ only by allowing dots and up to 253 characters; the CRD adds exactly that difference.
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
NAME_MAX_LENGTH = 63


class ApiModel(BaseModel):
    """Base of every API model: camelCase JSON names, snake_case attributes, unknown fields rejected.

    ``RULES`` lists the cross-field rules of the model (see ``tessera.api.rules``); they are
    checked here and emitted as CEL in the generated CRD.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )
    RULES: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Any:
        if self.RULES:
            as_json = self.model_dump(mode="json", by_alias=True, exclude_none=True)
            problems = [p for p in (rule.violation(as_json) for rule in self.RULES) if p]
            if problems:
                raise ValueError("; ".join(problems))
        return self

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema = handler(core_schema)
        if cls.RULES:
            handler.resolve_ref_schema(json_schema)["x-kubernetes-validations"] = cel_validations(cls.RULES)
        return json_schema

    def to_json(self) -> dict[str, Any]:
        """The object as Kubernetes JSON: camelCase keys, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def nested(model: type[ApiModel], description: str) -> Any:
    """A field holding a sub-object whose own defaults apply when it is left out.

    ``default: {}`` in the CRD makes the API server fill in the sub-object's defaults too,
    so Kubernetes and the models agree on the effective value.
    """
    return Field(default_factory=model, description=description, json_schema_extra={"default": {}})


# Kubernetes resource.Quantity syntax: a signed decimal number with an optional binary (Ki..Ei),
# decimal (m, k, M..E) or exponent (e3, E-2) suffix.
_SUFFIX = r"(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?"
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))" + _SUFFIX + "$")
# The subset the Quantity fields accept: unsigned, with a non-zero digit (so the value is > 0).
# The CRD uses the same pattern, so the API server and the models agree.
POSITIVE_QUANTITY_PATTERN = r"^(\d*[1-9]\d*(\.\d*)?|\d*\.\d*[1-9]\d*)" + _SUFFIX + "$"
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": Decimal(10**3)}
_DECIMAL |= {"M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15)}
_DECIMAL |= {"E": Decimal(10**18)}


def parse_quantity(text: str) -> float:
    """Value of a Kubernetes quantity string ("80Gi" -> 85899345920.0, "500m" -> 0.5).

    Raises ValueError with an example of the accepted syntax when ``text`` is not a quantity.
    """
    match = _QUANTITY.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"{text!r} is not a Kubernetes quantity; write a number with an optional suffix "
            "such as '80Gi', '16Gi', '40G' or '512Mi' (binary Ki/Mi/Gi/Ti, decimal k/M/G/T)"
        )
    try:
        number = Decimal(match[1])
    except InvalidOperation as err:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from err
    suffix = match[2] or ""
    if suffix in _BINARY:
        number *= _BINARY[suffix]
    elif suffix in _DECIMAL:
        number *= _DECIMAL[suffix]
    elif suffix:
        number *= Decimal(10) ** int(suffix[1:])
    return float(number)


def _valid_positive_quantity(text: str) -> str:
    parse_quantity(text)  # explains the syntax when it is not a quantity at all
    if re.match(POSITIVE_QUANTITY_PATTERN, text) is None:
        raise ValueError(f"{text!r} must be a positive quantity without a sign, e.g. '80Gi'")
    return text


# A byte quantity kept as written (so round trips are exact); read its value with parse_quantity.
Quantity = Annotated[
    str,
    AfterValidator(_valid_positive_quantity),
    Field(json_schema_extra={"pattern": POSITIVE_QUANTITY_PATTERN}),
]

# A duration: at least 1 ms (shorter is below what any engine step or network hop can meet) and at
# most 30 days (a longer SLO or deadline is no bound), never infinite or NaN.
MIN_SECONDS, MAX_SECONDS = 0.001, 30 * 86400.0
Seconds = Annotated[float, Field(ge=MIN_SECONDS, le=MAX_SECONDS, allow_inf_nan=False)]


class ObjectMeta(BaseModel):
    """The part of Kubernetes object metadata Tessera reads; other server-set fields are kept as given."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")

    name: str = Field(
        pattern=NAME_PATTERN,
        max_length=NAME_MAX_LENGTH,
        description="Object name: lowercase letters, digits and '-', at most 63 characters, no dots.",
    )
    namespace: str | None = Field(default=None, description="Namespace; unset means the current namespace.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")
    uid: str | None = Field(default=None, description="Unique id set by the API server.")
    generation: int | None = Field(default=None, description="Spec generation set by the API server.")


class Condition(ApiModel):
    """One observed condition of an object (the Kubernetes metav1.Condition shape)."""

    type: str = Field(description="Condition type in CamelCase, e.g. Ready, Placed, Progressing, Degraded.")
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds.")
    reason: str = Field(
        default="",
        description="Machine-readable CamelCase reason for the last transition, e.g. PoolNotFound.",
    )
    message: str = Field(default="", description="Human-readable details about the last transition.")
    last_transition_time: datetime | None = Field(
        default=None, description="When the status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation the condition was computed from."
    )


def conditions_field() -> Any:
    """The ``conditions`` status field shared by every resource."""
    return Field(
        default_factory=list,
        description="Current conditions of the object (Ready, and resource-specific ones).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class ResourceStatus(ApiModel):
    """Status fields every Tessera resource carries."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation the operator last acted on."
    )
    conditions: list[Condition] = conditions_field()


class Resource(ApiModel):
    """Common envelope of the three custom resources."""

    api_version: Literal["tessera.dev/v1alpha1"] = Field(
        default=API_VERSION, description="API group and version: tessera.dev/v1alpha1."
    )
    metadata: ObjectMeta = Field(description="Standard object metadata.")

    @property
    def name(self) -> str:
        """The object's name."""
        return self.metadata.name
