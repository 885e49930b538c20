"""Peak FLOP/s of the training device, for MFU.

GPUs: vendor dense bf16 peaks (no sparsity), matched on the device name. CPUs: a float32 GEMM
peak measured once on this machine and cached, because CPU peaks depend on cores, vector units
and clocks that no table captures. Anything else reports no peak (and so no MFU) rather than a
wrong one.
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


def _cpu_cache_key() -> str:
    return "|".join(
        [platform.processor() or platform.machine(), _cpu_model_name(), str(torch.get_num_threads()), torch.__version__]
    )


def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def measure_cpu_gemm_flops(size: int = 1024, repeats: int = 5) -> float:
    """Best-of-``repeats`` float32 GEMM throughput on this CPU, in FLOP/s."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm up the BLAS thread pool
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def default_cache_path() -> Path:
    """Where the measured CPU peak is cached (``$TITAN_CACHE_DIR`` or ``~/.cache/titan``)."""
    root = os.environ.get("TITAN_CACHE_DIR") or Path.home() / ".cache" / "titan"
    return Path(root) / "cpu_peak_flops.json"


def measure_cpu_peak_flops() -> float:
    """The best float32 GEMM throughput over a few sizes: small sizes win on cache-poor CPUs,
    large ones where threading overhead dominates; the best is the fairest peak."""
    return max(measure_cpu_gemm_flops(size, repeats=5) for size in (512, 1024, 2048))


def cpu_peak_flops(cache_path: Path | None = None) -> float:
    """This machine's float32 GEMM peak: ``$TITAN_CPU_PEAK_FLOPS`` when set, else measured on
    first use and cached by CPU model, thread count and torch version.

    A measurement taken while other processes load the CPU comes out low (and MFU high):
    delete the cache file or set the variable to re-measure or pin it.
    """
    pinned = os.environ.get("TITAN_CPU_PEAK_FLOPS")
    if pinned:
        return float(pinned)
    path = cache_path or default_cache_path()
    key = _cpu_cache_key()
    cached: dict[str, float] = {}
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    if key in cached:
        return float(cached[key])
    flops = measure_cpu_peak_flops()
    cached[key] = flops
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)  # atomic: concurrent ranks never read half a file
    except OSError as err:
        logger.warning("could not cache the CPU peak at %s: %s", path, err)
    return flops


def device_peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s for MFU on ``device``: table for GPUs, measured for CPU, None otherwise."""
    if device.type == "cpu":
        return cpu_peak_flops()
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is None:
            logger.warning("no peak FLOP/s known for %r: MFU will not be reported", name)
        return peak
    return None
