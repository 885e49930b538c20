"""One training step, the way titan runs it and the ways a user would write it instead.

    python tools/bench/bench_train.py                            # CPU: debugmodel, eager
    python tools/bench/bench_train.py --compile                  # ... each side also compiled
    python tools/bench/bench_train.py --float8 rowwise --flavor debugmodel_tiny   # float8 on/off
    python tools/bench/bench_train.py --device cuda --dtype bfloat16 --flavor 1B --vocab-size 128256 \\
        --seq-len 2048 --batch-size 2 --compile --float8 tensorwise --json results.json

Every side trains the same model (the same initial weights, checked by their logits) on the
same tokens with the same optimizer (AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1, the
same kernel choice) and clips the gradient norm to 1.0:

- ``titan``: ``titan.train.trainer.Trainer.train_step``, the step ``titan train`` runs (the
  engine's forward/backward and optimizer step, no host sync), built from ``--config
  llama3_debug_synthetic`` with the same shape flags;
- ``hand``: a minimal hand-written loop over the same ``titan.models`` module;
- ``hf``: ``transformers.LlamaForCausalLM`` holding the same weights, in the same plain loop;
- with ``--compile`` each again compiled: titan per block (``--compile.enable``: the blocks
  and the loss; ``titan_compiled_eager_loss``: the blocks only) and whole
  (``--compile.granularity model``), the other two with ``torch.compile`` on the whole model,
  as a user would;
- with ``--float8 RECIPE`` titan and the hand loop again with torchao float8 linears, and
  with ``--compile`` too titan float8 compiled per block (torchao's casts and scales fused by
  inductor: eager float8 runs them as separate kernels and is slower than bf16 on a GPU).

The sides run interleaved (the order alternates every round) after warm-up steps (compile
happens in the first, whose time is reported: with a cold inductor cache that is the cold
compile time, on a second run the warm one). The report: tokens/s per side (median and
quartiles over rounds), MFU, memory (the activations autograd saves, any device; the eager
sides' step peak as torch's MemTracker counts it, any device; the allocator's peak on CUDA)
and the ratios the project tracks, as a markdown table and, with ``--json``, a file.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_model import (  # this folder is on sys.path
    DEFAULT_ATOL,
    saved_activation_mib,
    step_peak_mib,
    sync,
)
from benchstats import ratio_line
from titan.train.optimizer import FUSED_BY_DEFAULT

LR, BETAS, WEIGHT_DECAY, MAX_NORM = 3e-4, (0.9, 0.95), 0.1, 1.0
# (numerator, denominator, target) of the ratios the project tracks (docs: issue targets).
RATIOS = [
    ("titan", "hand", 1.00), ("titan", "hf", 1.10), ("titan_compiled", "titan", 1.25),
    ("titan_compiled_model", "titan", 1.25), ("titan_compiled_model", "hand_compiled", 1.00),
    ("hand_compiled", "hand", None), ("hf_compiled", "hf", None),
    ("titan_compiled", "titan_compiled_eager_loss", None),
    ("titan_float8", "titan", None), ("hand_float8", "hand", None),
    ("titan_float8_compiled", "titan_compiled", None), ("titan_float8_compiled", "titan", None),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--flavor", default="debugmodel", help="a titan.models.llama3 flavor")
    p.add_argument("--vocab-size", type=int, default=320, help="rows of the embedding (>= 259, the byte vocab)")
    p.add_argument("--n-layers", type=int, default=None,
                   help="blocks of the flavor to keep (e.g. 8B's widths with 4 blocks to fit a small device)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="compute dtype (autocast over float32 weights, as titan's mixed precision)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--loss-chunk-tokens", type=int, default=0,
                   help="titan's --training.loss_chunk_tokens (its sides only; 0: the loss in one piece)")
    p.add_argument("--compile", action="store_true", help="also time every side compiled")
    p.add_argument("--float8", choices=["tensorwise", "rowwise"], default=None,
                   help="also time titan and the hand loop with torchao float8 linears")
    p.add_argument("--sides", default=None,
                   help="comma-separated subset of the sides to build and time (default: every side the "
                        "flags enable); e.g. titan,hand,hf to fit big models in memory")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--iters", type=int, default=2, help="timed steps per side per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def titan_trainer(args: argparse.Namespace, folder: str, *extra: str):
    """A ``Trainer`` for the benchmark's shape, on one process."""
    from titan.train.trainer import Trainer

    from titan.recipes.cli import parse_train_args
    from titan.recipes.families import model_spec

    config = parse_train_args([
        "--config", "llama3_debug_synthetic", "--model.flavor", args.flavor,
        "--model.vocab_size", str(args.vocab_size), "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch_size), "--training.mixed_precision_param", args.dtype,
        "--training.max_norm", str(MAX_NORM), "--optimizer.lr", str(LR), "--optimizer.weight_decay",
        str(WEIGHT_DECAY), "--lr_scheduler.warmup_steps", "0", "--training.steps", "1000000",
        "--debug.seed", str(args.seed), "--training.loss_chunk_tokens", str(args.loss_chunk_tokens),
        *(["--model.n_layers", str(args.n_layers)] if args.n_layers else []),
        "--job.dump_folder", folder, *extra,
    ])
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here")
    return Trainer(config, model_spec=model_spec("llama3"))


