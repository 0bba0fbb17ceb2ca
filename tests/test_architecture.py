"""The package's shape is enforced, not only drawn: the import-linter contracts in
pyproject.toml ([tool.importlinter]: no import cycle between batchserve's modules, the layers
of docs/architecture.md importing only downwards, the pure rules standing on the bottom
modules only, nothing importing the client; type-only imports included) run with the tests,
so the shape cannot rot silently.

import-linter runs in a child process: in this one it reconfigures logging (disabling the
loggers that exist), which silenced later tests' captured logs."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib

from .conftest import ROOT


def test_the_import_contracts_hold() -> None:
    run = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
           "lint_imports_command()", str(ROOT / "pyproject.toml"), "--no-cache"]  # fmt: skip
    checked = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert f"{len(contracts['contracts'])} kept, 0 broken" in checked.stdout


def test_no_door_names_the_engine() -> None:
    """Each door is handed a face (doors/face.py) or the engine's part it uses: no module
    of doors/ imports engine/core.py, nor names `Engine` in what it takes (the import
    contract above checks the imports too, at every depth)."""
    for path in sorted((ROOT / "batchserve" / "doors").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("engine.core", "batchserve.engine.core"), path.name
            if isinstance(node, ast.Name | ast.Attribute):
                name = node.id if isinstance(node, ast.Name) else node.attr
                assert name != "Engine", f"{path.name}:{node.lineno} names Engine"
