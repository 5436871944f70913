"""`tessera bench --set`: an option that no scenario code reads is an error, not a silent default."""

from __future__ import annotations

import pytest

from tessera.bench.scenarios import Options
from tessera.cli import main


def test_options_record_what_was_read() -> None:
    opts = Options({"requests": "5", "typo": "1", "seen": "x"})
    assert opts.get("requests") == "5" and "seen" in opts
    assert opts.unused() == ["typo"]
    list(opts.items())  # iterating means every key was looked at
    assert opts.unused() == []


def test_unknown_set_key_fails_after_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "baseline", "--set", "requests=60", "--set", "reqests=60"]) == 2
    assert "--set reqests had no effect" in " ".join(capsys.readouterr().err.split())
    assert main(["bench", "baseline", "--set", "requests=60"]) == 0


def test_batch_local_refuses_bad_options_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "batch-local", "--set", "window=48h"]) == 2
    assert "completion_window '48h' is not offered" in " ".join(capsys.readouterr().err.split())
    assert main(["bench", "batch-local", "--set", "lines=0"]) == 2
    assert "lines and rounds must be >= 1" in capsys.readouterr().err
