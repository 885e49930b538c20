"""Training-step throughput of titan's Llama 3 against transformers' `LlamaForCausalLM`.

    python tools/bench/bench_model.py                       # debugmodel, seq 256, batch 8, fp32, CPU
    python tools/bench/bench_model.py --optimizer adamw     # include an AdamW step in each iteration
    python tools/bench/bench_model.py --compile             # also titan with each block compiled

Both models get the identical config (HF's is built from `Llama3StateDictAdapter.hf_config()`)
and the same weights (`Llama3StateDictAdapter.to_hf`), so they compute the same function; the
script checks their logits agree first and aborts if they do not. Both use SDPA attention and
the same loss (cross entropy on the logits, computed outside the model). One iteration is
forward + loss + backward (+ AdamW step with `--optimizer adamw`).

The models run interleaved, in alternating order (titan, hf, hf, titan, ...), `--iters`
iterations each per round, after `--warmup` untimed iterations each; the report gives the
median tokens/s of each over the rounds, and the ratio of the medians with the median and
quartiles of the per-round ratios (each round's pair ran back to back, so its ratio is the least
noisy sample). On a shared machine keep `--iters` small and `--rounds` large: short
back-to-back pairs see the same background load.
Memory: the bytes of activations saved for backward (one extra step, any device), and the
allocator's peak on CUDA.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from benchstats import ratio_line  # this folder is on sys.path when a script runs
from titan.models.llama3 import Llama3StateDictAdapter, build_llama3

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Largest |logit| difference accepted between titan and HF, per dtype (relative to 1 + max|logit|).
DEFAULT_ATOL = {"float32": 1e-4, "bfloat16": 5e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--flavor", default="debugmodel", help="key of titan.models.llama3.LLAMA3_FLAVORS"
    )
    p.add_argument("--vocab-size", type=int, default=320, help="byte vocab (259) padded to 320")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--optimizer", choices=["none", "adamw"], default="none")
    p.add_argument("--rounds", type=int, default=25, help="interleaved measurement rounds")
    p.add_argument("--iters", type=int, default=1, help="timed iterations per model per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per model first")
    p.add_argument("--compile", action="store_true", help="also time titan compiled per block")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--atol", type=float, default=None, help="logit tolerance (default per dtype)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_models(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    """titan's model and a `LlamaForCausalLM` of the same config holding the same weights."""
    import transformers  # deferred: only this script needs it

    transformers.logging.set_verbosity_error()  # its rope-length warning is about generation

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    max_seq_len = max(args.seq_len, 2048)
    titan = build_llama3(args.flavor, vocab_size=args.vocab_size, max_seq_len=max_seq_len)
    titan.init_weights()
    adapter = Llama3StateDictAdapter(titan.args)
    hf_cfg = transformers.LlamaConfig(**adapter.hf_config(torch_dtype=args.dtype))
    hf_cfg._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(adapter.to_hf(titan.state_dict()), strict=True)
    for model in (titan, hf):
        # Parameters only: buffers (titan's RoPE table, HF's inv_freq) stay float32 in both.
        model.to(device)
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return titan.train(), hf.train()


def check_same_function(titan, hf, tokens: torch.Tensor, atol: float) -> float:
    """Max |logit| difference scaled by 1 + max|logit|; raises SystemExit above `atol`."""
    with torch.no_grad():
        a = titan(tokens).float()
        b = hf(input_ids=tokens, use_cache=False).logits.float()
    diff = ((a - b).abs().max() / (1 + b.abs().max())).item()
    if not diff <= atol:
        raise SystemExit(
            f"titan and HF logits differ by {diff:.3g} (relative) > --atol {atol}: the models "
            "do not compute the same function, so their speeds are not comparable"
        )
    return diff


