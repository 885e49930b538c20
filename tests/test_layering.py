"""The import-layering contract of docs/design.md, enforced with import-linter.

The contracts live in the root pyproject.toml. One test checks the real tree; another plants
an upward import in a copy of the tree and checks that the contract catches it, so the
contract is known to be able to fail.
"""

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = [ROOT / "src"] + sorted((ROOT / "packages").glob("*/src"))


def run_lint_imports(source_roots: list[Path], config: Path) -> subprocess.CompletedProcess:
    # -S: skip site, so the editable installs' .pth files do not put the real tree on the path;
    # site-packages itself is added by hand for import-linter and grimp.
    code = (
        "import sys; "
        f"sys.path[:0] = {[str(p) for p in source_roots]!r}; "
        f"sys.path.append({sysconfig.get_paths()['purelib']!r}); "
        "from importlinter.cli import lint_imports_command; "
        f"sys.argv = ['lint-imports', '--config', {str(config)!r}, '--no-cache']; "
        "lint_imports_command()"
    )
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=config.parent)


def test_tree_keeps_the_layering_contract():
    result = run_lint_imports(SOURCE_ROOTS, ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def copy_of_the_tree(tmp_path: Path) -> list[Path]:
    """The source roots copied under ``tmp_path`` (to plant a defect in); their new paths."""
    copies = []
    for src in SOURCE_ROOTS:
        dest = tmp_path / src.relative_to(ROOT)
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
        copies.append(dest)
    return copies


def test_an_upward_import_breaks_the_contract(tmp_path):
    copies = copy_of_the_tree(tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    planted = tmp_path / "packages/titan-dist/src/titan/dist/_planted.py"
    planted.write_text("import titan.train.trainer  # an upward import\n")
    result = run_lint_imports(copies, tmp_path / "pyproject.toml")
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and "titan.dist" in result.stdout


# Strongly connected components of titan's module graph (grimp, which import-linter builds
# on), run like lint-imports on the given source roots only; prints the cycles as JSON.
_CYCLES = """
import json, grimp
graph = grimp.build_graph("titan", cache_dir=None)
edges = {m: {x for x in graph.find_modules_directly_imported_by(m) if x.startswith("titan.")}
         for m in graph.modules if m.startswith("titan.")}
index, low, stack, on_stack, cycles = {}, {}, [], set(), []
def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v); on_stack.add(v)
    for w in sorted(edges.get(v, ())):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on_stack:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        component = []
        while True:
            w = stack.pop(); on_stack.discard(w); component.append(w)
            if w == v:
                break
        if len(component) > 1:
            cycles.append(sorted(component))
for module in sorted(edges):
    if module not in index:
        visit(module)
print(json.dumps(cycles))
"""


def import_cycles(source_roots: list[Path]) -> list[list[str]]:
    """The groups of titan modules that import each other in a cycle (lazy imports inside
    functions count: they are cycles too, only deferred)."""
    code = (f"import sys; sys.path[:0] = {[str(p) for p in source_roots]!r}; "
            f"sys.path.append({sysconfig.get_paths()['purelib']!r}); sys.setrecursionlimit(10000)\n" + _CYCLES)
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def test_no_module_imports_in_a_cycle():
    assert import_cycles(SOURCE_ROOTS) == []


def test_a_planted_cycle_is_found(tmp_path):
    copies = copy_of_the_tree(tmp_path)
    data = tmp_path / "packages/titan-train/src/titan/train/data"
    (data / "_planted_a.py").write_text("def f():\n    from titan.train.data import _planted_b  # lazy, still a cycle\n")
    (data / "_planted_b.py").write_text("from titan.train.data import _planted_a\n")
    assert import_cycles(copies) == [["titan.train.data._planted_a", "titan.train.data._planted_b"]]


def test_titan_is_a_namespace_package():
    for src in SOURCE_ROOTS:
        assert not (src / "titan" / "__init__.py").exists(), f"{src}/titan/__init__.py breaks PEP 420"
