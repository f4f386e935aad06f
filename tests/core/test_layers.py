"""The layering (issue #16): no upward arrow, no circle.

The contracts are import-linter's, in pyproject.toml ([tool.importlinter]):
the core (``star`` but ``star.cli``) imports no adapter, no ``benchmarks``
and not ``star.cli``; the adapters import no ``benchmarks``; the modules of
each package import each other without cycles. ``star.cli`` (the composition
root) and ``benchmarks`` may import everything but ``star.cli``: nothing
outside ``star.cli`` imports it (the fleet library is ``star.fleet``), and
the tests import it only to test the CLI (``star.cli.main`` anywhere, a
command's own module in a CLI test). On top of import-linter, no two modules
anywhere may import each other, directly or through others.

Imports inside functions and under ``if TYPE_CHECKING:`` count: a lazy or a
type-only import is still an arrow in the design.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("star", "workers", "scheduler", "proxy", "benchmarks")
# lint-imports, by its Python API (a console script may not be on PATH).
LINT = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
)


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def test_import_linter_contracts_are_kept() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LINT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_core_contract_lists_every_module_of_star_but_cli() -> None:
    # A new module of star must be added to the contract, or it escapes it.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (core,) = (c for c in config["contracts"] if c["id"] == "core")
    children = {m for m in _graph().find_children("star") if m != "star.cli"}
    assert set(core["source_modules"]) == children


def _cli_imports(path: Path) -> set[str]:
    """The ``star.cli`` modules a file imports (``from star.cli import up`` names star.cli.up)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in ("star", "star.cli"):
                out.update(f"{node.module}.{a.name}" for a in node.names)
            else:
                out.add(node.module)
    return {m for m in out if m == "star.cli" or m.startswith("star.cli.")}


def test_tests_import_star_cli_only_to_test_the_cli() -> None:
    # The fleet, a manual decision, an argparse type: the library (star.fleet,
    # star.planner), never a command's module; star.cli.main is the CLI itself.
    tests = ROOT / "tests"
    wrong = {}
    for path in sorted(tests.rglob("*.py")):
        is_cli_test = path.parent.name == "cli" or "cli" in path.stem
        names = {m for m in _cli_imports(path) if m != "star.cli.main"}
        if names and not is_cli_test:
            wrong[str(path.relative_to(ROOT))] = sorted(names)
    assert wrong == {}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        scc.append(m)
                        if m == node:
                            break
                    if len(scc) > 1:
                        out.append(sorted(scc))
    return out


def test_cycles_finds_a_circle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_two_modules_import_each_other() -> None:
    graph = _graph()
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(edges) == []
