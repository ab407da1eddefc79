"""The package's seams stay public: no module reaches into another's private names.

Every part of `workflow/` talks to another through public (documented, typed)
methods and functions, so a new feature finds an obvious room instead of a knot.
This test reads the source (it runs nothing): an attribute `x._name` where `x` is
not `self` or `cls` (dunders, and the stdlib's `os._exit`, aside), or an import
of a `_name` from a `workflow` module, fails it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "workflow"


def _reaches(path: Path) -> list[str]:
    tree = ast.parse(path.read_text("utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Name) and base.id == "os" and node.attr == "_exit":
                continue
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("workflow"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: "
                        f"from {node.module} import {alias.name}"
                    )
    return found


def test_no_module_reaches_into_another_modules_private_names() -> None:
    reaches = [r for path in sorted(PACKAGE.rglob("*.py")) for r in _reaches(path)]
    assert reaches == [], "\n".join(reaches)


def test_the_check_sees_a_reach_and_nothing_else(tmp_path: Path) -> None:
    sample = PACKAGE.parent / "tests" / f"_reach_sample_{tmp_path.name}.py"
    sample.write_text(
        "import os\n"
        "from workflow.store import _Q\n"
        "class C:\n"
        "    def f(self, mgr):\n"
        "        os._exit(0)\n"
        "        return self._own, mgr._store, mgr.__class__\n",
        "utf-8",
    )
    try:
        found = _reaches(sample)
    finally:
        sample.unlink()
    shown = sorted(line.split(": ", 1)[1] for line in found)
    assert shown == ["from workflow.store import _Q", "mgr._store"]
