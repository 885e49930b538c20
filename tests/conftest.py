"""Fixtures of the end-to-end tests: launches of several `titan train` runs in one process
group, shared by every test that reads them.

Starting the interpreter, importing torch and rendezvousing a torchrun job cost ~10 s of CPU
per launch, far more than training the tiny test models for a few steps. So the runs of one
world size that several tests read are declared together, launched once per test session (in
one process group, one run after another: ``train_runs_worker.py``), and each test reads its
run's dump folder. Tests that share a launch carry the same ``xdist_group`` mark, so
pytest-xdist (``--dist loadgroup``, as ``make test`` runs it) hands them to one worker, which
launches once and reads many times, instead of a second worker waiting on the first one's launch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the launch helpers (--import-mode=importlib)

from launching import launch_train_runs  # noqa: E402


@pytest.fixture(scope="session")
def train_group(build_once) -> Callable[[str, int, dict[str, list[str]]], Path]:
    """``train_group(group, ranks, runs)``: every run of ``runs`` (name -> `titan train` flags)
    in one launch of ``ranks`` processes, once per session; returns the folder holding one dump
    folder per run name. Every caller of one ``group`` must pass the same runs."""

    def launch(group: str, ranks: int, runs: dict[str, list[str]]) -> Path:
        def build(folder: Path) -> None:
            named = [(name, [*flags, "--job.dump_folder", str(folder / name)]) for name, flags in runs.items()]
            launch_train_runs(ranks, named, folder / "launch.log")

        return build_once(group, build)

    return launch
