"""Session-wide test isolation for every test path of the repository.

The suite must never read or write machine-wide state. Two settings go into ``os.environ``
before any test runs, so the ``titan`` subprocesses the tests start inherit them too:

- ``TITAN_CACHE_DIR``: a fresh temporary folder per pytest process (each pytest-xdist worker
  makes its own), so the CPU peak cache in the user's cache folder is never touched.
- ``TITAN_CPU_PEAK_FLOPS``: a fixed, known CPU peak, so no test measures the peak while the
  suite itself loads the machine (a peak measured under load reads low and MFU high). Tests of
  the measurement and the cache unset it explicitly.
- ``MPLCONFIGDIR``: matplotlib's font cache, inside that temporary folder.
- ``TORCHINDUCTOR_CACHE_DIR``: compiled kernels go to a folder of this test run (made by the
  pytest-xdist controller, inherited by its workers, so one cold compile serves the whole run)
  instead of the machine-wide default under the system temp folder.
"""

import os
import shutil
import tempfile

# Far above what the suite's tiny models reach on any CPU: MFU stays a small, valid percentage.
SUITE_CPU_PEAK_FLOPS = "1e13"

_cache_dir: str | None = None
_inductor_dir: str | None = None
_RUN_MARK = "TITAN_TEST_RUN_INDUCTOR_DIR"


def pytest_configure(config):
    """Point the titan cache at a temporary folder and pin the CPU peak."""
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


def pytest_unconfigure(config):
    """Remove this process's temporary cache folder."""
    for folder in (_cache_dir, _inductor_dir):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
