"""The package reads as the paper's steps in order: each module imports only modules before it in
ORDER (so there is no import cycle), the method (dofmini/*.py) imports nothing of the study harness
(dofmini/study/), nothing is imported by name at run time, and reproduce.py sits at the end."""

import ast

import pytest
from conftest import REPO

PACKAGE = REPO / "dofmini"
# the method: infrastructure, then the paper's steps; generate serves any model
CORE = (
    "files",
    "checks",
    "model",
    "checkpoint",
    "hub",
    "tensor_files",
    "dof",
    "plain_forms",
    "log_space",
    "linear_attention",
    "dijiang",
    "students",
    "distill",
    "generate",
)
# the study harness around it: data, evaluation, stages, then what the results become
STUDY = tuple(
    f"study.{name}"
    for name in (
        "progress",
        "tasks",
        "data",
        "task_train",
        "devices",
        "evaluate",
        "store",
        "guard",
        "oracle",
        "run",
        "bank",
        "compute",
        "endtoend",
        "stats",
        "compare",
        "finetune",
        "runner",
        "finetune_stages",
        "estimate",
        "verdicts",
        "figures",
        "report",
        "pipeline",
        "flags",
    )
)
ORDER = CORE + STUDY


def module_name(path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def package_imports(path) -> set:
    """The dofmini modules a file imports, as names like "model" or "study.data", and
    "<import by name>" when it imports anything by name at run time."""
    here = module_name(path).split(".")[:-1] if path.is_relative_to(PACKAGE) else []
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or node.module.startswith("dofmini")):
            if node.level:
                base = here[: len(here) - node.level + 1] + (node.module or "").split(".")
            else:
                base = node.module.split(".")[1:]
            base = [part for part in base if part]
            for alias in node.names:  # `from . import data` names a module; `import x` a name
                candidate = ".".join(base + [alias.name])
                is_module = (PACKAGE / f"{candidate.replace('.', '/')}.py").exists()
                found.add(candidate if is_module else ".".join(base))
        if isinstance(node, ast.Import):
            prefix = "dofmini."
            found |= {a.name[len(prefix) :] for a in node.names if a.name.startswith(prefix)}
        if isinstance(node, ast.Name) and node.id in ("importlib", "__import__"):
            found.add("<import by name>")
    return found - {"", "study"}


def test_every_module_is_in_the_order():
    modules = {module_name(p) for p in PACKAGE.rglob("*.py") if p.stem != "__init__"}
    assert modules == set(ORDER)


@pytest.mark.parametrize("module", ORDER)
def test_module_imports_only_earlier_modules(module):
    imported = package_imports(PACKAGE / f"{module.replace('.', '/')}.py")
    earlier = set(ORDER[: ORDER.index(module)])
    assert imported <= earlier, f"{module} imports {sorted(imported - earlier)}"


@pytest.mark.parametrize("module", CORE)
def test_the_method_imports_nothing_of_the_study(module):
    imported = package_imports(PACKAGE / f"{module}.py")
    assert not {name for name in imported if name.startswith("study")}, imported


def test_reproduce_imports_the_package_only():
    imported = package_imports(REPO / "reproduce.py")
    assert "<import by name>" not in imported and imported <= set(ORDER)
