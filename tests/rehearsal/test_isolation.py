"""The rehearsal drives the shipped code and is never part of it."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = [ROOT / "functions", ROOT / "vm-bootstrap"]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def test_no_shipped_module_imports_the_rehearsal():
    sources = [p for root in SHIPPED for p in root.rglob("*.py")]
    assert len(sources) > 20, "the shipped code should be found"
    offenders = {
        str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m.split(".")[0] in ("rehearsal", "moto"))
        for p in sources
    }
    assert {path: modules for path, modules in offenders.items() if modules} == {}


def test_no_shipped_module_names_the_rehearsal_as_a_module():
    # A dynamic import (importlib.import_module("rehearsal.x")) would not be an import statement.
    sources = [p for root in SHIPPED for p in root.rglob("*.py")]
    named = [
        str(p.relative_to(ROOT))
        for p in sources
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.match(r"rehearsal(\.|$)", node.value)
    ]
    assert named == []


def test_the_checker_sees_an_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom rehearsal.cloud import LocalCloud\n")
    assert "rehearsal.cloud" in imported_modules(sample)