def titan_step(trainer, batch: dict[str, torch.Tensor]) -> Callable[[], None]:
    """The step `titan train` runs, on a fixed batch."""
    def step() -> None:
        trainer.train_step([batch], sync=False)
    return step


def plain_step(model: torch.nn.Module, forward: Callable, batch: dict[str, torch.Tensor], args) -> Callable[[], None]:
    """The loop a user writes: autocast forward, float32 cross-entropy, backward, clip, AdamW."""
    device = torch.device(args.device)
    kernel = {"fused": True} if device.type in FUSED_BY_DEFAULT else {"foreach": True}  # titan's "auto" choice
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, **kernel)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16"
                else contextlib.nullcontext())

    def step() -> None:
        with autocast:
            logits = forward(model, batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def reference_models(trainer, args, *, with_hf: bool) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The hand loop's titan module and (``with_hf``) HF's Llama, both holding the trainer's
    initial weights."""
    import transformers
    from titan.models.llama3 import Llama3StateDictAdapter, build_llama3

    transformers.logging.set_verbosity_error()
    device = torch.device(args.device)
    state = {k: v.detach().clone() for k, v in trainer.model_parts[0].state_dict().items()}
    with torch.device("meta"):
        layers = {"n_layers": args.n_layers} if args.n_layers else {}
        hand = build_llama3(args.flavor, vocab_size=args.vocab_size, max_seq_len=args.seq_len, **layers)
    hand.to_empty(device=device)
    with torch.no_grad():
        hand.init_weights(buffer_device=device)
    hand.load_state_dict(state)
    if not with_hf:
        return hand.train(), None
    adapter = Llama3StateDictAdapter(hand.args)
    hf_cfg = transformers.LlamaConfig(**adapter.hf_config(torch_dtype="float32"))
    hf_cfg._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(hf_cfg).to(device)
    hf.load_state_dict(adapter.to_hf({k: v for k, v in state.items() if k in dict(hand.named_parameters())}),
                       strict=False)
    return hand.train(), hf.train()


def check_same_function(models: dict[str, tuple[torch.nn.Module, Callable]], tokens: torch.Tensor) -> float:
    """Largest logit gap to titan's (relative to 1 + max|logit|); exits above the fp32 tolerance."""
    with torch.no_grad():
        logits = {name: fwd(model, tokens).float() for name, (model, fwd) in models.items()}
    ref = logits.pop("titan")
    gap = max(float((x - ref).abs().max() / (1 + ref.abs().max())) for x in logits.values())
    if not gap <= DEFAULT_ATOL["float32"]:
        raise SystemExit(f"the sides' logits differ by {gap:.3g}: they do not compute the same function")
    return gap


def titan_forward(model, tokens):
    return model(tokens)


def hf_forward(model, tokens):
    return model(input_ids=tokens, use_cache=False).logits


def wanted_sides(args) -> list[str]:
    """The sides to build: ``--sides``, else every side the flags enable."""
    enabled = ["titan", "hand", "hf"]
    if args.compile:
        enabled += ["titan_compiled", "titan_compiled_eager_loss", "titan_compiled_model", "hand_compiled",
                    "hf_compiled"]
    if args.float8:
        enabled += ["titan_float8", "hand_float8"]
    if args.float8 and args.compile:
        enabled += ["titan_float8_compiled"]  # torchao's casts fused: how float8 is meant to run
    if args.sides is None:
        return enabled
    chosen = [name.strip() for name in args.sides.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(enabled))
    if unknown or "titan" not in chosen:
        raise SystemExit(f"--sides {args.sides}: needs titan (every ratio is against it or its loop) and only "
                         f"sides the flags enable ({', '.join(enabled)}); unknown here: {', '.join(unknown) or '-'}")
    return chosen


def titan_variant_flags(args) -> dict[str, tuple[str, ...]]:
    """The `titan train` flags of each titan side beyond the eager one."""
    float8 = ("--quantize.linear.float8.recipe", str(args.float8))
    return {
        "titan_compiled": ("--compile.enable",),  # the blocks and the loss
        "titan_compiled_eager_loss": ("--compile.enable", "--compile.components", "model"),  # the blocks only
        "titan_compiled_model": ("--compile.enable", "--compile.granularity", "model"),
        "titan_float8": float8,
        "titan_float8_compiled": (*float8, "--compile.enable"),
    }


def build_sides(args, folder: str) -> tuple[dict[str, Callable[[], None]], dict[str, torch.nn.Module], float, object]:
    """Every wanted side's step and module; the logit gap; the eager trainer (for FLOPs)."""
    wanted = wanted_sides(args)
    trainer = titan_trainer(args, f"{folder}/titan")
    device = torch.device(args.device)
    if trainer.engine.device.type != device.type:
        raise SystemExit(f"titan's trainer runs on {trainer.engine.device}, not --device {args.device} "
                         "(on a GPU machine, CUDA_VISIBLE_DEVICES= runs everything on the CPU)")
    batch = next(iter(trainer.dataloader))
    batch = {"input_ids": batch["input_ids"].to(device), "labels": batch["labels"].to(device)}
    hand, hf = reference_models(trainer, args, with_hf=any(name.startswith("hf") for name in wanted))
    compared = {"titan": (trainer.model_parts[0], titan_forward), "hand": (hand, titan_forward)}
    if hf is not None:
        compared["hf"] = (hf, hf_forward)
    gap = check_same_function(compared, batch["input_ids"])
    steps = {"titan": titan_step(trainer, batch)}
    modules = {"titan": trainer.model_parts[0]}
    for name, flags in titan_variant_flags(args).items():
        if name in wanted:
            variant = titan_trainer(args, f"{folder}/{name}", *flags)
            steps[name], modules[name] = titan_step(variant, batch), variant.model_parts[0]
    for name, module, fwd in (("hand", hand, titan_forward), ("hf", hf, hf_forward)):
        if name in wanted:
            steps[name], modules[name] = plain_step(module, fwd, batch, args), module
        if f"{name}_compiled" in wanted:
            twin = copy.deepcopy(module)
            steps[f"{name}_compiled"], modules[f"{name}_compiled"] = plain_step(torch.compile(twin), fwd, batch, args), twin
    if "hand_float8" in wanted:
        from titan.train.quantize import (
            Float8LinearConfig,
            QuantizeConfig,
            QuantizeLinearConfig,
            apply_quantization,
        )

        twin = copy.deepcopy(hand)
        apply_quantization(twin, QuantizeConfig(linear=QuantizeLinearConfig(float8=Float8LinearConfig(recipe=args.float8))))
        steps["hand_float8"], modules["hand_float8"] = plain_step(twin, titan_forward, batch, args), twin
    order = [name for name in wanted if name in steps]
    return {n: steps[n] for n in order}, {n: modules[n] for n in order}, gap, trainer


def measure(steps: dict[str, Callable[[], None]], args) -> tuple[dict[str, list[float]], dict[str, float]]:
    """tokens/s per round for each side (interleaved, alternating order) after the warm-up
    steps, and the CUDA allocator's peak GiB."""
    device = torch.device(args.device)
    tokens = args.batch_size * args.seq_len * args.iters
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    rates: dict[str, list[float]] = {name: [] for name in steps}
    peaks: dict[str, float] = {}
    names = list(steps)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            start = time.perf_counter()
            for _ in range(args.iters):
                steps[name]()
            sync(device)
            rates[name].append(tokens / (time.perf_counter() - start))
            if device.type == "cuda":
                peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated(device) / 2**30)
    return rates, peaks


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


