"""Smoke tests of the benchmarks in ``bench/``: they run with tiny sizes; no timing is asserted."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest


def last_json(capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], object], argv: list[str]) -> dict:
    """Run a bench's ``main(argv)``; its last printed line must be a JSON object (returned)."""
    returned = main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert isinstance(out, dict)
    if returned is not None:
        assert out == json.loads(json.dumps(returned))  # what it prints is what it returns
    return out
