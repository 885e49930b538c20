#!/usr/bin/env bash
# One prepared GPU check: the tests that need a GPU (when pytest is there), one CP rank's attention
# against the whole-row mask, then the training
# benchmark (tools/bench/bench_train.py) for Llama 3.2 1B in bf16 on one GPU — titan's trainer,
# the hand-written loop and transformers, eager and compiled, float8 compiled off and on (when
# torchao is installed) — printing the markdown table and
# writing outputs/gpu_check/{loops,compile,float8}.json. Under 8 minutes on an H100/H200. With
# 2+ SM90 GPUs and Triton it also runs the MoE debug model with float8 grouped experts.
#
#   ./tools/gpu_check.sh                      # defaults: 1B, seq 2048, batch 2, tensorwise float8
#   SEQ_LEN=4096 BATCH=1 FLOAT8=rowwise ./tools/gpu_check.sh
#
# Needs only an existing torch (>= 2.11) with CUDA and the project's packages (and
# transformers for the reference side); installs nothing. PYTHON picks the interpreter.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$( [ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || echo python3)}"
out="${OUT_DIR:-$here/outputs/gpu_check}"
mkdir -p "$out"

"$python" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name()} "
      f"(sm{''.join(map(str, torch.cuda.get_device_capability()))})")
EOF

float8=()
if "$python" -c "import torchao.float8" 2>/dev/null; then
    float8=(--float8 "${FLOAT8:-tensorwise}")
else
    echo "gpu_check: torchao not installed, float8 sides skipped (pip install 'titan-train[float8]')"
fi

# The tests that need a GPU: no host wait on steps that do not log (the batch from pinned
# memory on a side stream).
if "$python" -c "import pytest" 2>/dev/null; then
    (cd "$here" && timeout "${TIMEOUT_S:-160}" "$python" -m pytest -q -p no:cacheprovider -k "cuda or CUDA or gpu" \
        tests/test_host_sync.py packages/titan-train/tests/test_device_copy.py \
        packages/titan-dist/tests/test_context_parallel_attention.py) || echo "gpu_check: GPU tests FAILED"
else
    echo "gpu_check: pytest not installed, GPU tests skipped"
fi

# Three runs, each holding at most three copies of the 1B model with AdamW states (~20 GB each):
# the loops, compile, float8. Every run has titan eager, so each ratio is paired in one run.
bench() {
    timeout "${TIMEOUT_S:-160}" "$python" "$here/tools/bench/bench_train.py" \
        --device cuda --dtype bfloat16 --flavor 1B --vocab-size 128256 \
        --seq-len "${SEQ_LEN:-2048}" --batch-size "${BATCH:-2}" \
        --rounds "${ROUNDS:-5}" --iters "${ITERS:-3}" --warmup 2 "$@"
}
# One context-parallel rank's attention: titan's chunks over their visible keys (the fused
# kernels' lower-right causal mask) against the whole-row boolean mask, time and peak memory.
(cd "$here/tools/bench" && timeout "${TIMEOUT_S:-160}" "$python" bench_cp_attention.py --device cuda \
    --dtype bfloat16 --seq-len 65536 --cp 2 4 8 --heads 32 --kv-heads 8 --head-dim 128 --rounds 4) \
    || echo "gpu_check: CP attention bench FAILED"
bench --sides titan,hand,hf --json "$out/loops.json"
bench --compile --sides titan,titan_compiled,hand_compiled --json "$out/compile.json"
if [ ${#float8[@]} -gt 0 ]; then
    # Compiled: torchao's float8 casts and scales need inductor to fuse them; eager float8 is
    # slower than bf16 (H200, this 1B: 0.42x tensorwise, 0.34x rowwise).
    bench --compile "${float8[@]}" --sides titan,titan_compiled,titan_float8_compiled --json "$out/float8.json"
fi

# MoE experts' grouped GEMMs in float8 (torchao's Triton kernels, SM90+): a short run of the
# Qwen3-MoE debug model on 2 GPUs under FSDP2 (bf16 weights, so the experts take the grouped
# path), against the same run in bf16. Skipped with fewer than 2 GPUs or without Triton.
if [ ${#float8[@]} -gt 0 ] && "$python" -c "import triton, torch; assert torch.cuda.device_count() >= 2 and torch.cuda.get_device_capability() >= (9, 0)" 2>/dev/null; then
    moe() {
        timeout "${TIMEOUT_S:-160}" "$python" -m torch.distributed.run --nproc_per_node 2 --rdzv_backend c10d \
            --rdzv_endpoint localhost:0 -m titan.recipes.cli train --config qwen3_moe_debug \
            --training.mixed_precision_param bfloat16 --training.steps 20 --metrics.log_freq 20 \
            --metrics.no_enable_progress_bar --parallelism.data_parallel_shard_degree 2 "$@"
    }
    moe --job.dump_folder "$out/moe_bf16" | grep -E "step 20/" || true
    moe --quantize.grouped_mm.float8.fqns experts --job.dump_folder "$out/moe_float8" | grep -E "float8|step 20/" || true
else
    echo "gpu_check: float8 grouped experts skipped (needs torchao, Triton and 2 SM90+ GPUs)"
fi
