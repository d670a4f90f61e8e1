"""The house rules of samepath/ (docs/architecture.md), checked on the source with ``ast`` only.

Rooms, bottom to top: kernels < distributed < models < audit < integrations < rl < check; the
package's ``__init__`` / ``__main__`` stand above them all. A module imports only its own room or
rooms below it, and no import chain between rooms goes round in a circle. Every import counts:
module level, inside functions (deferred), under ``if TYPE_CHECKING``, and
``importlib.import_module("samepath...")`` with a literal name. Inside samepath/ no module imports
a private name (``_x``, not a dunder) of another module, whether as ``from samepath.m import _x``,
``import samepath._m`` from outside ``_m``'s package, or ``m._x`` on an imported module. No module is
longer than :data:`MAX_LINES` lines. Within one room, import cycles between modules are reported
(:func:`module_cycles`) and fail the test too.

Run ``python tests/test_architecture.py`` to print every violation; the test's failure message
lists them the same way: ``path:line: [rule] message``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "samepath"
MAX_LINES = 800

# (room, module prefixes) bottom to top; a module belongs to the room of its longest matching prefix.
# samepath.ascendc_fallback is the Ascend C backend of attention (its kernels live in
# samepath/kernels/attention/ascendc/); ``python -m samepath.ascendc_fallback build`` stays public.
ROOMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("version", ("samepath.version",)),  # __version__ only: a leaf
    ("kernels", ("samepath.kernels", "samepath.ascendc_fallback")),
    ("distributed", ("samepath.distributed",)),
    ("models", ("samepath.models",)),
    ("audit", ("samepath.audit",)),
    ("integrations", ("samepath.integrations",)),
    ("rl", ("samepath.rl",)),
    ("check", ("samepath.check",)),
    ("top", ("samepath", "samepath.__main__")),  # the package itself: may import anything
)

# Modules allowed over MAX_LINES, each with its reason: only generated or vendored files qualify.
LONG_MODULES: dict[str, str] = {}


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}"


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    lines: int
    # (target module, line, deferred) for every import of a module of the package
    imports: list[tuple[str, int, bool]] = field(default_factory=list)


def _module_name(root: Path, path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def load_package(root: Path, package: str = PACKAGE) -> dict[str, Module]:
    """Every module under ``root / package``, parsed, keyed by its dotted name."""
    modules: dict[str, Module] = {}
    for path in sorted((root / package).rglob("*.py")):
        name, is_package = _module_name(root, path)
        text = path.read_text(encoding="utf-8")
        modules[name] = Module(name, path, is_package, ast.parse(text, str(path)), text.count("\n") + 1)
    return modules


def room_of(module: str, rooms=ROOMS) -> tuple[int, str] | None:
    best: tuple[int, int, str] | None = None
    for rank, (room, prefixes) in enumerate(rooms):
        for prefix in prefixes:
            if module == prefix or (module.startswith(prefix + ".") and prefix != PACKAGE):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), rank, room)
    return None if best is None else (best[1], best[2])


def _resolve_relative(module: Module, level: int, name: str | None) -> str:
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


class _Imports(ast.NodeVisitor):
    """Collects a module's imports of the package and its private-name uses."""

    def __init__(self, module: Module, modules: dict[str, Module], package: str) -> None:
        self.module = module
        self.modules = modules
        self.package = package
        self.depth = 0  # > 0 inside a function: a deferred import
        self.scopes: list[dict[str, str]] = [{}]  # name -> module it is bound to
        self.private: list[tuple[int, str]] = []

    # --- scopes -----------------------------------------------------------------------------
    def _bind(self, name: str, target: str) -> None:
        self.scopes[-1][name] = target

    def _lookup(self, name: str) -> str | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.scopes.append({})
        self.generic_visit(node)
        self.scopes.pop()
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    # --- imports ----------------------------------------------------------------------------
    def _ours(self, name: str) -> bool:
        return name == self.package or name.startswith(self.package + ".")

    def _add(self, target: str, line: int) -> None:
        entry = (target, line, self.depth > 0)
        if entry not in self.module.imports:  # ``from m import a, b``: one import of m
            self.module.imports.append(entry)

    def _check_private_module(self, target: str, line: int) -> None:
        """``_m`` in ``a.b._m`` is private to package ``a.b``: importing it from outside is not allowed."""
        parts = target.split(".")
        for i, part in enumerate(parts):
            if part.startswith("_") and not part.startswith("__"):
                owner = ".".join(parts[:i])  # the package the private module belongs to
                here = self.module.name
                if not (here == owner or here.startswith(owner + ".")):
                    self.private.append((line, f"imports private module {'.'.join(parts[: i + 1])}"))
                return

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if not self._ours(alias.name):
                continue
            self._add(alias.name, node.lineno)
            self._check_private_module(alias.name, node.lineno)
            if alias.asname:
                self._bind(alias.asname, alias.name)
            else:
                self._bind(alias.name.split(".")[0], alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            source = _resolve_relative(self.module, node.level, node.module)
        else:
            source = node.module or ""
        if not self._ours(source):
            return
        self._check_private_module(source, node.lineno)
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            if submodule in self.modules:  # ``from package import submodule``
                self._add(submodule, node.lineno)
                self._check_private_module(submodule, node.lineno)
                self._bind(alias.asname or alias.name, submodule)
                continue
            self._add(source, node.lineno)
            if alias.name.startswith("_") and not alias.name.startswith("__") and source != self.module.name:
                self.private.append((node.lineno, f"imports private name {alias.name} from {source}"))

    def _import_module_call(self, node: ast.AST) -> str | None:
        """``importlib.import_module("samepath.x")`` / ``import_module(...)`` / ``__import__(...)``."""
        if not isinstance(node, ast.Call) or not node.args:
            return None
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if called not in ("import_module", "__import__"):
            return None
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and self._ours(arg.value):
            return arg.value
        return None

    def visit_Call(self, node: ast.Call) -> None:
        target = self._import_module_call(node)
        if target is not None:
            self._add(target, node.lineno)
            self._check_private_module(target, node.lineno)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        target = self._import_module_call(node.value)
        if target is not None:
            for name in node.targets:
                if isinstance(name, ast.Name):
                    self._bind(name.id, target)
        self.generic_visit(node)

    # --- module._private --------------------------------------------------------------------
    def _dotted_module(self, node: ast.AST) -> str | None:
        """The package module an expression names (``matmul``, ``samepath.kernels.matmul``), if any."""
        if isinstance(node, ast.Name):
            return self._lookup(node.id)
        if isinstance(node, ast.Attribute):
            base = self._dotted_module(node.value)
            if base is not None and f"{base}.{node.attr}" in self.modules:
                return f"{base}.{node.attr}"
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = self._dotted_module(node.value)
            if owner is not None and owner != self.module.name and f"{owner}.{node.attr}" not in self.modules:
                self.private.append((node.lineno, f"uses private name {owner}.{node.attr}"))
        self.generic_visit(node)


def _target_module(target: str, modules: dict[str, Module]) -> str:
    """The module an import runs: the longest prefix of ``target`` that is a module of the package."""
    parts = target.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or target


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one node (or a self loop), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return found


def _edge_line(modules: dict[str, Module], source: str, target: str, resolve) -> int:
    return min(line for t, line, _ in modules[source].imports if resolve(t) == target)


def check(root: Path = REPO, package: str = PACKAGE, rooms=ROOMS, max_lines: int = MAX_LINES) -> list[Violation]:
    """Every violation of the rules in ``root / package``, sorted by file and line."""
    modules = load_package(root, package)
    found: list[Violation] = []

    def rel(module: str) -> str:
        return modules[module].path.relative_to(root).as_posix()

    def resolve(target: str) -> str:
        return _target_module(target, modules)

    for name, module in modules.items():
        visitor = _Imports(module, modules, package)
        visitor.visit(module.tree)
        for line, message in visitor.private:
            found.append(Violation(rel(name), line, "private-import", message))
        if module.lines - 1 > max_lines and name not in LONG_MODULES:
            found.append(
                Violation(rel(name), 1, "module-size", f"{name} is {module.lines - 1} lines (at most {max_lines})")
            )
        if room_of(name, rooms) is None:
            found.append(Violation(rel(name), 1, "room", f"{name} is in no room: add it to ROOMS"))

    # rooms: no import goes upward; the room graph has no cycle (a cycle needs an upward edge, so
    # the upward check finds every one; the message names the room the import reaches up to)
    for name, module in modules.items():
        here = room_of(name, rooms)
        if here is None:
            continue
        for target, line, deferred in module.imports:
            there = room_of(resolve(target), rooms)
            if there is None or there[0] <= here[0]:
                continue
            how = "deferred import" if deferred else "import"
            found.append(
                Violation(
                    rel(name),
                    line,
                    "room-upward",
                    f"{how} of {target} goes up from room {here[1]} to room {there[1]}",
                )
            )

    # modules in one room: no import cycle (deferred imports counted)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, module in modules.items():
        for target, _line, _deferred in module.imports:
            target = resolve(target)
            if target in modules and target != name and room_of(target, rooms) == room_of(name, rooms):
                graph[name].add(target)
    for component in _strongly_connected(graph):
        members = set(component)
        first = component[0]
        nxt = min(t for t in graph[first] if t in members)
        line = _edge_line(modules, first, nxt, resolve)
        found.append(
            Violation(rel(first), line, "module-cycle", f"import cycle between modules: {', '.join(component)}")
        )
    return sorted(found, key=lambda v: (v.path, v.line, v.rule, v.message))


def report(violations: list[Violation]) -> str:
    return "\n".join(str(v) for v in violations)


# --- tests ----------------------------------------------------------------------------------------


def test_the_package_keeps_the_house_rules() -> None:
    violations = check()
    assert not violations, f"{len(violations)} violations of docs/architecture.md:\n{report(violations)}"


def test_every_long_module_allowance_names_an_existing_module() -> None:
    modules = load_package(REPO)
    for name, reason in LONG_MODULES.items():
        assert name in modules and reason.strip(), name


def _write(root: Path, files: dict[str, str]) -> None:
    for rel_path, text in files.items():
        path = root / rel_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checker_reports_each_rule_on_a_synthetic_package(tmp_path: Path) -> None:
    """Negative control: a tiny package with one of each violation; the checker names each."""
    _write(
        tmp_path,
        {
            "samepath/__init__.py": "from samepath import check\n",
            "samepath/kernels/__init__.py": "",
            "samepath/kernels/a.py": (
                "import samepath.kernels.b\n"  # a <-> b: a module cycle inside the room
                "def f():\n"
                "    from samepath.integrations import hf\n"  # deferred, upward
                "    return hf\n"
            ),
            "samepath/kernels/b.py": (
                "from samepath.kernels import a\n"
                "import importlib\n"
                "F = importlib.import_module('samepath.check.cli')\n"  # string import, upward
                "def _helper():\n    pass\n"
            ),
            "samepath/kernels/c.py": "x = 1\n" * 801,  # too long
            "samepath/integrations/__init__.py": "",
            "samepath/integrations/hf.py": (
                "from samepath.kernels.b import _helper\n"  # private name
                "from samepath.kernels import b\n"
                "def g():\n"
                "    return b._helper\n"  # private attribute of an imported module
                "from ..check import cli\n"  # relative, upward: a room cycle with check -> integrations
            ),
            "samepath/check/__init__.py": "",
            "samepath/check/cli.py": "from samepath.integrations import hf\nfrom samepath.integrations.hf import g\n",
            "samepath/stray.py": "",
        },
    )
    found = {(v.path, v.line, v.rule) for v in check(tmp_path)}
    text = report(check(tmp_path))
    expected = {
        ("samepath/kernels/a.py", 1, "module-cycle"),
        ("samepath/kernels/a.py", 3, "room-upward"),
        ("samepath/kernels/b.py", 3, "room-upward"),
        ("samepath/kernels/c.py", 1, "module-size"),
        ("samepath/integrations/hf.py", 1, "private-import"),
        ("samepath/integrations/hf.py", 4, "private-import"),
        ("samepath/integrations/hf.py", 5, "room-upward"),
        ("samepath/stray.py", 1, "room"),
    }
    assert found == expected, text
    assert "deferred import of samepath.integrations.hf goes up from room kernels to room integrations" in text
    assert "samepath.kernels.b._helper" in text
    # the top of the house may import anything; check -> integrations goes down: neither is reported
    assert not any(v.path in ("samepath/__init__.py", "samepath/check/cli.py") for v in check(tmp_path))


def test_private_modules_are_private_to_their_package(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "samepath/__init__.py": "",
            "samepath/integrations/__init__.py": "from samepath.integrations import _common\n",
            "samepath/integrations/_common.py": "",
            "samepath/integrations/hf.py": "from . import _common\n",
            "samepath/check/__init__.py": "",
            "samepath/check/cli.py": "import samepath.integrations._common as c\n",
        },
    )
    found = [(v.path, v.rule) for v in check(tmp_path)]
    assert found == [("samepath/check/cli.py", "private-import")], report(check(tmp_path))


if __name__ == "__main__":
    violations = check()
    print(report(violations) or "no violations")
    sys.exit(1 if violations else 0)
