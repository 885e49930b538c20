"""Peak FLOP/s of the training device, for MFU.

GPUs: vendor dense bf16 peaks (no sparsity), matched on the device name. CPUs: a GEMM peak in
the training's compute dtype, measured once on this machine and cached, because CPU peaks
depend on cores, vector units and clocks that no table captures -- and on the dtype: a CPU with
AMX multiplies bf16 several times faster than float32 (one 2-core Xeon: 2.7 vs 0.42 TFLOP/s),
so a bf16 run's MFU against the float32 peak would read several times too high. Anything else
reports no peak (and so no MFU) rather than a wrong one.

Environment:
  ``TITAN_CACHE_DIR``       folder of the cache file (default: the user's cache folder, titan/).
  ``TITAN_CPU_PEAK_FLOPS``  pins the CPU peak, for every dtype (no measurement, no cache); the test suite sets it
                            so that no peak is ever measured under the suite's own load.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

logger = logging.getLogger("titan")

# Dense bf16 tensor-core peaks from the vendors' data sheets, in FLOP/s. Order matters: the
# first name found in the device name wins, so more specific names come first.
GPU_BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
    ("MI250X", 383e12),
)


def gpu_peak_flops(device_name: str) -> float | None:
    """The table's dense bf16 peak for a GPU name, or None when the GPU is not in the table."""
    for key, flops in GPU_BF16_PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def _cpu_cache_key(dtype: torch.dtype = torch.float32) -> str:
    parts = [platform.processor() or platform.machine(), _cpu_model_name(), str(torch.get_num_threads()),
             torch.__version__]
    if dtype != torch.float32:  # float32's key predates the others: caches written before stay valid
        parts.append(str(dtype).removeprefix("torch."))
    return "|".join(parts)


def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def measure_cpu_gemm_flops(size: int = 1024, repeats: int = 5, *, warmup_s: float = 0.1,
                           dtype: torch.dtype = torch.float32) -> float:
    """Best-of-``repeats`` GEMM throughput in ``dtype`` on this CPU, in FLOP/s.

    GEMMs run for ``warmup_s`` seconds first: the BLAS thread pool, the caches and the clock
    governor all need a moment, and a cold first call reads far below the peak. The best trial
    (not the mean) is kept because interference from other processes only ever slows a trial.
    """
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    out = torch.empty(size, size, dtype=dtype)
    deadline = time.perf_counter() + warmup_s
    torch.mm(a, b, out=out)
    while time.perf_counter() < deadline:
        torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def default_cache_path() -> Path:
    """Where the measured CPU peak is cached: ``$TITAN_CACHE_DIR/cpu_peak_flops.json``, by default
    under the user's cache folder (``$XDG_CACHE_HOME/titan`` or ``~/.cache/titan``)."""
    root = os.environ.get("TITAN_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = Path(xdg) / "titan" if xdg else Path.home() / ".cache" / "titan"
    return Path(root) / "cpu_peak_flops.json"


def measure_cpu_peak_flops(trials: int = 3, dtype: torch.dtype = torch.float32) -> float:
    """The best GEMM throughput in ``dtype`` over a few sizes and ``trials`` rounds.

    Small sizes win on cache-poor CPUs, large ones where threading overhead dominates; the best
    is the fairest peak. Rounds are spaced out in time so that a burst of load from another
    process (a test suite, a compile) cannot spoil every one of them.
    """
    best = 0.0
    for trial in range(trials):
        if trial:
            time.sleep(0.05)
        for size in (512, 1024, 2048):
            best = max(best, measure_cpu_gemm_flops(size, repeats=5, dtype=dtype))
    return best


def _read_cache(path: Path) -> dict[str, float]:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _write_cache(path: Path, cached: dict[str, float]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)  # atomic: concurrent ranks never read half a file
    except OSError as err:
        logger.warning("could not cache the CPU peak at %s: %s", path, err)


def cpu_peak_flops(cache_path: Path | None = None, dtype: torch.dtype = torch.float32) -> float:
    """This machine's GEMM peak in ``dtype``: ``$TITAN_CPU_PEAK_FLOPS`` when set, else measured
    on first use and cached by CPU model, thread count, torch version and dtype.

    A measurement taken while other processes load the CPU comes out low; training corrects it
    (:func:`raise_cpu_peak_flops`) as soon as observed throughput exceeds it, so MFU never reads
    above 100%. Delete the cache file to re-measure, or set the variable to pin the peak.
    """
    pinned = os.environ.get("TITAN_CPU_PEAK_FLOPS")
    if pinned:
        return float(pinned)
    path = cache_path or default_cache_path()
    key = _cpu_cache_key(dtype)
    cached = _read_cache(path)
    if key in cached:
        return float(cached[key])
    flops = measure_cpu_peak_flops(dtype=dtype)
    cached[key] = flops
    _write_cache(path, cached)
    return flops


def raise_cpu_peak_flops(observed: float, cache_path: Path | None = None,
                         dtype: torch.dtype = torch.float32) -> bool:
    """Record that this CPU reached ``observed`` FLOP/s computing in ``dtype``: the cached peak
    of that dtype, when lower, is rewritten to ``observed`` (a peak that real work exceeds was
    measured under load).

    Returns whether the cache changed. A peak pinned with ``$TITAN_CPU_PEAK_FLOPS`` is the
    user's choice and is left alone.
    """
    if os.environ.get("TITAN_CPU_PEAK_FLOPS"):
        return False
    path = cache_path or default_cache_path()
    key = _cpu_cache_key(dtype)
    cached = _read_cache(path)
    # Only a cached measurement is corrected: with none, the next run measures afresh, which
    # beats caching one run's throughput (a lower bound) as if it were the peak.
    if key not in cached or float(cached[key]) >= observed:
        return False
    cached[key] = observed
    _write_cache(path, cached)
    return True


def device_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> float | None:
    """Peak FLOP/s for MFU on ``device``: the bf16 table for GPUs (whatever ``dtype``: the
    convention MFU figures are quoted in), measured in the compute ``dtype`` for CPUs, None
    otherwise."""
    if device.type == "cpu":
        return cpu_peak_flops(dtype=dtype)
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is None:
            logger.warning("no peak FLOP/s known for %r: MFU will not be reported", name)
        return peak
    return None