EAGER_SIDES = ("titan", "hand", "hf")
"""The sides whose step peak ``MemTracker`` can count (compiled code allocates outside it)."""


def report(args, rates, first, peaks, saved, flops_per_token: float, peak_flops: float | None, gap: float,
           step_peaks: dict[str, float] | None = None) -> dict:
    """The results as one JSON-able dict."""
    step_peaks = step_peaks or {}
    sides = {}
    for name, r in rates.items():
        median = statistics.median(r)
        sides[name] = {
            "tokens_per_s": median, "tokens_per_s_quartiles": quartiles(r),
            "mfu": median * flops_per_token / peak_flops if peak_flops else None,
            "saved_activations_mib": saved[name], "step_peak_mib": step_peaks.get(name),
            "cuda_peak_gib": peaks.get(name),
            "first_step_s": first[name],
        }
    ratios = []
    for num, den, target in RATIOS:
        if num in rates and den in rates:
            per_round = [a / b for a, b in zip(rates[num], rates[den], strict=True)]
            value = statistics.median(rates[num]) / statistics.median(rates[den])
            ratios.append({"ratio": f"{num}/{den}", "value": value, "per_round_quartiles": quartiles(per_round),
                           "target": target, "met": None if target is None else value >= target})
    memory = saved["titan"] / saved["hand"] if saved.get("hand") else None
    peak_ratio = step_peaks["titan"] / step_peaks["hand"] if step_peaks.get("titan") and step_peaks.get("hand") else None
    return {
        "setup": {"flavor": args.flavor, "n_layers": args.n_layers, "vocab_size": args.vocab_size,
                  "loss_chunk_tokens": args.loss_chunk_tokens,
                  "seq_len": args.seq_len,
                  "batch_size": args.batch_size, "dtype": args.dtype, "device": args.device,
                  "threads": torch.get_num_threads(), "rounds": args.rounds, "iters": args.iters,
                  "torch": torch.__version__, "logit_gap": gap, "peak_flops": peak_flops},
        "sides": sides, "ratios": ratios,
        "memory_titan_over_hand": {"value": memory, "target_at_most": 1.05,
                                   "met": None if memory is None else memory <= 1.05},
        "step_peak_titan_over_hand": {"value": peak_ratio, "target_at_most": 1.05,
                                      "met": None if peak_ratio is None else peak_ratio <= 1.05},
    }


