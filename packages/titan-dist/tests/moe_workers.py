"""A tiny MoE transformer that follows the grouped-experts contract titan.dist's expert
parallel reads (without importing titan.models), its single-process reference, and the
functions spawned gloo ranks run (importable by the child processes, unlike a test file)."""

from __future__ import annotations

import dataclasses

import titan_dist_testlib as lib
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

N_EXPERTS, TOP_K, EXPERT_HIDDEN, MOE_LAYERS = 4, 2, 16, 2
EXPERT_WEIGHTS = ("w1", "w2", "w3")


@dataclasses.dataclass(frozen=True)
class MoEPlan(lib.TinyPlan):
    """TinyPlan with MoE blocks: the router is replicated over TP, the MoE block input is
    gathered from sequence shards, the experts are named for expert parallel."""

    tensor_parallel: dict = dataclasses.field(default_factory=lambda: {
        "tok_embeddings": "embedding",
        "layers.*.attention_norm": "norm",
        "layers.*.attention": "block_input",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "norm",
        "layers.*.moe": "block_input",
        "layers.*.moe.router": "replicate",
        "norm": "norm",
        "output": "output",
    })
    expert_modules: str = "layers.*.moe.experts"
    expert_parallel_divisible: dict = dataclasses.field(
        default_factory=lambda: {"n_experts": N_EXPERTS})


