"""Layering and size rules for the whole package, checked on the source with `ast`
(nothing is imported or run); docs/design.md "Layers" says why.

- No import cycle anywhere in gpuguard, counting imports inside functions and under
  `if TYPE_CHECKING:` (a module's types live at or below it).
- The pure core imports nothing that does I/O: the classifier (gpuguard/orphans/) from an
  explicit allow-list, the kill policy (gpuguard/engine/decision/policy.py) from a deny-list.
- Nothing in exporter/ imports remediator/: the exporter ships and runs alone; and no
  module the daemons import imports either of them back (the config sections are shared).
- Sizes: past the wall (WALL_LINES) a test fails; inside the review band (REVIEW_LINES)
  a warning lists the function, class or module for review. No package folder holds
  more than MAX_FOLDER_MODULES modules.
- One import name per module: exporter/ and remediator/ import only as gpuguard.X.
- One vocabulary (gpuguard/orphans/vocabulary.py): no module outside it spells one of its
  values as a bare string where the string decides or records something.
- Windows code in two folders (gpuguard/host/windows/, gpuguard/engine/windows/), and
  nothing below the engine's Windows half imports it or engine/platforms.py.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "gpuguard"

#: Modules that read or write files, processes, sockets, the driver or the environment.
IO_MODULES = frozenset({
    "os", "sys", "io", "pathlib", "shutil", "glob", "tempfile", "subprocess", "socket",
    "select", "selectors", "ssl", "http", "urllib", "requests", "flask", "werkzeug", "waitress",
    "pynvml", "ctypes", "mmap", "fcntl", "pwd", "grp", "resource", "multiprocessing",
    "threading", "asyncio", "importlib", "logging", "json", "yaml", "sqlite3", "psutil",
    # this project's own I/O layers
    "gpuguard.host.procfs", "gpuguard.host.events.listener", "gpuguard.host.events.connector",
    "gpuguard.host.users", "gpuguard.host.marks", "gpuguard.host.registrar",
    "gpuguard.host.launcher_memory", "gpuguard.host.descriptors", "gpuguard.host.fdsearch",
    "gpuguard.web", "gpuguard.console", "gpuguard.launch",
    "gpuguard.base.periodic", "gpuguard.engine.scan.scanner", "gpuguard.exporter.cli",
    "gpuguard.exporter.metrics", "gpuguard.remediator.worker", "gpuguard.remediator.app",
    "gpuguard.remediator.cli", "gpuguard.engine.reap.reaper",
    "gpuguard.engine.state.ledger", "gpuguard.engine.reap.audit",
    "gpuguard.remediator.pull", "gpuguard.engine.alerting.alertmanager",
    "gpuguard.engine.reap.signalling", "gpuguard.engine.reap.freezing",
    "gpuguard.engine.reap.killing", "gpuguard.engine.reap.recheck",
    "gpuguard.engine.reap.recovery", "gpuguard.engine.reap.thaw_guardian",
    "gpuguard.engine.scan.inspection", "gpuguard.engine.scan.idle_watch",
    "gpuguard.engine.scan.chain_watch",
})

#: gpuguard/orphans/: each module it may import, with the names it may take from it (None:
#: the module itself, or any name from it). counters is the in-memory cost accounting
#: (host's one pure module); signal maps a number to its name and time formats a given
#: timestamp (neither reads a clock or sends anything).
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
    "gpuguard.base.counters": frozenset({"COUNTERS"}),
    # What Python 3.10 lacks (StrEnum): definitions only, no I/O.
    "gpuguard.base.compat": frozenset({"StrEnum"}),
}

#: Sizes in lines, a review signal rather than a wall to press against (CONTRIBUTING.md,
#: "Size"). Inside the band [REVIEW, WALL) a function, class or module is listed as a
#: warning (pytest's warnings summary): is it still one concept? Only past WALL, far above
#: anything today, does the test fail.
REVIEW_LINES = {"function": 60, "class": 250, "module": 500}
WALL_LINES = {"function": 120, "class": 450, "module": 900}
#: Modules per package folder (besides __init__ and __main__): a folder past this is
#: several jobs in one room; give each its sub-package.
MAX_FOLDER_MODULES = 15


def package_modules() -> dict[str, Path]:
    """Every module of the installed package by its import name, through the symlinks."""
    found: dict[str, Path] = {}
    for folder, _dirs, names in os.walk(PACKAGE, followlinks=True):
        for name in names:
            if name.endswith(".py"):
                path = Path(folder) / name
                parts = path.relative_to(REPO).with_suffix("").parts
                module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found[module] = path
    return found


MODULES = package_modules()


def module_name(path: Path) -> str:
    """The installed name of a source file (exporter/x.py is gpuguard.exporter.x)."""
    resolved = path.resolve()
    for module, source in MODULES.items():
        if source.resolve() == resolved:
            return module
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




def target(module: str, name: str | None) -> str | None:
    """The package module an import statement loads: `from a import b` is a.b when that
    is a module, else a."""
    if name and f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    return under(module, set(MODULES))


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a package's own __init__ excluded when
    a module imports from below it: `from gpuguard.host import procfs` loads procfs)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for _line, imported, name in imports(path, module):
            dest = target(imported, name)
            if dest is None or dest == module or module.startswith(dest + "."):
                continue
            graph[module].add(dest)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


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


def test_the_module_walk_sees_the_whole_package_through_its_links() -> None:
    for module in ("gpuguard.orphans.process", "gpuguard.host.procfs", "gpuguard.web.serving",
                   "gpuguard.engine.scan.scanner", "gpuguard.engine.decision.policy",
                   "gpuguard.console", "gpuguard.console.run.launcher"):
        assert module in MODULES, module


def test_cycle_finder_finds_a_cycle_through_three_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package() -> None:
    found = cycles(import_graph())
    assert found == [], "import cycles (TYPE_CHECKING imports count):\n" + "\n".join(
        " <-> ".join(c) for c in found)


#: The three programs: each may import the engine and the layers below it, never another
#: program (docs/design.md, Layers). `gpuguard run` is the console's (console/run/); the
#: parts its launcher is built of (gpuguard/launch/) lie in the engine's layer.
PROGRAMS = {
    "exporter": frozenset({"gpuguard.exporter"}),
    "remediator": frozenset({"gpuguard.remediator"}),
    "console": frozenset({"gpuguard.console"}),
}


def program_of(module: str) -> str | None:
    return next((name for name, roots in PROGRAMS.items() if under(module, roots) is not None),
                None)


def test_no_program_imports_another() -> None:
    """What two programs share lives in the engine (gpuguard/engine/): a program that
    imports another's module makes it a library of the first, and a change to either
    breaks both (the console imported the remediator 29 times, the exporter's scanner 8)."""
    for name, roots in PROGRAMS.items():
        assert sum(under(m, roots) is not None for m in MODULES) > 3, f"{name}: none found"
    bad = [f"{path.relative_to(REPO)}:{line}: {target}"
           for module, path in MODULES.items() if (mine := program_of(module)) is not None
           for line, imported, name in imports(path)
           for target in [f"{imported}.{name}" if name else imported]
           if (theirs := program_of(target)) is not None and theirs != mine]
    assert bad == [], "a program imports another:\n" + "\n".join(bad)


DAEMONS = frozenset({"gpuguard.exporter", "gpuguard.remediator"})


def imported_by_the_daemons(graph: dict[str, set[str]]) -> set[str]:
    """Every module outside exporter/ and remediator/ that one of their modules loads,
    directly or through other such modules."""
    found: set[str] = set()
    stack = [dest for module, dests in graph.items() if under(module, DAEMONS)
             for dest in dests if not under(dest, DAEMONS)]
    while stack:
        module = stack.pop()
        if module not in found:
            found.add(module)
            stack.extend(d for d in graph[module] if not under(d, DAEMONS))
    return found


def test_nothing_the_daemons_import_imports_a_daemon_back() -> None:
    """A shared module (the config file's reader, its sections) that imported a daemon
    would tie the daemons together: the exporter would load the remediator's modules."""
    graph = import_graph()
    shared = imported_by_the_daemons(graph)
    assert "gpuguard.config" in shared and "gpuguard.base.validation" in shared
    bad = sorted(f"{module} -> {dest}" for module in shared for dest in graph[module]
                 if under(dest, DAEMONS))
    assert bad == [], "shared modules import a daemon back:\n" + "\n".join(bad)


#: The classifier: gpuguard/orphans/ and the Windows table's rules, which live with the
#: Windows code (gpuguard/host/windows/tree.py) and are as pure as the rest.
CLASSIFIER = frozenset({"gpuguard.orphans", "gpuguard.host.windows.tree"})


def orphans_modules() -> dict[str, Path]:
    return {m: p for m, p in MODULES.items() if under(m, CLASSIFIER)}


def test_the_classifier_imports_only_its_allow_list() -> None:
    assert len(orphans_modules()) >= 2
    bad = []
    for module, path in orphans_modules().items():
        for line, imported, name in imports(path, module):
            if under(imported, {"gpuguard.orphans"}):
                continue
            allowed = CLASSIFY_ALLOWED.get(imported, frozenset())
            if imported not in CLASSIFY_ALLOWED or (allowed is not None and name not in allowed):
                bad.append(f"{module}:{line}: {imported}" + (f" ({name})" if name else ""))
    assert bad == [], "gpuguard/orphans/ is pure; not allowed:\n" + "\n".join(bad)


#: Pure modules besides the classifier: the decision (the kill policy, the tree, the reap
#: plan and pending-item records: the whole folder), and the settlement of a reap's result
#: (the worker and `gpuguard reap` share it; it must not pull the HTTP client in).
@pytest.mark.parametrize("pure", ["gpuguard.orphans", "gpuguard.host.windows.tree",
                                  "gpuguard.engine.decision",
                                  "gpuguard.engine.reap.settlement"])
def test_pure_modules_import_no_io(pure: str) -> None:
    bad = [f"{module}:{line}: {imported}" + (f" ({name})" if name else "")
           for module, path in MODULES.items() if under(module, {pure})
           for line, imported, name in imports(path, module)
           if under(imported, IO_MODULES) and not (
               imported in CLASSIFY_ALLOWED and name in (CLASSIFY_ALLOWED[imported] or ()))]
    assert bad == [], f"{pure} must not do I/O; it imports:\n" + "\n".join(bad)


class SizeReview(UserWarning):
    """A function, class or module inside the review band (REVIEW_LINES)."""


def sizes(text: str) -> Iterator[tuple[str, str, int, int]]:
    """(kind, name, first line, lines) for the module itself and each function and class
    in it, nested ones included, decorators not counted."""
    yield "module", "", 1, len(text.splitlines())
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            yield kind, node.name, node.lineno, (node.end_lineno or node.lineno) - node.lineno + 1


def measured(limits: dict[str, int]) -> list[str]:
    """Every function, class and module of the package at or over its limit in `limits`."""
    return [f"{module}:{line}: {kind} {name} of {size} lines".replace("  ", " ")
            for module, path in sorted(MODULES.items())
            for kind, name, line, size in sizes(path.read_text()) if size >= limits[kind]]


def test_sizes_count_each_definition_from_its_first_line_to_its_last(tmp_path: Path) -> None:
    text = ("@decorated\ndef f():\n    return 1\n\n\nclass C:\n    def m(self):\n"
            "        pass\n")
    assert list(sizes(text)) == [("module", "", 1, 8), ("function", "f", 2, 2),
                                 ("class", "C", 6, 3), ("function", "m", 7, 2)]


def test_no_function_class_or_module_past_its_wall() -> None:
    found = measured(WALL_LINES)
    assert found == [], f"at or past the wall {WALL_LINES}:\n" + "\n".join(found)


def test_what_lies_in_the_review_band_is_listed() -> None:
    """Not a failure: a list for the reviewer (`pytest -rw` shows it), so that a size is a
    question about the concept, and the code does not bend to stay under a number."""
    walled = set(measured(WALL_LINES))
    band = [entry for entry in measured(REVIEW_LINES) if entry not in walled]
    for entry in band:
        warnings.warn(SizeReview(f"{entry}: in the review band"), stacklevel=1)
    assert all(REVIEW_LINES[k] < WALL_LINES[k] for k in REVIEW_LINES)


def folder_modules() -> dict[Path, list[str]]:
    """Each package folder of gpuguard (through its links) and the modules in it, besides
    __init__ and __main__ (and the build's _version)."""
    found: dict[Path, list[str]] = {}
    for path in MODULES.values():
        if path.stem not in ("__init__", "__main__", "_version"):
            found.setdefault(path.parent, []).append(path.stem)
    return found


def test_no_package_folder_holds_more_than_its_share_of_modules() -> None:
    crowded = {str(folder.relative_to(REPO)): len(names)
               for folder, names in folder_modules().items() if len(names) > MAX_FOLDER_MODULES}
    assert crowded == {}, f"over {MAX_FOLDER_MODULES} modules: split them by job"
    assert len(folder_modules()[PACKAGE / "remediator"]) >= 5


def test_only_the_nvml_package_imports_pynvml() -> None:
    """NVML is read behind one lock, with every call counted (gpuguard/gpu/nvml/): a module
    elsewhere that called pynvml would race the scanner's read and cost unseen."""
    users = sorted({module for module, path in MODULES.items()
                    for _line, imported, _name in imports(path, module)
                    if under(imported, {"pynvml"})})
    assert users and all(under(m, {"gpuguard.gpu.nvml"}) for m in users), users


def test_every_own_import_is_under_the_gpuguard_namespace() -> None:
    """The wheel installs one top-level package, gpuguard: a bare `import exporter` works in
    the checkout (its folder is on sys.path) and fails, or finds someone else's, installed."""
    files = [p for top in ("exporter", "remediator", "gpuguard", "tests", "benchmarks")
             for p in sorted((REPO / top).rglob("*.py"))]
    bad = [f"{path.relative_to(REPO)}:{line}: {module}"
           for path in files for line, module, _name in imports(path)
           if under(module, {"exporter", "remediator"})]
    assert bad == [], "import gpuguard.exporter / gpuguard.remediator instead:\n" + "\n".join(bad)


@pytest.mark.parametrize("bare", ["exporter", "remediator"])
def test_a_daemon_folder_refuses_its_bare_import_name(bare: str) -> None:
    """With the checkout on sys.path, `import exporter` would load a second copy of every
    module (a second COUNTERS, a second metrics registry); it fails instead."""
    proc = subprocess.run([sys.executable, "-c", f"import {bare}"], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 1 and f"import gpuguard.{bare}, not {bare}" in proc.stderr
    ok = subprocess.run([sys.executable, "-c", f"import gpuguard.{bare}"], cwd=REPO,
                        capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert ok.returncode == 0, ok.stderr


def test_the_programs_code_is_where_its_import_path_says() -> None:
    """Tools that map an import name to a file (structure and duplicate checkers, coverage,
    go-to-definition) read gpuguard/exporter/x.py for gpuguard.exporter.x: the folders are
    real there, and the design card's top-level exporter/ and remediator/ link to them
    (docs/design.md, Where exporter/ and remediator/ live)."""
    for program in ("exporter", "remediator"):
        real = PACKAGE / program
        assert real.is_dir() and not real.is_symlink(), f"{real} must be the real folder"
        top = REPO / program
        assert top.is_symlink() and top.resolve() == real.resolve(), f"{top} -> {real}"
    symlinked = [str(p.relative_to(REPO)) for p in PACKAGE.iterdir()  # data folders may
                 if p.is_symlink() and any(p.glob("[!_]*.py"))]  # hold an __init__.py
    assert symlinked == [], "code reached through a link: its import path and file path differ"


#: The one module that spells gpuguard's words (verdicts, reasons, why a process is not
#: held); everywhere else names them through its enums.
VOCABULARY = PACKAGE / "orphans" / "vocabulary.py"
#: A name that holds a reason (or a verdict, an outcome, the signaller's why): what is
#: assigned to it, passed for it or defaults it is a word of the vocabulary.
REASON_HOLDER = re.compile(r"reason|why|verdict|outcome", re.IGNORECASE)


def _is_enum(node: ast.ClassDef) -> bool:
    return any(isinstance(base, ast.Name | ast.Attribute)
               and (base.id if isinstance(base, ast.Name) else base.attr).endswith("Enum")
               for base in node.bases)


def vocabulary_words(path: Path = VOCABULARY) -> dict[str, str]:
    """Each enum member of the vocabulary module by name, with its value (the first of a
    member's tuple). Rule numbers are left out: digits that flags, counts and files spell
    too, and a rule decides nothing outside the classifier."""
    words: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and _is_enum(node):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                    value = stmt.value.elts[0] if isinstance(stmt.value, ast.Tuple) else stmt.value
                    if (isinstance(value, ast.Constant) and isinstance(value.value, str)
                            and not value.value.isdigit()):
                        words[stmt.targets[0].id] = value.value
    return words


def _literals(node: ast.AST | None, values: set[str]) -> Iterator[ast.Constant]:
    """The vocabulary words `node` is, or holds as an element of a tuple, list or set
    (or frozenset(...)), or as a branch of `a if c else b` / `a or b`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in values:
        yield node
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for element in node.elts:
            yield from _literals(element, values)
    elif isinstance(node, ast.IfExp):
        yield from _literals(node.body, values)
        yield from _literals(node.orelse, values)
    elif isinstance(node, ast.BoolOp):
        for value in node.values:
            yield from _literals(value, values)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args
          and node.func.id in ("frozenset", "set", "tuple")):
        yield from _literals(node.args[0], values)


def _name(target: ast.AST) -> str:
    return (target.id if isinstance(target, ast.Name)
            else target.attr if isinstance(target, ast.Attribute) else "")


def _assigned(node: ast.Assign | ast.AnnAssign) -> Iterator[tuple[ast.AST, ast.AST]]:
    """(target, value) of an assignment, `a, b = x, y` paired element by element."""
    assert node.value is not None
    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
        if (isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                and len(target.elts) == len(node.value.elts)):
            yield from zip(target.elts, node.value.elts, strict=True)
        else:
            yield target, node.value


def vocabulary_literals(text: str, words: dict[str, str]) -> list[tuple[int, str, str]]:
    """(line, word, how) for each vocabulary word spelled as a bare string in `text` where
    it decides or records something: compared (`==`, `!=`, `in` a literal tuple or set, or
    `in` a name bound to one), assigned to or defaulting a reason holder (REASON_HOLDER),
    made a constant named like its member (`TREE_TOO_LARGE = "tree-too-large"`), passed
    to a call (positionally, or as a reason holder's keyword), returned, or a dict's
    value (or its key, with a word for value). Enum definitions, docstrings, f-string
    fragments and log text are not uses."""
    values = set(words.values())
    tree = ast.parse(text)
    enum_bodies = {id(stmt) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
                   and _is_enum(cls) for stmt in cls.body}
    found: list[tuple[ast.Constant, str]] = []
    collections: dict[str, list[ast.Constant]] = {}
    compared: set[str] = set()

    def add(node: ast.AST | None, how: str) -> None:
        found.extend((literal, how) for literal in _literals(node, values))

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                add(operand, "compared")
                if isinstance(operand, ast.Name):
                    compared.add(operand.id)
        elif (isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None
              and id(node) not in enum_bodies):
            for target, value in _assigned(node):
                name = _name(target)
                if REASON_HOLDER.search(name):
                    add(value, f"assigned to {name}")
                elif (isinstance(target, ast.Name) and isinstance(value, ast.Constant)
                      and words.get(name, ...) == value.value):
                    add(value, f"a second spelling of {name}")
                elif not isinstance(value, ast.Constant):
                    collections.setdefault(name, []).extend(_literals(value, values))
        elif isinstance(node, ast.Call):
            for arg in node.args:
                add(arg, "passed")
            for keyword in node.keywords:
                if keyword.arg and REASON_HOLDER.search(keyword.arg):
                    add(keyword.value, f"passed as {keyword.arg}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            defaults = [*zip(positional[len(positional) - len(args.defaults):], args.defaults,
                             strict=True), *zip(args.kwonlyargs, args.kw_defaults, strict=True)]
            for arg, default in defaults:
                if REASON_HOLDER.search(arg.arg):
                    add(default, f"the default of {arg.arg}")
        elif isinstance(node, ast.Return):
            add(node.value, "returned")
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                add(value, "a dict's value")
                if isinstance(value, ast.Constant):
                    add(key, "a dict's key")
    for name in compared:
        found.extend((literal, f"in {name}, compared") for literal in collections.get(name, ()))
    return sorted({(lit.lineno, lit.value, how) for lit, how in found})


def test_the_literal_finder_sees_each_use_and_no_mention() -> None:
    words = {"ROOT_GONE": "root-gone", "EXITED": "exited", "CANCELLED": "cancelled"}
    text = ('"""root-gone: a docstring"""\n'
            'if r.reason == "cancelled": log.info("root-gone %s", f"exited {x}")\n'
            'reason = "root-gone" if a else "x"\n'
            '_GONE = ("exited", "other")\n'
            'ok = why not in _GONE\n'
            'ROOT_GONE = "root-gone"\n'
            'Abort("root-gone", "detail")\n'
            'Decision(action, reason="cancelled")\n'
            'def f(outcome="cancelled"):\n    return "exited", "words"\n'
            'NAMES = {"exited": "gone for good", "k": "cancelled"}\n'
            'class E(StrEnum):\n    EXITED = "exited"\n'
            'user = name or "exited"\n')
    assert [(line, how) for line, _word, how in vocabulary_literals(text, words)] == [
        (2, "compared"), (3, "assigned to reason"), (4, "in _GONE, compared"),
        (6, "a second spelling of ROOT_GONE"), (7, "passed"), (8, "passed as reason"),
        (9, "the default of outcome"), (10, "returned"), (11, "a dict's value"),
        (11, "a dict's key")]


def test_no_vocabulary_literal_outside_the_vocabulary() -> None:
    """A reason spelled as a bare string decides a kill where mypy cannot see a typo:
    every module names it through the vocabulary's enums instead (docs/design.md,
    Layers). A word that means something else (a build's "unknown" version) is that
    concept's own constant, named for it."""
    words = vocabulary_words()
    assert {"orphan", "launcher-killed", "root-gone", "exited"} <= set(words.values())
    found = [f"{path.relative_to(REPO)}:{line}: {word!r} {how}"
             for path in sorted({p.resolve() for p in MODULES.values()})
             if path != VOCABULARY.resolve()
             for line, word, how in vocabulary_literals(path.read_text(), words)]
    assert found == [], (f"{len(found)} vocabulary word(s) spelled outside "
                         "gpuguard/orphans/vocabulary.py; name the enum member:\n"
                         + "\n".join(found))

#: The GPU seam (docs/design.md, "The GPU seam"): every vendor's package lies in it.
GPU_SEAM = "gpuguard.gpu"
#: The libraries a GPU vendor's package wraps (a second vendor adds its own).
VENDOR_LIBRARIES = frozenset({"pynvml", "amdsmi"})
#: The OS seam: the only code that may ask which operating system it runs on.
OS_SEAM = "gpuguard.host"


def vendor_packages() -> set[str]:
    """The package of each module that imports a vendor's library: the vendor packages."""
    return {module.rsplit(".", 1)[0] for module, path in MODULES.items()
            for _line, imported, _name in imports(path, module)
            if under(imported, VENDOR_LIBRARIES)}


def test_only_the_gpu_seam_imports_a_gpu_vendor_package() -> None:
    """A second GPU vendor has one place to go: each vendor's package lies in gpuguard/gpu/,
    and everything else reads GPUs through the seam (GpuSource, GpuReading, vendors.py),
    never naming a vendor's package."""
    vendors = vendor_packages()
    assert vendors and all(under(v, {GPU_SEAM}) for v in vendors), vendors
    bad = [f"{module}:{line}: {imported}" + (f".{name}" if name else "")
           for module, path in MODULES.items() if not under(module, {GPU_SEAM})
           for line, imported, name in imports(path, module)
           if under(f"{imported}.{name}" if name else imported, vendors)
           or under(imported, vendors)]
    assert bad == [], "a GPU vendor's package imported outside the GPU seam:\n" + "\n".join(bad)


def test_the_os_seam_never_imports_the_gpu_seam() -> None:
    """The GPU vendor is chosen apart from the OS: what the OS adds to a reading (Windows'
    WDDM memory) is a hook the Platform supplies and the GPU seam applies."""
    bad = [f"{module}:{line}: {imported}"
           for module, path in MODULES.items() if under(module, {OS_SEAM})
           for line, imported, _name in imports(path, module) if under(imported, {GPU_SEAM})]
    assert bad == [], "host/ imports gpu/:\n" + "\n".join(bad)


def process_table_branches(path: Path) -> Iterator[int]:
    """Lines that ask whether a platform has a process table: `.process_table` compared
    with None, or tested for truth."""
    def is_table(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "process_table"

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if (any(is_table(o) for o in operands)
                    and any(isinstance(o, ast.Constant) and o.value is None for o in operands)):
                yield node.lineno
        elif isinstance(node, ast.If | ast.IfExp | ast.While) and is_table(node.test):
            yield node.lineno
        elif isinstance(node, ast.BoolOp) and any(is_table(v) for v in node.values):
            yield node.lineno
        elif isinstance(node, ast.UnaryOp) and is_table(node.operand):
            yield node.lineno


def test_process_table_branches_are_found(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text("if p.process_table is None:\n    pass\nx = a if p.process_table else b\n"
                   "y = None != p.process_table\nz = p.process_table()\n")
    assert sorted(set(process_table_branches(src))) == [1, 3, 4]


def test_no_one_outside_the_os_seam_asks_whether_there_is_a_process_table() -> None:
    """"Is this Windows?" is the Platform's to answer with behaviour (Platform.processes:
    the caller hands what it does over /proc and over a table), never a caller's branch."""
    bad = [f"{path.relative_to(REPO)}:{line}"
           for module, path in MODULES.items() if not under(module, {OS_SEAM})
           for line in sorted(set(process_table_branches(path)))]
    assert bad == [], "branches on Platform.process_table outside gpuguard/host:\n" + "\n".join(
        bad)


def os_questions(path: Path) -> list[int]:
    """Lines that compare which operating system this is: `sys.platform`, `os.name`,
    `platform.system()`, or anything compared with the back-ends' names LINUX/WINDOWS."""
    def asks(node: ast.expr) -> bool:
        text = ast.unparse(node)
        return text in {"sys.platform", "os.name", "platform.system()"} or \
            (isinstance(node, ast.Name) and node.id in {"LINUX", "WINDOWS"})
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Compare)
            and any(asks(side) for side in (node.left, *node.comparators))]


def test_os_questions_are_found(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("if sys.platform == 'win32':\n    pass\nx = os.name != 'nt'\n"
                   "y = PLATFORM.name == WINDOWS\nz = platform.system()\n")
    assert os_questions(src) == [1, 3, 4]


def test_no_one_outside_the_os_seam_asks_which_os_it_runs_on() -> None:
    """Only gpuguard/host/ (and gpuguard/__init__.py, which reads the parent pid before
    anything is imported) compares which OS this is; everything else asks the Platform
    for behaviour."""
    bad = [f"{path.relative_to(REPO)}:{line}"
           for module, path in MODULES.items()
           if not under(module, {OS_SEAM}) and module != "gpuguard"
           for line in os_questions(path)]
    assert bad == [], "asks which OS it runs on outside gpuguard/host:\n" + "\n".join(bad)



def folder_of(module: str) -> str:
    """The package folder a module's file lies in, as a path from the repository root
    (gpuguard/exporter for gpuguard.exporter.cli, through the links)."""
    return str(MODULES[module].parent.relative_to(REPO))


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folder -> the other folders its modules import."""
    folders: dict[str, set[str]] = {folder_of(m): set() for m in graph}
    for module, dests in graph.items():
        for dest in dests:
            if folder_of(dest) != folder_of(module):
                folders[folder_of(module)].add(folder_of(dest))
    return folders


def test_the_folder_graph_sees_a_cycle_through_a_parent_and_its_child() -> None:
    graph = {"gpuguard.gpu.vendors": {"gpuguard.gpu.nvml.reader"},
             "gpuguard.gpu.nvml.reader": {"gpuguard.gpu.reading"}, "gpuguard.gpu.reading": set()}
    assert folder_graph(graph) == {"gpuguard/gpu/vendors": {"gpuguard/gpu/nvml"},
                                   "gpuguard/gpu/nvml": {"gpuguard/gpu"}, "gpuguard/gpu": set()}
    assert cycles({"gpuguard/gpu": {"gpuguard/gpu/nvml"},
                   "gpuguard/gpu/nvml": {"gpuguard/gpu"}}) != []


def test_no_import_cycle_between_folders() -> None:
    """A folder is a unit a reader takes in whole: when two folders import each other
    (a parent and its child included), neither can be read, changed or moved alone. Where a
    folder must choose among its children (the platform, the GPU vendor, the console's
    subcommands), the choosing module lives in a child of its own (host/platform/,
    gpu/vendors/, console/cli/)."""
    found = cycles(folder_graph(import_graph()))
    assert found == [], "folders that import each other:\n" + "\n".join(
        " <-> ".join(c) for c in found)


#: The layers, bottom first (docs/design.md, Layers), by folder: a module imports from its
#: own layer or a lower one. The package root holds only what the launcher reads first
#: (__init__), the shipped assets and `python -m gpuguard`, which imports nothing.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("gpuguard", "gpuguard/base")),
    ("pure core", ("gpuguard/orphans",)),
    ("OS seam", ("gpuguard/host",)),
    ("GPU seam", ("gpuguard/gpu",)),
    ("shared", ("gpuguard/config", "gpuguard/web")),
    ("engine", ("gpuguard/engine", "gpuguard/launch")),
    ("programs", ("gpuguard/exporter", "gpuguard/remediator", "gpuguard/console")),
)


def layer_of(folder: str) -> int:
    """The index in LAYERS of a folder: the longest prefix that names it (the package
    root only itself)."""
    best = (-1, -1)
    for rank, (_name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if folder == prefix or (prefix != "gpuguard" and folder.startswith(prefix + "/")):
                best = max(best, (len(prefix), rank))
    assert best[1] >= 0, f"{folder} is in no layer: add it to LAYERS"
    return best[1]


def test_every_folder_has_a_layer_and_imports_only_down() -> None:
    graph = import_graph()
    bad = sorted(f"{module} ({LAYERS[layer_of(folder_of(module))][0]}) -> {dest} "
                 f"({LAYERS[layer_of(folder_of(dest))][0]})"
                 for module, dests in graph.items() for dest in dests
                 if layer_of(folder_of(dest)) > layer_of(folder_of(module)))
    assert bad == [], "imports that point up a layer:\n" + "\n".join(bad)


#: Where Windows code lives (issue 51): the OS seam's Windows back-end and the engine's
#: Windows half (its reaper, inspection and launcher, built on engine/reap/ and
#: engine/decision/).
WINDOWS_FOLDERS = frozenset({"gpuguard.host.windows", "gpuguard.engine.windows"})
#: The Windows rules: pure, judged by the scan and `gpuguard explain` over a table that
#: Platform.processes hands them (no Windows API in them).
WINDOWS_RULES = "gpuguard.host.windows.tree"
#: The tables that name each platform's back-end, one entry per platform: the OS seam's,
#: the engine's, and `gpuguard run`'s launchers (console/run.py's LAUNCHERS).
PLATFORM_TABLES = frozenset({"gpuguard.host.platform", "gpuguard.engine.platforms",
                             "gpuguard.console.run"})
#: What lies below gpuguard/engine/windows/ (it builds on them): none may import it.
BELOW_ENGINE_WINDOWS = frozenset({
    "gpuguard.engine.decision", "gpuguard.engine.reap", "gpuguard.engine.state",
    "gpuguard.engine.scan", "gpuguard.host", "gpuguard.orphans", "gpuguard.launch"})


def _loads(module: str, imported: str, name: str | None) -> str:
    return target(imported, name) or imported


def test_windows_code_lives_in_two_folders() -> None:
    """A module named for Windows, or one that uses Windows' back-end (handles, Job
    Objects, the psutil table, the DLLs), lies in gpuguard/host/windows/ or
    gpuguard/engine/windows/; elsewhere only the platform tables name it."""
    named = [m for m, path in MODULES.items()
             if "windows" in path.stem and not under(m, WINDOWS_FOLDERS)]
    assert named == [], f"modules named for Windows outside {sorted(WINDOWS_FOLDERS)}"
    users = sorted(f"{module}:{line}: {dest}"
                   for module, path in MODULES.items()
                   if not under(module, WINDOWS_FOLDERS) and module not in PLATFORM_TABLES
                   for line, imported, name in imports(path, module)
                   if under(dest := _loads(module, imported, name), WINDOWS_FOLDERS)
                   and dest != WINDOWS_RULES)
    assert users == [], "Windows' back-end used outside its two folders:\n" + "\n".join(users)


def test_nothing_below_the_engines_windows_half_imports_it() -> None:
    """gpuguard/engine/windows/ builds on engine/reap/ and engine/decision/: their
    folders, and those below them, importing it back would be a cycle between folders.
    The platform's choice is gpuguard/engine/platforms.py's, which only the programs
    import; what lies below is handed what it needs (a reaper, protected pids, the
    recheck's inspection)."""
    assert any(under(m, {"gpuguard.engine.windows"}) for m in MODULES)
    bad = sorted(f"{module}:{line}: {dest}"
                 for module, path in MODULES.items()
                 if under(module, BELOW_ENGINE_WINDOWS) and not under(module, WINDOWS_FOLDERS)
                 for line, imported, name in imports(path, module)
                 if (dest := _loads(module, imported, name)) == "gpuguard.engine.platforms"
                 or under(dest, {"gpuguard.engine.windows"}))
    assert bad == [], "imports the engine's Windows half from below:\n" + "\n".join(bad)
    importers = sorted({module for module, path in MODULES.items()
                        for _line, imported, name in imports(path, module)
                        if _loads(module, imported, name) == "gpuguard.engine.platforms"})
    assert importers and all(program_of(m) is not None for m in importers), importers


#: The Linux back-end's own modules: /proc, the kernel's process events, fd search,
#: descriptor limits, registrations and POSIX permissions (Platform's Linux record).
LINUX_ONLY = frozenset({
    "gpuguard.host.procfs", "gpuguard.host.events", "gpuguard.host.platform.linux",
    "gpuguard.host.fdsearch", "gpuguard.host.descriptors", "gpuguard.host.registrar",
    "gpuguard.host.permissions"})


def test_the_os_back_ends_never_import_each_other() -> None:
    """Windows' code asks nothing of Linux's /proc reader or its process events (what
    both need, RUN_MARKER and the ExitSource interface, is host/backend.py's), and
    Linux's modules never import Windows'; each is reached only through the seam."""
    assert all(m in MODULES or any(x.startswith(m + ".") for x in MODULES) for m in LINUX_ONLY)
    windows_to_linux = sorted(
        f"{module}:{line}: {dest}" for module, path in MODULES.items()
        if under(module, WINDOWS_FOLDERS)
        for line, imported, name in imports(path, module)
        if under(dest := _loads(module, imported, name), LINUX_ONLY))
    linux_to_windows = sorted(
        f"{module}:{line}: {dest}" for module, path in MODULES.items()
        if under(module, LINUX_ONLY)
        for line, imported, name in imports(path, module)
        if under(dest := _loads(module, imported, name), WINDOWS_FOLDERS))
    assert windows_to_linux == [] and linux_to_windows == [], (
        "one OS back-end imports the other's:\n" + "\n".join(windows_to_linux + linux_to_windows))
