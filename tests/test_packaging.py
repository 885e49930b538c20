"""Each package builds a wheel on its own, inside the titan namespace, with only its own deps."""

import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["titan-dist", "titan-models", "titan-ckpt", "titan-train", "titan-rl"]
# What each distribution may require at install time (docs/design.md's "may import" column).
ALLOWED_REQUIREMENTS = {
    "titan-dist": {"torch"},
    "titan-models": {"torch", "safetensors"},
    "titan-ckpt": {"torch", "safetensors"},
    "titan-train": {"torch", "titan-dist", "titan-ckpt", "tyro", "datasets", "tokenizers", "numpy", "tqdm"},
    "titan-rl": {"torch", "titan-train", "titan-models"},
}


def build_wheel(project: Path, outdir: Path) -> Path:
    # --no-isolation: use the installed hatchling, so the build needs no network.
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(outdir), str(project)],
        check=True,
        capture_output=True,
    )
    (wheel,) = outdir.glob("*.whl")
    return wheel


def runtime_requirements(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
    names = set()
    for req in meta.get_all("Requires-Dist") or []:
        if "extra ==" in req:
            continue
        names.add(req.split(";")[0].split("@")[0].split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip())
    return names


@pytest.mark.slow
@pytest.mark.parametrize("package", PACKAGES)
def test_package_builds_alone_with_only_its_own_requirements(package, tmp_path):
    wheel = build_wheel(ROOT / "packages" / package, tmp_path)
    name = package.split("-")[1]
    with zipfile.ZipFile(wheel) as zf:
        files = zf.namelist()
    assert f"titan/{name}/__init__.py" in files
    assert "titan/__init__.py" not in files, "titan must stay a PEP 420 namespace"
    assert not [f for f in files if f.startswith("titan/") and not f.startswith(f"titan/{name}/")]
    assert runtime_requirements(wheel) <= ALLOWED_REQUIREMENTS[package]
