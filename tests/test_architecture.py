"""The package's shape is enforced, not only drawn: the import-linter contracts in
pyproject.toml ([tool.importlinter]: no import cycle between batchserve's modules, type-only
imports included) run with the tests, so the shape cannot rot silently."""

from __future__ import annotations

from importlinter.cli import EXIT_STATUS_SUCCESS, lint_imports

from .conftest import ROOT


def test_the_import_contracts_hold(capsys) -> None:
    status = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    assert status == EXIT_STATUS_SUCCESS, capsys.readouterr().out
