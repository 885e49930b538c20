"""Session-wide test isolation for every test path of the repository.

The suite must never read or write machine-wide state. Two settings go into ``os.environ``
before any test runs, so the ``titan`` subprocesses the tests start inherit them too:

- ``TITAN_CACHE_DIR``: a fresh temporary folder per pytest process (each pytest-xdist worker
  makes its own), so the CPU peak cache in the user's cache folder is never touched.
- ``TITAN_CPU_PEAK_FLOPS``: a fixed, known CPU peak, so no test measures the peak while the
  suite itself loads the machine (a peak measured under load reads low and MFU high). Tests of
  the measurement and the cache unset it explicitly.
- ``MPLCONFIGDIR``: matplotlib's font cache, inside that temporary folder.
- ``VLLM_CACHE_ROOT``: vLLM's cache (compiled graphs, plugin state), inside it too.
- ``TORCHINDUCTOR_CACHE_DIR``: compiled kernels go to a folder of this test run (made by the
  pytest-xdist controller, inherited by its workers, so one cold compile serves the whole run)
  instead of the machine-wide default under the system temp folder.
- ``OMP_NUM_THREADS`` (and torch's intra-op threads in the test process): the machine's cores
  divided among the pytest-xdist workers. Each worker, and each single-process ``titan`` run it
  starts, would otherwise use every core: with 2 workers on 2 cores that is 4 spinning OpenMP
  threads on 2 cores, and a 10 s training run took 145 s. Multi-rank launches still give each
  rank one thread.
"""

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock

# The suite's shared test helpers (tests/forked_cli.py: one-process `titan` runs without the
# start-up imports), importable from every test folder, packages' included.
sys.path.insert(0, str(Path(__file__).parent / "tests"))

# Far above what the suite's tiny models reach on any CPU: MFU stays a small, valid percentage.
SUITE_CPU_PEAK_FLOPS = "1e13"

_cache_dir: str | None = None
_inductor_dir: str | None = None
_RUN_MARK = "TITAN_TEST_RUN_INDUCTOR_DIR"


def _cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_worker() -> int:
    """The cores divided among the pytest-xdist workers (all of them without xdist)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, _cores() // max(1, workers))


def pytest_configure(config):
    """Point the titan cache at a temporary folder, pin the CPU peak, share out the cores."""
    global _cache_dir
    _cache_dir = tempfile.mkdtemp(prefix="titan-test-cache-")
    os.environ["TITAN_CACHE_DIR"] = _cache_dir
    os.environ["TITAN_CPU_PEAK_FLOPS"] = SUITE_CPU_PEAK_FLOPS
    global _inductor_dir
    if _RUN_MARK not in os.environ:  # the controller (or a run without xdist): make the folder
        _inductor_dir = tempfile.mkdtemp(prefix="titan-test-inductor-")
        os.environ[_RUN_MARK] = _inductor_dir
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ[_RUN_MARK]
    # matplotlib (titan plot) writes its font cache under the home folder by default.
    os.environ["MPLCONFIGDIR"] = os.path.join(_cache_dir, "matplotlib")
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(_cache_dir, "vllm")
    threads = threads_per_worker()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


SHARED_BUILD_TIMEOUT_S = 1800
"""The per-test limit of a test that may build a shared input (``build_once``).

The suite-wide limit (``timeout`` in pyproject.toml, 300 s) is sized for one test; the test
that happens to ask first for a shared launch also pays for every run of that launch (the
float8 launches take several minutes on a slow 2-core machine), so under load it hit the
suite-wide limit while nothing hung. A launch has its own limit (``launching.launch``, 600 s),
which fails first and with the ranks' output; this limit leaves room for a test that builds
several launches and still stops a hang in the test's own code."""


def _extend_shared_build_timeouts(items) -> None:
    """Give every test that may build a shared input the limit above (unless it sets its own)."""
    for item in items:
        if "build_once" in getattr(item, "fixturenames", ()) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SHARED_BUILD_TIMEOUT_S))


def _slow_first(items) -> None:
    """Move the tests marked ``slow`` ahead of the others, each kind in collection order.

    pytest-xdist hands out the shared-launch groups first (largest first), then single tests
    in collection order as workers free up; the slow end-to-end tests sit in the last folders
    collected, so a worker could start a 30 s test while the other had only seconds of work
    left. Scheduling the longest work first leaves the many sub-second tests to even out the
    end. The order is a function of the collection alone, so every worker agrees on it."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Keep ``--dist loadgroup`` working: pytest-xdist (3.8) names a test's group by appending
    ``@group`` to the test's id through ``item._nodeid``, which pytest 9.2 no longer reads (the id
    lives in ``item._id``), so every group was silently scattered over the workers and a test
    waited on a file lock for a launch another worker was running. Appends the suffix where
    xdist's own attempt did not stick; a no-op where it did, or without loadgroup.

    Also gives the tests that may build a shared input their longer time limit, and runs the
    slow tests first (`_slow_first`)."""
    _extend_shared_build_timeouts(items)
    if not getattr(config.option, "loadgroup", False):
        return
    _slow_first(items)
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid.rpartition("]")[2] and hasattr(item, "_id"):
            item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(groups)}")


def pytest_unconfigure(config):
    """Remove this process's temporary cache folder."""
    for folder in (_cache_dir, _inductor_dir):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def build_once(tmp_path_factory) -> Callable[[str, Callable[[Path], None]], Path]:
    """``build_once(name, build)``: run ``build(folder)`` once per test session, whichever
    pytest-xdist worker asks first (the others wait on a file lock), and return the folder.

    For expensive shared inputs several tests read (a seed checkpoint, a reference run, a
    group of runs sharing one launch). A failed build is recorded: every later caller fails
    with its error instead of building again. The folders belong to this session only.
    """
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    root = base.parent / f"shared-{run_id}" if run_id else base / "shared"
    root.mkdir(parents=True, exist_ok=True)

    def build_folder(name: str, build: Callable[[Path], None]) -> Path:
        folder, failed = root / name, root / f"{name}.FAILED"
        with FileLock(str(root / f"{name}.lock")):
            if not (folder / ".built").exists() and not failed.exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                try:
                    build(folder)
                except BaseException as err:
                    failed.write_text(f"{type(err).__name__}: {err}")
                    raise
                (folder / ".built").touch()
            if failed.exists():
                raise AssertionError(f"building {name!r} failed earlier in this session:\n{failed.read_text()}")
        return folder

    return build_folder
