"""The router reads the Authorization scheme the same way whatever the HTTP server does to whitespace.

uvicorn 0.55 strips trailing whitespace from header values (0.54 did not), so ``Bearer `` may arrive as
``Bearer``: both are an empty key, answered "invalid API key", not "must be 'Bearer <key>'".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.api.openai_errors import ApiError
from tessera.router.auth import ApiKeys

KEY = "sk-scheme-0123456789abcdef"


@pytest.fixture
def keys(tmp_path: Path) -> ApiKeys:
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - key: {KEY}\n    tenant: team-a\n")
    return ApiKeys(path)


@pytest.mark.parametrize("value", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER   {KEY}  ", f"  Bearer {KEY}"])
def test_a_bearer_key_is_accepted_whatever_the_case_and_spaces(keys: ApiKeys, value: str) -> None:
    assert keys.authenticate({"authorization": value}).tenant == "team-a"


@pytest.mark.parametrize("value", ["Bearer", "Bearer ", "bearer   ", "Bearer sk-wrong-0123456789"])
def test_an_empty_or_unknown_bearer_key_is_an_invalid_key(keys: ApiKeys, value: str) -> None:
    with pytest.raises(ApiError) as caught:
        keys.authenticate({"authorization": value})
    assert caught.value.status == 401
    assert caught.value.message.startswith("invalid API key")


@pytest.mark.parametrize("value", ["", "Basic c3VpdGU6eA==", f"Bearer{KEY}", f"Token {KEY}"])
def test_another_scheme_is_named(keys: ApiKeys, value: str) -> None:
    with pytest.raises(ApiError) as caught:
        keys.authenticate({"authorization": value})
    assert caught.value.status == 401
    assert "must be 'Bearer <key>'" in caught.value.message
