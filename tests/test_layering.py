"""Layering, checked on the source with `ast` (nothing is imported or run).

- Nothing in exporter/ imports remediator/: the exporter ships and runs alone.
- The pure modules import nothing that does I/O. gpuguard/orphans/classify.py has an
  explicit allow-list (every module and name it may import); remediator/policy.py,
  which is being reworked more often, a deny-list of I/O modules only.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: Modules that read or write files, processes, sockets, the driver or the environment.
IO_MODULES = frozenset({
    "os", "sys", "io", "pathlib", "shutil", "glob", "tempfile", "subprocess", "socket",
    "select", "selectors", "ssl", "http", "urllib", "requests", "flask", "werkzeug", "waitress",
    "pynvml", "ctypes", "mmap", "fcntl", "pwd", "grp", "resource", "multiprocessing",
    "threading", "asyncio", "importlib", "logging", "json", "yaml", "sqlite3", "psutil",
    # this project's own I/O layers
    "gpuguard.host.procfs", "gpuguard.exporter.scanner", "gpuguard.web.serving",
    "gpuguard.exporter.cli", "gpuguard.host.procevents", "gpuguard.periodic",
    "gpuguard.exporter.metrics", "gpuguard.remediator.worker", "gpuguard.remediator.reaper",
    "gpuguard.remediator.ledger", "gpuguard.remediator.audit", "gpuguard.remediator.app",
    "gpuguard.remediator.cli", "gpuguard.remediator.pull", "gpuguard.remediator.alertmanager",
    "gpuguard.console",
})

#: gpuguard/orphans/classify.py: each module it may import, with the names it may take from it
#: (None: the module itself, or any name from it). procfs and nvml give types and pure
#: helpers only; counters is the in-memory cost accounting; signal maps a number to its
#: name and time formats a given timestamp (neither reads a clock or sends anything).
CLASSIFY_ALLOWED: dict[str, frozenset[str] | None] = {
    "__future__": None,
    "collections.abc": None,
    "dataclasses": None,
    "enum": None,
    "functools": None,
    "itertools": None,
    "re": None,
    "re2": None,
    "signal": None,
    "time": None,
    "typing": None,
    "gpuguard.host.counters": frozenset({"COUNTERS"}),
    "gpuguard.host.nvml": frozenset({"Holder"}),
    "gpuguard.host.procfs": frozenset(
        {"ProcInfo", "ProcStatus", "ProcUnreadable", "Truncated", "still_same",
         "walk_members"}),
}


def module_name(path: Path) -> str:
    """The installed name: exporter/ and remediator/ are gpuguard.exporter and .remediator."""
    return ".".join(("gpuguard", *path.relative_to(REPO).with_suffix("").parts))


def _is_type_checking(test: ast.expr) -> bool:
    """The test of `if TYPE_CHECKING:` / `if typing.TYPE_CHECKING:` (a body that never runs)."""
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports(path: Path, module: str | None = None, *, with_typing_only: bool = True,
            ) -> Iterator[tuple[int, str, str | None]]:
    """(line, module, name or None) for every import anywhere in the file (inside functions
    too; inside `if TYPE_CHECKING:` unless with_typing_only is false), relative ones
    resolved as if the file were `module` (default: its own name), and
    `__import__("x")` / `import_module("x")` with a literal name."""
    package = (module or module_name(path)).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            typing_only.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) in typing_only and not with_typing_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                yield node.lineno, module, alias.name
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id == "__import__")
                   or (isinstance(node.func, ast.Attribute)
                       and node.func.attr == "import_module"))):
            yield node.lineno, node.args[0].value, None


def under(module: str, packages: frozenset[str] | set[str]) -> str | None:
    """The entry of `packages` that `module` is or lies inside, if any."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in packages:
            return ".".join(parts[:i])
    return None


def test_the_parser_sees_every_kind_of_import(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text("import os.path\nfrom . import scanner\nfrom ..remediator.policy import x\n"
                   "def f():\n    import remediator\n    __import__('remediator.app')\n"
                   "if TYPE_CHECKING:\n    import remediator.ledger\n")
    every = [(1, "os.path", None), (2, "gpuguard.exporter", "scanner"),
             (3, "gpuguard.remediator.policy", "x"), (5, "remediator", None),
             (6, "remediator.app", None), (8, "remediator.ledger", None)]
    assert sorted(imports(src, "gpuguard.exporter.probe")) == every
    assert sorted(imports(src, "gpuguard.exporter.probe", with_typing_only=False)) == every[:-1]


def test_nothing_in_exporter_imports_remediator() -> None:
    files = sorted((REPO / "exporter").rglob("*.py"))
    assert len(files) > 5
    bad = [f"{path.relative_to(REPO)}:{line}: {module}" + (f".{name}" if name else "")
           for path in files for line, module, name in imports(path)
           if under(f"{module}.{name}" if name else module, {"gpuguard.remediator"})]
    assert bad == [], "the exporter must not import the remediator:\n" + "\n".join(bad)


def test_classify_imports_only_its_allow_list() -> None:
    path = REPO / "gpuguard" / "orphans" / "classify.py"
    bad = []
    for line, module, name in imports(path):
        if module not in CLASSIFY_ALLOWED or (
                (names := CLASSIFY_ALLOWED[module]) is not None and name not in names):
            bad.append(f"classify.py:{line}: {module}" + (f" ({name})" if name else ""))
    assert bad == [], "gpuguard/orphans/classify.py is pure; not allowed:\n" + "\n".join(bad)
    # The one I/O module on the list gives named types and pure helpers only.
    assert set(CLASSIFY_ALLOWED) & IO_MODULES == {"gpuguard.host.procfs"}


@pytest.mark.parametrize("pure", ["gpuguard/orphans/classify.py", "remediator/policy.py"])
def test_pure_modules_import_no_io(pure: str) -> None:
    bad = [f"{pure}:{line}: {module}" + (f" ({name})" if name else "")
           for line, module, name in imports(REPO / pure, with_typing_only=False)
           if under(module, IO_MODULES)
           and not (pure == "gpuguard/orphans/classify.py"
                    and name in (CLASSIFY_ALLOWED.get(module) or ()))]
    assert bad == [], f"{pure} must not do I/O; it imports:\n" + "\n".join(bad)


def test_every_own_import_is_under_the_gpuguard_namespace() -> None:
    """The wheel installs one top-level package, gpuguard: a bare `import exporter` works in
    the checkout (its folder is on sys.path) and fails, or finds someone else's, installed."""
    files = [p for top in ("exporter", "remediator", "gpuguard", "tests", "benchmarks")
             for p in sorted((REPO / top).rglob("*.py"))]
    bad = [f"{path.relative_to(REPO)}:{line}: {module}"
           for path in files for line, module, _name in imports(path)
           if under(module, {"exporter", "remediator"})]
    assert bad == [], "import gpuguard.exporter / gpuguard.remediator instead:\n" + "\n".join(bad)
