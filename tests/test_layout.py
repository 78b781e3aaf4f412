"""The package reads as the paper's steps in order: each module imports only modules before it in
ORDER (so there is no import cycle), nothing is imported by name at run time, and reproduce.py sits
at the end of the path."""

import ast

import pytest
from conftest import REPO

# infrastructure, then the paper's steps: model -> dof -> linear attention -> students -> distill ->
# evaluate -> compare -> report; generate serves any model and imports nothing of the package
ORDER = (
    "files",
    "checkpoint",
    "data",
    "tasks",
    "config",
    "model",
    "dof",
    "linear_attention",
    "dijiang",
    "students",
    "distill",
    "evaluate",
    "runs",
    "stats",
    "plots",
    "compare",
    "report",
    "generate",
)


def package_imports(path) -> set:
    """The dofmini modules a file imports, and whether it imports anything by name at run time."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or node.module == "dofmini"):
            if node.module and node.module != "dofmini":
                found.add(node.module.split(".")[-1])
            else:  # from . import data: only names that are modules (not __version__)
                found |= {
                    a.name for a in node.names if (REPO / "dofmini" / f"{a.name}.py").exists()
                }
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("dofmini.")}
        if isinstance(node, ast.Name) and node.id in ("importlib", "__import__"):
            found.add("<import by name>")
    return found


def test_every_module_is_in_the_order():
    modules = {p.stem for p in (REPO / "dofmini").glob("*.py")} - {"__init__"}
    assert modules == set(ORDER)


@pytest.mark.parametrize("module", ORDER)
def test_module_imports_only_earlier_modules(module):
    imported = package_imports(REPO / "dofmini" / f"{module}.py")
    earlier = set(ORDER[: ORDER.index(module)])
    assert imported <= earlier, f"{module} imports {sorted(imported - earlier)}"


def test_reproduce_imports_the_package_only():
    imported = package_imports(REPO / "reproduce.py")
    assert "<import by name>" not in imported and imported <= set(ORDER) | {"dofmini"}