def markdown(results: dict) -> str:
    """The results as markdown tables."""
    s = results["setup"]
    chunked = f", titan's loss in chunks of {s['loss_chunk_tokens']} tokens" if s.get("loss_chunk_tokens") else ""
    layers = f" ({s['n_layers']} blocks)" if s.get("n_layers") else ""
    lines = [f"{s['flavor']}{layers} vocab {s['vocab_size']} seq {s['seq_len']} batch {s['batch_size']} {s['dtype']}{chunked} "
             f"on {s['device']} ({s['threads']} threads), {s['rounds']} rounds x {s['iters']} steps, torch {s['torch']}",
             "", "| side | tokens/s (median) | quartiles | MFU | saved activations MiB | step peak MiB | CUDA peak GiB "
             "| first step s |", "|---|---|---|---|---|---|---|---|"]
    for name, side in results["sides"].items():
        q1, q3 = side["tokens_per_s_quartiles"]
        mfu = f"{100 * side['mfu']:.2f}%" if side["mfu"] is not None else "n/a"
        peak = f"{side['cuda_peak_gib']:.2f}" if side["cuda_peak_gib"] is not None else "n/a"
        step_peak = f"{side['step_peak_mib']:.1f}" if side["step_peak_mib"] is not None else "n/a"
        lines.append(f"| {name} | {side['tokens_per_s']:,.0f} | {q1:,.0f}..{q3:,.0f} | {mfu} | "
                     f"{side['saved_activations_mib']:.1f} | {step_peak} | {peak} | {side['first_step_s']:.1f} |")
    lines += ["", "| ratio | value | per-round quartiles | target | met |", "|---|---|---|---|---|"]
    for r in results["ratios"]:
        q1, q3 = r["per_round_quartiles"]
        target = f">= {r['target']:.2f}" if r["target"] is not None else "-"
        met = {None: "-", True: "yes", False: "**no**"}[r["met"]]
        lines.append(f"| {r['ratio']} | {r['value']:.3f} | {q1:.3f}..{q3:.3f} | {target} | {met} |")
    for key, label in (("memory_titan_over_hand", "saved activations"), ("step_peak_titan_over_hand", "step peak")):
        mem = results[key]
        if mem["value"] is not None:
            lines.append(f"| memory titan/hand ({label}) | {mem['value']:.3f} | - | <= 1.05 | "
                         f"{'yes' if mem['met'] else '**no**'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Build every side, check they compute the same function, time them, print the tables."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from titan.train.device_peak import device_peak_flops

    with tempfile.TemporaryDirectory(prefix="titan-bench-") as folder:
        steps, modules, gap, trainer = build_sides(args, folder)
        saved, first = {}, {}
        for name, step in steps.items():  # each side's first step: compile happens here
            start = time.perf_counter()
            saved[name] = saved_activation_mib(modules[name], step)
            sync(torch.device(args.device))
            first[name] = time.perf_counter() - start
        # After the first steps (the optimizer states exist), the eager sides' step peaks.
        step_peaks = {name: step_peak_mib(step, torch.device(args.device))
                      for name, step in steps.items() if name in EAGER_SIDES}
        rates, peaks = measure(steps, args)
        flops = trainer.engine.flops_per_token
        results = report(args, rates, first, peaks, saved, flops,
                         device_peak_flops(torch.device(args.device), getattr(torch, args.dtype)), gap, step_peaks)
    print(markdown(results))
    for num, den, _ in RATIOS:
        if num in rates and den in rates:
            print(ratio_line(f"{num}/{den}", rates[num], rates[den], "tokens/s"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