class GroupedExperts(nn.Module):
    """SwiGLU experts stacked along dim 0; forward takes rows grouped by expert in expert
    order and one count per expert (a plain per-expert loop: exact, and empty groups are fine);
    rows past the counted ones (padding) give zeros. The expert count comes from the weights,
    so the module also runs on local experts."""

    def __init__(self, n_experts: int = N_EXPERTS, dim: int = lib.DIM, hidden: int = EXPERT_HIDDEN):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, hidden, dim) * dim ** -0.5)
        self.w3 = nn.Parameter(torch.randn(n_experts, hidden, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, dim, hidden) * hidden ** -0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        assert num_tokens_per_expert.numel() == self.w1.shape[0], "one count per expert"
        counts = num_tokens_per_expert.tolist()
        outs = []
        for e, rows in enumerate(torch.split(x[:sum(counts)], counts)):
            hidden = F.silu(rows @ self.w1[e].t()) * (rows @ self.w3[e].t())
            outs.append(hidden @ self.w2[e].t())
        return torch.cat(outs + [x.new_zeros(x.shape[0] - sum(counts), x.shape[1])])


class MoE(nn.Module):
    """Token-choice top-k MoE: softmax router, tokens sorted by expert (stable), the grouped
    experts, then a deterministic weighted combine. Keeps its last per-expert counts."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(lib.DIM, N_EXPERTS, bias=False)
        self.experts = GroupedExperts()
        self.last_counts = torch.zeros(N_EXPERTS, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = x.device_mesh if isinstance(x, DTensor) else None
        if mesh is not None:  # sequence parallel gathered the input: every TP rank has it all
            x = x.to_local()
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(tokens).softmax(-1).topk(TOP_K, dim=-1)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=N_EXPERTS)
        self.last_counts = counts.detach().clone()
        y = self.experts(tokens[order // TOP_K], counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        out = (y[inverse].view(-1, TOP_K, x.shape[-1]) * weights[..., None]).sum(1)
        out = out.view_as(x)
        if mesh is not None:  # back to the sequence-sharded residual stream
            out = DTensor.from_local(out, mesh, [Replicate()], run_check=False)
            out = out.redistribute(mesh, [Shard(1)])
        return out


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(lib.DIM, eps=1e-5)
        self.attention = lib.Attention()
        self.ffn_norm = nn.RMSNorm(lib.DIM, eps=1e-5)
        self.moe = MoE()

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.moe(self.ffn_norm(h))


class MoETransformer(lib.TinyTransformer):
    """TinyTransformer whose blocks carry an MoE instead of the dense feed-forward."""

    def __init__(self, n_layers: int = MOE_LAYERS):
        super().__init__(n_layers)
        self.layers = nn.ModuleDict({str(i): MoEBlock() for i in range(n_layers)})

    def sharding_plan(self) -> MoEPlan:
        return MoEPlan()

    def loads(self) -> torch.Tensor:
        """[layers held, experts] token counts of the last forward on this rank."""
        return torch.stack([b.moe.last_counts for b in self.layers.values()])


def make_moe_model(seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def reference_run(steps: int = 3, lr: float = 0.5) -> dict:
    """One process: per-step losses, gradients and expert loads, and the final weights."""
    model = make_moe_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = {"losses": [], "grads": [], "loads": []}
    for inputs, labels in lib.make_batches(steps):
        loss = lib.loss_fn(model(inputs), labels)
        loss.backward()
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        out["losses"].append(loss.item())
        out["loads"].append(model.loads())
        opt.step()
        opt.zero_grad()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


# --- spawned ranks ------------------------------------------------------------------------


def train_case(case: dict, steps: int = 3, lr: float = 0.5, ckpt_dir: str | None = None) -> dict:
    """Train the tiny MoE model under one layout the way a trainer would (batch sliced by dp
    rank, sharded along the sequence for CP, loss parallel under TP); record every step's
    loss, full gradients and loads summed over the data-parallel ranks."""
    from titan.dist import (
        ActivationCheckpointConfig,
        CompileConfig,
        ParallelDims,
        ParallelismConfig,
        parallelize,
        reduce_mean,
    )
    from titan.dist.context_parallel import shard_batch_for_context_parallel
    from titan.dist.tensor_parallel import loss_parallel_context

    pcfg = ParallelismConfig(**case["parallelism"])
    ac, comp = ActivationCheckpointConfig(**case.get("ac", {})), CompileConfig(**case.get("compile", {}))
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    root = dims.build_mesh("cpu")
    local_batch = lib.BATCH // dims.dp_world_size
    if dims.pp_enabled:
        from titan.dist.pipeline import build_pipeline
        schedule, parts, first, last = build_pipeline(
            make_moe_model(), dims, parallelism=pcfg, activation_checkpoint=ac, compile=comp,
            loss_fn=lib.loss_fn, local_batch_size=local_batch, device=torch.device("cpu"))
    else:
        parts = [parallelize(make_moe_model(), dims, root, parallelism=pcfg,
                             activation_checkpoint=ac, compile=comp)]
    params = dict(p for part in parts for p in part.named_parameters())
    opt = torch.optim.SGD(params.values(), lr=lr)
    out = {"losses": [], "grads": [], "loads": [], "layout": _expert_layout(parts[0])}
    for inputs, labels in lib.make_batches(steps):
        rows = slice(dims.dp_rank * local_batch, (dims.dp_rank + 1) * local_batch)
        inputs, labels, positions = shard_batch_for_context_parallel(
            dims.mesh("cp") if dims.cp_enabled else None, inputs[rows], labels[rows])
        if dims.pp_enabled:
            from titan_dist_workers import _pp_step
            loss = _pp_step(schedule, first, last, inputs, labels, dims)
        else:
            with loss_parallel_context(dims, pcfg):
                loss = lib.loss_fn(parts[0](inputs, positions), labels)
                loss.backward()
        out["grads"].append({n: _full(p.grad) for n, p in params.items()})
        opt.step()
        opt.zero_grad()
        out["losses"].append(reduce_mean(loss.detach(), dims.mesh("dp_cp")).item())
        if not dims.pp_enabled:  # under PP a forward sees one microbatch
            loads = parts[0].loads()
            dist.all_reduce(loads, group=dims.mesh("dp_cp").get_group())  # tp ranks: copies
            out["loads"].append(loads)
    out["state"] = {k: _full(v) for part in parts for k, v in part.state_dict().items()}
    if ckpt_dir is not None:
        import torch.distributed.checkpoint as dcp
        dcp.save(parts[0].state_dict(), checkpoint_id=ckpt_dir)
    dist.barrier()
    return out


def _expert_layout(model: nn.Module) -> dict:
    """How the first held layer's w1 is stored: DTensor mesh dims, placements, local and
    global shapes."""
    w1 = next(iter(model.layers.values())).moe.experts.w1
    return {"mesh": w1.device_mesh.mesh_dim_names, "placements": [str(p) for p in w1.placements],
            "local": tuple(w1.to_local().shape), "global": tuple(w1.shape)}


def train_cases(rank: int, world_size: int, cases: list, ckpt_dir: str | None = None) -> list:
    """Several layouts in one process group (spawning costs more than training); the last one
    also saves a DCP checkpoint when `ckpt_dir` is given."""
    return [train_case(case, ckpt_dir=ckpt_dir if i == len(cases) - 1 else None)
            for i, case in enumerate(cases)]


# Hand-picked routing: expert 1 gets no token anywhere, rank 1 sends nothing to rank 0's
# experts (a zero-size split both ways), rank 0 keeps some for itself and sends some; rank 1
# also passes two padding rows past its counted ones (they must come back as zeros).
UNEVEN_COUNTS = ([3, 0, 2, 0], [0, 0, 4, 1])
PADDING_ROWS = (0, 2)


def uneven_dispatch(rank: int, world_size: int) -> dict:
    """Apply expert parallel to one grouped-experts module on a 2-rank "ep" mesh and run it on
    hand-picked uneven routing; also run the full module on this rank's rows (the reference)."""
    from titan.dist import ParallelDims
    from titan.dist.expert_parallel import apply_expert_parallel

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = GroupedExperts()

        def sharding_plan(self):
            return MoEPlan(expert_modules="experts")

    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, world_size=world_size)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    holder, reference = Holder(), GroupedExperts()
    reference.load_state_dict(holder.experts.state_dict())
    apply_expert_parallel(holder, dims.mesh("ep"), None)
    counts = torch.tensor(UNEVEN_COUNTS[rank])
    torch.manual_seed(10 + rank)
    x = torch.randn(int(counts.sum()) + PADDING_ROWS[rank], lib.DIM)
    upstream = torch.randn(x.shape[0], lib.DIM)  # d loss / d output
    xe, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = holder.experts(xe, counts)
    (y * upstream).sum().backward()
    again = holder.experts(x, counts)  # the same call twice gives the same bits
    y_ref = reference(xr, counts)
    (y_ref * upstream).sum().backward()
    # The experts' full gradient is the sum of every rank's reference gradients.
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    for g in ref_grads.values():
        dist.all_reduce(g)
    w1 = holder.experts.w1
    result = {
        "y": y.detach(), "y_ref": y_ref.detach(), "again": again.detach(),
        "x_grad": xe.grad, "x_grad_ref": xr.grad,
        "local_grads": {n: p.grad.to_local().clone() for n, p in holder.experts.named_parameters()},
        "ref_grads": ref_grads, "local_rows": w1.to_local().shape[0],
        "placements": [str(p) for p in w1.placements], "global_shape": tuple(w1.shape),
    }
    dist.barrier()
    return result


