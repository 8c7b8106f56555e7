"""Tests share helpers through support modules and conftest.py, never by importing another test module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(source: str) -> Iterator[str]:
    """The test modules (`test_*`) that this source imports, absolutely or relatively."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            modules = [base] if node.module else [f"{base}{alias.name}" for alias in node.names]
        else:
            continue
        yield from (module for module in modules if any(part.startswith("test_") for part in module.split(".")))


def test_the_check_sees_absolute_and_relative_imports_of_a_test_module() -> None:
    source = (
        "import tests.infra.test_stack\n"
        "from tests.workflow.test_recovery import commit\n"
        "from .test_store_credentials import answer\n"
        "from . import test_handlers\n"
        "from tests.workflow.support import commit\n"
        "from .conftest import wait_for\n"
    )
    assert list(imported_test_modules(source)) == [
        "tests.infra.test_stack",
        "tests.workflow.test_recovery",
        ".test_store_credentials",
        ".test_handlers",
    ]


def test_no_module_under_tests_imports_a_test_module() -> None:
    found = {
        str(path.relative_to(TESTS)): modules
        for path in sorted(TESTS.rglob("*.py"))
        if (modules := list(imported_test_modules(path.read_text())))
    }
    assert not found, f"move shared helpers to the area's support.py (or conftest.py for fixtures): {found}"
