"""Cross-field rules, defined once and enforced twice.

Each rule yields the CEL expression the API server checks (``x-kubernetes-validations``
in the generated CRD) and the equivalent Python check that the pydantic models run.
Both read the object in its JSON form (camelCase keys, unset optional fields absent,
defaults applied), which is what CEL sees after the API server's defaulting.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_MISSING = object()


def _get(obj: Mapping[str, Any], path: str) -> Any:
    """Value at a dotted path of a JSON object, or ``_MISSING`` when any step is absent."""
    value: Any = obj
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _cel_has(path: str) -> str:
    """CEL presence test for a dotted path (each level must be tested in turn)."""
    parts = path.split(".")
    return " && ".join(f"has(self.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))


@dataclass(frozen=True)
class LessOrEqual:
    """``lower <= upper`` whenever both fields are set."""

    lower: str
    upper: str

    @property
    def message(self) -> str:
        """Human-readable statement of the rule."""
        return f"{self.lower} must be less than or equal to {self.upper}"

    def cel(self) -> str:
        """The rule as a CEL expression over ``self``."""
        both_set = f"({_cel_has(self.lower)}) && ({_cel_has(self.upper)})"
        return f"!({both_set}) || self.{self.lower} <= self.{self.upper}"

    def violation(self, obj: Mapping[str, Any]) -> str | None:
        """Why ``obj`` breaks the rule, or None when it holds."""
        low, high = _get(obj, self.lower), _get(obj, self.upper)
        if low is _MISSING or high is _MISSING or low <= high:
            return None
        return f"{self.message} (got {self.lower}={low}, {self.upper}={high})"


@dataclass(frozen=True)
class RequiredWhen:
    """``field`` must be set when ``when`` equals ``value``."""

    field: str
    when: str
    value: str

    @property
    def message(self) -> str:
        """Human-readable statement of the rule."""
        return f"{self.field} is required when {self.when} is '{self.value}'"

    def cel(self) -> str:
        """The rule as a CEL expression over ``self``."""
        return f"!({_cel_has(self.when)}) || self.{self.when} != '{self.value}' || ({_cel_has(self.field)})"

    def violation(self, obj: Mapping[str, Any]) -> str | None:
        """Why ``obj`` breaks the rule, or None when it holds."""
        if _get(obj, self.when) == self.value and _get(obj, self.field) is _MISSING:
            return f"{self.message}; set {self.field}"
        return None


@dataclass(frozen=True)
class MutuallyExclusive:
    """At most one of ``first`` and ``second`` may be set."""

    first: str
    second: str

    @property
    def message(self) -> str:
        """Human-readable statement of the rule."""
        return f"set at most one of {self.first} and {self.second}"

    def cel(self) -> str:
        """The rule as a CEL expression over ``self``."""
        return f"!(({_cel_has(self.first)}) && ({_cel_has(self.second)}))"

    def violation(self, obj: Mapping[str, Any]) -> str | None:
        """Why ``obj`` breaks the rule, or None when it holds."""
        if _get(obj, self.first) is not _MISSING and _get(obj, self.second) is not _MISSING:
            return f"{self.message}, not both"
        return None


@dataclass(frozen=True)
class ListedIn:
    """The string at ``field``, when set, equals the ``key`` of some item of the list ``items``."""

    field: str
    items: str
    key: str = "name"

    @property
    def message(self) -> str:
        """Human-readable statement of the rule."""
        return f"{self.field} must name one of the entries of {self.items} (by {self.key})"

    def cel(self) -> str:
        """The rule as a CEL expression over ``self``."""
        return (
            f"!({_cel_has(self.field)}) || "
            f"(({_cel_has(self.items)}) && self.{self.items}.exists(i, i.{self.key} == self.{self.field}))"
        )

    def violation(self, obj: Mapping[str, Any]) -> str | None:
        """Why ``obj`` breaks the rule, or None when it holds."""
        value = _get(obj, self.field)
        if value is _MISSING:
            return None
        items = _get(obj, self.items)
        names = [i.get(self.key) for i in items] if isinstance(items, list) else []
        if value in names:
            return None
        return f"{self.message}; got '{value}', listed: {names}"


def _prefixes(word: str) -> str:
    """A regular expression matching every non-empty prefix of ``word``, '-' and '_' alike."""
    out = ""
    for char in reversed(word):
        atom = "[-_]" if char in "-_" else re.escape(char)
        out = f"{atom}({out})?" if out else atom
    return out


def _flag_pattern(flags: tuple[str, ...]) -> str:
    """A regular expression (RE2 and Python alike) matching every command-line spelling argparse (with
    vLLM's '_' for '-' and dotted sub-keys) maps onto one of ``flags``: the flag or any abbreviation of
    it (argparse's ``allow_abbrev``), alone, as ``flag=value`` or as ``flag.key``."""
    long = [_prefixes(f[2:]) for f in flags if f.startswith("--")]
    short = [_prefixes(f[1:]) for f in flags if not f.startswith("--")]
    parts = []
    if long:
        parts.append(f"^--({'|'.join(long)})([.=].*)?$")
    if short:
        parts.append(f"^-({'|'.join(short)})(=.*)?$")
    return "|".join(f"({p})" for p in parts)


@dataclass(frozen=True)
class NoFlags:
    """No string of the list ``field`` sets one of ``flags`` in any spelling argparse accepts: the flag
    or an abbreviation of it, '_' for '-', alone or as ``flag=value`` (``_flag_pattern``). ``sources``
    says, for the message, which field sets each flag instead. The ``exact`` flags are allowed only
    spelled exactly (``flag`` or ``flag=value``): whoever reads them finds no other spelling."""

    field: str
    flags: tuple[str, ...]
    sources: tuple[tuple[str, str], ...] = ()
    exact: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        """Human-readable statement of the rule."""
        message = (
            f"{self.field} may not set {', '.join(self.flags)} in any spelling (abbreviated, '_' for '-'): "
            "they are set by the operator from the specs"
        )
        if self.exact:
            message += f"; {', '.join(self.exact)} only spelled so (alone or as flag=value)"
        return message

    def cel(self) -> str:
        """The rule as a CEL expression over ``self``."""
        check = f"!a.matches('{_flag_pattern(self.flags)}')"
        if self.exact:
            spelled = " || ".join(f"a == '{f}' || a.startsWith('{f}=')" for f in self.exact)
            check += f" && (!a.matches('{_flag_pattern(self.exact)}') || {spelled})"
        return f"!({_cel_has(self.field)}) || self.{self.field}.all(a, {check})"

    def violation(self, obj: Mapping[str, Any]) -> str | None:
        """Why ``obj`` breaks the rule (each offending item, the flag it sets and the field that sets that
        flag), or None when it holds."""
        values = _get(obj, self.field)
        sources = dict(self.sources)
        problems = []
        for i, arg in enumerate(values if isinstance(values, list) else []):
            if not isinstance(arg, str):
                continue
            if re.search(_flag_pattern(self.flags), arg):
                hits = [f for f in self.flags if re.search(_flag_pattern((f,)), arg)]
                said = " and ".join(f"{f}, which {sources[f]}" if f in sources else f for f in hits)
                problems.append(f"{self.field}[{i}] {arg!r} sets {said}: remove it")
            elif (
                self.exact
                and re.search(_flag_pattern(self.exact), arg)
                and arg.split("=", 1)[0] not in self.exact
            ):
                hits = [f for f in self.exact if re.search(_flag_pattern((f,)), arg)]
                problems.append(f"{self.field}[{i}] {arg!r} sets {' or '.join(hits)}: spell it so")
        if not problems:
            return None
        return f"{'; '.join(problems)} ({self.message})"


@dataclass(frozen=True)
class KeysAllowed:
    """The keys of the map ``field``, when set, are among those ``allowed`` for the value of ``selector``
    (a selector value not listed allows none)."""

    field: str
    selector: str
    allowed: tuple[tuple[str, tuple[str, ...]], ...]  # (selector value, keys it allows)

    @property
    def message(self) -> str:
        """Human-readable statement of the rule."""
        return f"{self.field} may only hold the fields that {self.selector} accepts"

    def cel(self) -> str:
        """The rule as a CEL expression over ``self``."""
        otherwise = f"size(self.{self.field}) == 0"
        for value, keys in reversed(self.allowed):
            listed = ", ".join(f"'{k}'" for k in keys)
            check = f"self.{self.field}.all(k, k in [{listed}])" if keys else f"size(self.{self.field}) == 0"
            otherwise = f"self.{self.selector} == '{value}' ? {check} : ({otherwise})"
        return f"!({_cel_has(self.field)}) || ({otherwise})"

    def violation(self, obj: Mapping[str, Any]) -> str | None:
        """Why ``obj`` breaks the rule, or None when it holds."""
        values, selector = _get(obj, self.field), _get(obj, self.selector)
        if not isinstance(values, Mapping):
            return None
        keys = dict(self.allowed).get(selector, ())
        unknown = sorted(k for k in values if k not in keys)
        return f"{self.message} ({selector}: {', '.join(keys) or 'none'}); got {unknown}" if unknown else None


@dataclass(frozen=True)
class ExcludedWhen:
    """``field``, when set, is not ``value`` while ``when`` is ``when_value``: two fields that would say
    opposite things."""

    field: str
    value: str
    when: str
    when_value: bool

    @property
    def message(self) -> str:
        """Human-readable statement of the rule."""
        return f"{self.field} may not be '{self.value}' when {self.when} is {json.dumps(self.when_value)}"

    def cel(self) -> str:
        """The rule as a CEL expression over ``self``."""
        when = f"({_cel_has(self.when)}) && self.{self.when} == {json.dumps(self.when_value)}"
        return f"!({when}) || !({_cel_has(self.field)}) || self.{self.field} != '{self.value}'"

    def violation(self, obj: Mapping[str, Any]) -> str | None:
        """Why ``obj`` breaks the rule, or None when it holds."""
        if _get(obj, self.when) is not self.when_value or _get(obj, self.field) != self.value:
            return None
        return f"{self.message}: drop one of them"


Rule = LessOrEqual | RequiredWhen | MutuallyExclusive | ListedIn | NoFlags | KeysAllowed | ExcludedWhen


def cel_validations(rules: tuple[Rule, ...]) -> list[dict[str, str]]:
    """The ``x-kubernetes-validations`` entries for a tuple of rules."""
    return [{"rule": rule.cel(), "message": rule.message} for rule in rules]