def make_step(forward: Callable, model, tokens, labels, optimizer: str) -> Callable[[], None]:
    """One training iteration: forward, loss, backward (and AdamW step), grads cleared."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5) if optimizer == "adamw" else None

    def step() -> None:
        logits = forward(model, tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)

    return step


def titan_forward(model, tokens):
    """titan: token ids -> logits."""
    return model(tokens)


def hf_forward(model, tokens):
    """HF: token ids -> logits (no KV cache, all positions)."""
    return model(input_ids=tokens, use_cache=False).logits


def saved_activation_mib(model, step: Callable[[], None]) -> float:
    """MiB of distinct non-parameter storages autograd saves for backward in one step."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values()) / 2**20


def step_peak_mib(step: Callable[[], None], device: torch.device) -> float:
    """MiB live at the peak of one step among the tensors the step itself allocates (the
    gradients, activations and temporaries; not the weights and optimizer states that exist
    before it), counted by torch's ``MemTracker`` as tensors are created and freed, on any
    device. For eager steps: compiled code allocates outside the dispatcher it watches."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        step()
    # Keyed by the tensors' devices (``cuda:0``): match ``--device cuda`` by type and index.
    peaks = [v["Total"] for k, v in tracker.get_tracker_snapshot("peak").items()
             if k.type == device.type and (device.index is None or k.index == device.index)]
    if not peaks:
        raise RuntimeError(f"MemTracker saw no tensor of the step on {device}")
    return max(peaks) / 2**20


def sync(device: torch.device) -> None:
    """Wait for queued kernels so the clock measures finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], None], iters: int, device: torch.device) -> float:
    """Seconds for `iters` back-to-back steps."""
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync(device)
    return time.perf_counter() - start


def run_interleaved(
    steps: dict[str, Callable[[], None]], args: argparse.Namespace, tokens_per_iter: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """tokens/s of each step per round, alternating the order every round; CUDA peak GiB."""
    device = torch.device(args.device)
    names = list(steps)
    rates: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, float] = {}
    for name in names:
        for _ in range(args.warmup):
            steps[name]()
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds = time_steps(steps[name], args.iters, device)
            rates[name].append(args.iters * tokens_per_iter / seconds)
            if device.type == "cuda":
                peaks[name] = max(
                    peaks.get(name, 0.0), torch.cuda.max_memory_allocated(device) / 2**30
                )
    return rates, peaks


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Build both models, check they agree, time them interleaved, print medians and ratios."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    titan, hf = build_models(args)
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.batch_size, args.seq_len + 1)
    data = torch.randint(0, args.vocab_size, shape, generator=gen).to(device)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    atol = args.atol if args.atol is not None else DEFAULT_ATOL[args.dtype]
    diff = check_same_function(titan, hf, tokens, atol)

    models = {"titan": (titan, titan_forward), "hf": (hf, hf_forward)}
    if args.compile:
        from titan.dist import CompileConfig, apply_compile

        compiled = apply_compile(copy.deepcopy(titan), None, CompileConfig(enable=True))
        models["titan_compiled"] = (compiled, titan_forward)
    steps = {n: make_step(fwd, m, tokens, labels, args.optimizer) for n, (m, fwd) in models.items()}
    saved = {n: saved_activation_mib(models[n][0], steps[n]) for n in steps}
    rates, peaks = run_interleaved(steps, args, args.batch_size * args.seq_len)

    print(
        f"# {args.flavor} vocab {args.vocab_size} seq {args.seq_len} batch {args.batch_size} "
        f"{args.dtype} on {device} ({torch.get_num_threads()} threads), optimizer {args.optimizer}, "
        f"{args.rounds} rounds x {args.iters} iters, torch {torch.__version__}; "
        f"logits agree to {diff:.2g} (relative)"
    )
    for name, r in rates.items():
        peak = f", CUDA peak {peaks[name]:.2f} GiB" if name in peaks else ""
        print(
            f"{name:15s} tokens/s median {statistics.median(r):10.1f} "
            f"(min {min(r):.1f}, max {max(r):.1f}); saved activations {saved[name]:.1f} MiB{peak}"
        )
    print(ratio_line("titan/hf", rates["titan"], rates["hf"], "tokens/s"))
    if args.compile:
        print(ratio_line("titan compiled/eager", rates["titan_compiled"], rates["titan"], "tokens/s"))
    return rates


if __name__ == "__main__":
    main()
