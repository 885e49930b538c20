"""The fake-backend dry run: any world size, on the meta device, on this one CPU."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import titan_dist_testlib as lib
    from titan.dist import ActivationCheckpointConfig, CompileConfig, ParallelismConfig
    from titan.dist.dry_run import dry_run

    start = time.time()
    est = dry_run(lambda: lib.TinyTransformer(), ParallelismConfig(
        tensor_parallel_degree=2, pipeline_parallel_degree=4, data_parallel_shard_degree=-1),
        world_size=512, activation_checkpoint=ActivationCheckpointConfig(mode="full"),
        compile=CompileConfig(), local_batch_size=4, seq_len=16, global_batch_size=512)
    full = sum(p.numel() for p in lib.TinyTransformer().parameters())
    assert len(est) == 4 and all(e.params > 0 and e.activation_bytes > 0 for e in est)
    # Every pipeline rank holds a 1/(tp*dp) shard of its stage (FSDP pads dim 0).
    assert sum(e.params for e in est) * 128 >= full
    print("OK", round(time.time() - start, 1))
""")


@pytest.mark.slow
def test_dry_run_512_ranks(tmp_path):
    import os
    tests = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=tests)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ranks        0-127 (pp 0)" in out.stdout and "OK" in out.stdout, out.stdout