def two_rank_checks(rank: int, world_size: int, cases: list, load_layout: dict,
                    ckpt_dir: str) -> tuple[dict, list, dict]:
    """The uneven-dispatch check, the training layouts, and loading a checkpoint under
    `load_layout`, in one spawn of 2 ranks."""
    return (uneven_dispatch(rank, world_size), train_cases(rank, world_size, cases),
            load_checkpoint(rank, world_size, load_layout, ckpt_dir))


def load_checkpoint(rank: int, world_size: int, case: dict, ckpt_dir: str) -> dict:
    """Build `case`'s layout and load a DCP checkpoint saved under another expert layout;
    return the full weights (the check that DCP resharded the experts)."""
    import torch.distributed.checkpoint as dcp
    from titan.dist import (
        ActivationCheckpointConfig,
        CompileConfig,
        ParallelDims,
        ParallelismConfig,
        parallelize,
    )

    pcfg = ParallelismConfig(**case["parallelism"])
    dims = ParallelDims.from_config(pcfg, world_size)
    root = dims.build_mesh("cpu")
    torch.manual_seed(123)  # weights different from the checkpoint's
    model = parallelize(MoETransformer(), dims, root, parallelism=pcfg,
                        activation_checkpoint=ActivationCheckpointConfig(), compile=CompileConfig())
    state = model.state_dict()
    dcp.load(state, checkpoint_id=ckpt_dir)
    model.load_state_dict(state)
    full = {k: _full(v) for k, v in model.state_dict().items()}
    dist.barrier()
    return full
