"""The import-layering contract of docs/design.md, enforced with import-linter.

The contracts live in the root pyproject.toml. One test checks the real tree; another plants
an upward import in a copy of the tree and checks that the contract catches it, so the
contract is known to be able to fail.
"""

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


def test_an_upward_import_breaks_the_contract(tmp_path):
    copies = []
    for src in SOURCE_ROOTS:
        dest = tmp_path / src.relative_to(ROOT)
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
        copies.append(dest)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    planted = tmp_path / "packages/titan-dist/src/titan/dist/_planted.py"
    planted.write_text("import titan.train.trainer  # an upward import\n")
    result = run_lint_imports(copies, tmp_path / "pyproject.toml")
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and "titan.dist" in result.stdout


def test_titan_is_a_namespace_package():
    for src in SOURCE_ROOTS:
        assert not (src / "titan" / "__init__.py").exists(), f"{src}/titan/__init__.py breaks PEP 420"
