"""Mixture-of-experts block: token-choice router, grouped SwiGLU experts, shared experts,
auxiliary-loss-free load balancing and the optional Switch-style auxiliary loss.

The pieces are separate modules so families configure them (Qwen3-MoE: softmax router,
no shared experts; DeepSeek-V3: sigmoid, group-limited, shared experts) and expert
parallelism can wrap `GroupedExperts` alone: it shards `w1`/`w2`/`w3` along the expert dim
and calls `forward` with the tokens and counts of its local experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from titan.models.common.feed_forward import FeedForward
from titan.models.common.init import SeededInit
from torch import nn

ScoreFunc = Literal["softmax", "sigmoid"]
AuxLossKind = Literal["switch", "sequence"]


@dataclass(frozen=True)
class RoutingStatistics:
    """What one MoE layer's training forward routed, for the Switch-style auxiliary loss:
    `counts` [E] the assignments each expert received (`top_k` per counted token, no graph),
    `score_sums` [E] the counted tokens' router probabilities summed per expert (with their
    graph: the loss trains the router through them), `tokens` the counted tokens (a 0-dim
    tensor). Padding is not counted; under context parallel all three cover the whole
    sequences (summed over the ranks that hold them)."""

    counts: torch.Tensor
    score_sums: torch.Tensor
    tokens: torch.Tensor


class TokenChoiceRouter(nn.Module):
    """Each token picks its `top_k` experts from a linear gate's scores.

    Scores are `softmax` or `sigmoid` of the gate logits, in float32. A selection bias
    (auxiliary-loss-free balancing) shifts which experts win but never the weights, which
    come from the unbiased scores. Group-limited routing (`n_groups > 1`) first keeps the
    `topk_groups` groups of consecutive experts whose two best (biased) scores sum highest,
    so a token's experts live on few devices under expert parallelism. The weights are then
    optionally renormalized to sum to one (`norm_topk_prob`) and multiplied by `route_scale`.

    `force_load_balance` (a benchmarking switch, torchtitan's `--debug.moe_force_load_balance`)
    ignores the scores for the choice: token t takes experts t*k .. t*k + k - 1 (mod E), so
    every expert gets the same number of tokens (within one) whatever the router learned,
    and the weights still come from the scores, so the gate trains.
    """

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        *,
        score_func: ScoreFunc = "softmax",
        n_groups: int = 1,
        topk_groups: int = 1,
        norm_topk_prob: bool = False,
        route_scale: float = 1.0,
        force_load_balance: bool = False,
    ) -> None:
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if not 0 < top_k <= n_experts:
            raise ValueError(f"top_k ({top_k}) must be in 1..n_experts ({n_experts})")
        if n_groups < 1 or n_experts % n_groups or not 0 < topk_groups <= n_groups:
            raise ValueError(
                f"n_groups ({n_groups}) must divide n_experts ({n_experts}) and topk_groups "
                f"({topk_groups}) must be in 1..n_groups"
            )
        if n_groups > 1 and (n_experts // n_groups < 2 or top_k > topk_groups * (n_experts // n_groups)):
            raise ValueError(
                f"group-limited routing needs >= 2 experts per group and top_k ({top_k}) <= "
                f"topk_groups ({topk_groups}) * experts per group ({n_experts // n_groups})"
            )
        self.n_experts, self.top_k = n_experts, top_k
        self.score_func, self.n_groups, self.topk_groups = score_func, n_groups, topk_groups
        self.norm_topk_prob, self.route_scale = norm_topk_prob, route_scale
        self.force_load_balance = force_load_balance
        self.gate = nn.Linear(dim, n_experts, bias=False)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Routing scores [T, E] in float32 for tokens `x` [T, D]."""
        logits = self.gate(x).float()
        return logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()

    def select(self, scores: torch.Tensor, expert_bias: torch.Tensor | None) -> torch.Tensor:
        """Indices [T, k] of each token's experts: top-k of the biased scores among the kept groups
        (round robin under `force_load_balance`)."""
        if self.force_load_balance:
            slots = torch.arange(scores.shape[0] * self.top_k, device=scores.device)
            return (slots % self.n_experts).view(scores.shape[0], self.top_k)
        choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias.float()
        if self.n_groups > 1:
            grouped = choice.unflatten(-1, (self.n_groups, -1))
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            kept = group_score.topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(-1, kept, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
        return choice.topk(self.top_k, dim=-1).indices

    def weights(self, scores: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """Routing weights [T, k] of the selected experts, from the unbiased scores."""
        top = scores.gather(-1, selected)
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return top * self.route_scale if self.route_scale != 1.0 else top

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route tokens `x` [T, D]: (weights [T, k] float32, expert indices [T, k] long)."""
        scores = self.scores(x)
        selected = self.select(scores, expert_bias)
        return self.weights(scores, selected), selected


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient dense: grouped_mm's backward
    rejects a stride-0 gradient (e.g. from `out.sum()`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 (autograd signature)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad.contiguous()


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU MLPs held as stacked weights: `w1` (gate) and `w3` (up)
    `[E, hidden, dim]`, `w2` (down) `[E, dim, hidden]`.

    `forward(x, num_tokens_per_expert)` takes the token rows grouped by expert, in expert
    order, with the count of each group; E is read from the parameters, so an expert-parallel
    shard holding some of the experts calls it with its own tokens and counts. It runs
    `torch.nn.functional.grouped_mm` (one kernel for all experts, no host sync) when the
    shapes allow it, else an exact per-expert loop; `use_grouped_mm=False` forces the loop.
    """

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, *, use_grouped_mm: bool = True) -> None:
        super().__init__()
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """SwiGLU of each row of `x` [N, D] by its expert; rows past the counted ones give 0."""
        w1, w2, w3 = self._local(self.w1), self._local(self.w2), self._local(self.w3)
        if self.use_grouped_mm and _grouped_mm_fits(x, w1, w2):
            return self._grouped(x, num_tokens_per_expert, w1, w2, w3)
        return self._loop(x, num_tokens_per_expert, w1, w2, w3)

    @staticmethod
    def _local(w: torch.Tensor) -> torch.Tensor:
        # A DTensor weight sharded on the expert dim (expert parallel) computes on its local
        # experts; the counts the caller passes are those of the local experts.
        return w.to_local() if hasattr(w, "to_local") else w

    @staticmethod
    def _grouped(x, counts, w1, w2, w3) -> torch.Tensor:  # noqa: ANN001
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        # grouped_mm leaves rows past offs[-1] uninitialized, in the output and in the input
        # gradient: mask both (the where on x masks its gradient), without a host sync.
        valid = (torch.arange(x.shape[0], device=x.device) < offs[-1]).unsqueeze(-1)
        x = torch.where(valid, x, 0.0)
        gate = F.grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        up = F.grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        out = F.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
        return _ContiguousGrad.apply(torch.where(valid, out, 0.0))

    @staticmethod
    def _loop(x, counts, w1, w2, w3) -> torch.Tensor:  # noqa: ANN001
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            rows = x[start : start + n]
            outs.append(F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e]))
            start += n
        outs.append(x.new_zeros(x.shape[0] - start, x.shape[1]))
        return torch.cat(outs)

    def init_weights(self, init: SeededInit, std_in: float, std_out: float) -> None:
        """Truncated-normal init; `std_out` (w2, writing to the residual) is depth-scaled."""
        for w, std in ((self.w1, std_in), (self.w3, std_in), (self.w2, std_out)):
            init.trunc_normal_(w, std)


def _grouped_mm_fits(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether grouped_mm accepts these operands: one dtype, and inner/outer sizes whose rows
    are multiples of 16 bytes (dim and hidden multiples of 4 in fp32, 8 in bf16)."""
    if x.dtype != w1.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x.dtype == torch.float32 and torch.compiler.is_compiling():
        return False  # grouped_mm's meta kernel refuses fp32 under torch.compile
    per_16_bytes = 16 // x.element_size()
    hidden, dim = w1.shape[1], w1.shape[2]
    return dim % per_16_bytes == 0 and hidden % per_16_bytes == 0 and w2.shape[1] == dim


class MoE(nn.Module):
    """Routed experts plus optional shared experts, replacing a block's feed-forward.

    forward: route each token to `top_k` experts, stably sort the token copies by expert,
    run `experts` on the sorted rows, un-sort (a permutation: no atomics) and sum each
    token's k outputs weighted by the router in a fixed order, so the result is bitwise
    deterministic; then add `shared_experts(x)`.

    Balancing without an auxiliary loss (`load_balance_coeff` not None, DeepSeek-V3 style):
    `expert_bias` [E] (float32, checkpointed) is added to the scores for selection only;
    `tokens_per_expert` counts the assignments of every forward, and after each optimizer
    step `after_optimizer_step` sums them over the data-parallel ranks and moves each bias by
    `load_balance_coeff` toward uniform load (up for under-loaded experts, down for
    over-loaded). The engine calls that hook on every module that has one.
    `always_use_expert_bias` selects with the bias even when balancing is off: a checkpoint
    trained with it (DeepSeek-V3's `e_score_correction_bias`) routes as it was trained.

    Switch-style auxiliary loss (`aux_loss_coef > 0`, Qwen3-MoE's `router_aux_loss_coef`):
    in training, each forward leaves its `routing_statistics` on the module, with their graph;
    the model's `aux_loss()` (`moe_aux_loss`) pools them over its MoE layers into
    coef * E * sum_e f_e * P_e (f_e: assignments to e per token, P_e: mean router
    probability of e), and the training engine adds that to a loop's loss (weighted by the
    microbatch's labelled tokens). `aux_loss` is this layer's own term, for inspection. The
    model output never includes it.

    Sequence-wise auxiliary loss (`aux_loss_kind="sequence"`, DeepSeek-V3's complementary
    balance loss, the Hub config's `aux_loss_alpha` with `seq_aux`): per sequence (a row of
    the microbatch) coef * sum_e f_e * P_e with f_e = E / (K T) x the sequence's assignments
    to e and P_e the mean over its T tokens of e's score normalized over all experts
    (s_e / sum_j s_j), averaged over the rows; each layer's loss (`sequence_aux_loss`) is
    added to the model's. Under context
    parallel each rank holds a share of every sequence: the engine hands the module
    `set_sequence_sum(fn)`, a differentiable sum over those ranks, so that f_e and P_e are the
    whole microbatch's or sequence's (as in one process, and as Megatron-LM reduces them over
    its TP x CP group), not each share's.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        n_experts: int,
        top_k: int,
        *,
        n_shared_experts: int = 0,
        shared_hidden_dim: int | None = None,
        score_func: ScoreFunc = "softmax",
        n_groups: int = 1,
        topk_groups: int = 1,
        norm_topk_prob: bool = False,
        route_scale: float = 1.0,
        load_balance_coeff: float | None = None,
        always_use_expert_bias: bool = False,
        aux_loss_coef: float = 0.0,
        aux_loss_kind: AuxLossKind = "switch",
        use_grouped_mm: bool = True,
        force_load_balance: bool = False,
    ) -> None:
        super().__init__()
        if load_balance_coeff is not None and load_balance_coeff <= 0:
            raise ValueError(f"load_balance_coeff must be > 0 or None (off), got {load_balance_coeff}")
        if aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {aux_loss_coef}")
        if aux_loss_kind not in ("switch", "sequence"):
            raise ValueError(f"aux_loss_kind must be 'switch' or 'sequence', got {aux_loss_kind!r}")
        self.aux_loss_kind = aux_loss_kind
        self.n_experts, self.top_k = n_experts, top_k
        self.load_balance_coeff, self.aux_loss_coef = load_balance_coeff, aux_loss_coef
        self.always_use_expert_bias = always_use_expert_bias
        self.router = TokenChoiceRouter(
            dim, n_experts, top_k, score_func=score_func, n_groups=n_groups,
            topk_groups=topk_groups, norm_topk_prob=norm_topk_prob, route_scale=route_scale,
            force_load_balance=force_load_balance,
        )
        self.experts = GroupedExperts(dim, hidden_dim, n_experts, use_grouped_mm=use_grouped_mm)
        self.shared_experts: FeedForward | None = None
        if n_shared_experts > 0:
            self.shared_experts = FeedForward(dim, shared_hidden_dim or hidden_dim * n_shared_experts)
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts, dtype=torch.float32), persistent=False)
        # Data-parallel-summed counts of the last optimizer step, for metrics.
        self.register_buffer("last_tokens_per_expert", torch.zeros(n_experts, dtype=torch.float32), persistent=False)
        self.routing_statistics: RoutingStatistics | None = None
        self.sequence_aux_loss: torch.Tensor | None = None
        self.sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None

    def set_sequence_sum(self, sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Sum over the ranks that hold the other positions of this rank's sequences (context
        parallel), differentiable; the aux loss's statistics are taken over all of them. None:
        every sequence is whole here."""
        self.sequence_sum = sequence_sum

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        # A dtype cast of the model (`.to(torch.bfloat16)`) must not round the counts or the
        # bias: keep the balancing state in float32 whatever the parameters become.
        module = super()._apply(fn, recurse)
        for name in ("expert_bias", "tokens_per_expert", "last_tokens_per_expert"):
            buf = getattr(self, name)
            if buf.dtype != torch.float32:
                setattr(self, name, buf.float())
        return module

    accepts_token_mask = True
    """The block hands this module which tokens are real (`forward(x, token_mask=...)`)."""

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Mix `x` [B, S, D] through the experts; returns [B, S, D]. `token_mask` [B, S]
        (True: a real token, False: padding) keeps padding out of the load counts the
        balancing bias follows and out of the aux loss; padding is still routed (its output
        carries no loss)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores = self.router.scores(flat)
        use_bias = self.always_use_expert_bias or self.load_balance_coeff is not None
        bias = self.expert_bias if use_bias else None
        selected = self.router.select(scores, bias)
        weights = self.router.weights(scores, selected)
        # Every routed copy, counted into a fixed [n_experts]: bincount's size depends on the
        # data, which fake tensors (the planner's memory measurement) cannot follow.
        routed_to = selected.flatten()
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=routed_to.device).scatter_add_(
            0, routed_to, torch.ones_like(routed_to))
        if token_mask is None:
            self._record(counts, scores.sum(0))
        else:
            # Weights instead of boolean indexing: shapes stay static (torch.compile).
            real = token_mask.reshape(-1, 1).to(scores.dtype)
            real_counts = torch.zeros(self.n_experts, dtype=scores.dtype, device=scores.device).scatter_add_(
                0, selected.flatten(), real.expand_as(selected).flatten())
            self._record(real_counts, (scores * real).sum(0))
        if self.aux_loss_kind == "sequence":
            self._record_sequence_loss(scores, selected, token_mask, rows=shape[0])
        # Token copies in expert order; a stable sort keeps token order within an expert.
        order = torch.argsort(selected.flatten(), stable=True)
        # repeat_interleave + a permutation (instead of flat[order // k]) keeps the backward
        # free of scatter-adds with repeated indices, which are nondeterministic on GPUs.
        routed = flat.repeat_interleave(self.top_k, dim=0)[order]
        out_sorted = self.experts(routed, counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        per_copy = out_sorted[inverse].view(-1, self.top_k, shape[-1])
        out = (per_copy * weights.unsqueeze(-1).to(per_copy.dtype)).sum(dim=1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)

    def _record(self, counts: torch.Tensor, score_sums: torch.Tensor) -> None:
        """Accumulate the load counts (assignments per expert of the counted tokens, `top_k`
        each) and keep the routing statistics of the auxiliary loss (with the tokens' summed
        scores per expert, `score_sums`), once per real forward."""
        # Activation checkpointing reruns this forward inside backward: count the tokens and
        # keep the statistics of the first run only. The rerun still computes them, so it
        # saves the same tensors for backward as the first run (checkpoint checks that).
        rerun = torch._C._current_graph_task_id() != -1
        if self.training and not rerun:
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        stats = None
        if self.aux_loss_kind == "switch" and self._computes_aux_loss():
            counts = counts.to(score_sums.dtype)
            if self.sequence_sum is not None:  # one collective for both
                summed = self.sequence_sum(torch.cat([score_sums, counts]))
                score_sums, counts = summed[: self.n_experts], summed[self.n_experts :]
            # Every counted token made top_k assignments: the count comes from the device's
            # tensors (a tensor made from a Python number would be a host-to-device copy).
            stats = RoutingStatistics(counts=counts.detach(), score_sums=score_sums,
                                      tokens=counts.detach().sum() / self.top_k)
        if not rerun:
            self.routing_statistics = stats

    def _computes_aux_loss(self) -> bool:
        """A training forward with gradients of a module with an auxiliary loss."""
        return self.aux_loss_coef > 0 and self.training and torch.is_grad_enabled()

    def _record_sequence_loss(self, scores: torch.Tensor, selected: torch.Tensor, token_mask: torch.Tensor | None,
                              *, rows: int) -> None:
        """Keep DeepSeek-V3's sequence-wise balance loss of this forward (class docstring):
        `scores` [N, E] and `selected` [N, K] of the `rows` x N/rows tokens, padding
        (`token_mask` False) left out of every sum."""
        rerun = torch._C._current_graph_task_id() != -1  # activation checkpointing's recompute
        loss = None
        if self._computes_aux_loss():
            n, k = selected.shape
            real = (torch.ones(n, dtype=scores.dtype, device=scores.device) if token_mask is None
                    else token_mask.reshape(-1).to(scores.dtype))
            shares = scores / scores.sum(-1, keepdim=True)  # s_e / sum_j s_j
            share_sums = (shares * real[:, None]).view(rows, -1, self.n_experts).sum(1)  # [rows, E]
            counts = torch.zeros(rows, self.n_experts, dtype=scores.dtype, device=scores.device).scatter_add_(
                1, selected.reshape(rows, -1), real[:, None].expand(n, k).reshape(rows, -1))
            tokens = real.view(rows, -1).sum(1, keepdim=True)
            if self.sequence_sum is not None:  # the other positions of these rows (context parallel)
                summed = self.sequence_sum(torch.cat([share_sums, counts, tokens], dim=1))
                share_sums, counts, tokens = summed.split([self.n_experts, self.n_experts, 1], dim=1)
            per_token = tokens.clamp(min=1)
            fraction = counts.detach() * (self.n_experts / self.top_k) / per_token  # f_e
            per_row = (fraction * (share_sums / per_token)).sum(1)
            has_tokens = (tokens.squeeze(1) > 0).to(per_row.dtype)
            loss = self.aux_loss_coef * (per_row * has_tokens).sum() / has_tokens.sum().clamp(min=1)
        if not rerun:
            self.sequence_aux_loss = loss

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """This layer's own auxiliary loss from its last training forward (coefficient
        applied), or None: its Switch loss (a model's pools its layers instead, `moe_aux_loss`)
        or its sequence-wise loss."""
        if self.aux_loss_kind == "sequence":
            return self.sequence_aux_loss
        return None if self.routing_statistics is None else switch_loss([self])

    @torch.no_grad()
    def after_optimizer_step(self, sum_over_dp: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum this step's counts over the data-parallel ranks, move `expert_bias` toward
        uniform load (when balancing is on) and reset the counts. Collective over dp."""
        counts = self.tokens_per_expert.clone()
        counts = sum_over_dp(counts)
        self.last_tokens_per_expert.copy_(counts)
        if self.load_balance_coeff is not None:
            self.expert_bias += self.load_balance_coeff * torch.sign(counts.mean() - counts)
        self.tokens_per_expert.zero_()

    def init_weights(self, init: SeededInit, std_in: float, std_out: float) -> None:
        """Init router, experts and shared experts; zero the bias and the counts."""
        init.trunc_normal_(self.router.gate.weight, std_in)
        self.experts.init_weights(init, std_in, std_out)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init, std_in, std_out)
        for buf in (self.expert_bias, self.tokens_per_expert, self.last_tokens_per_expert):
            buf.zero_()
        self.routing_statistics = self.sequence_aux_loss = None


def moe_modules(model: nn.Module) -> Iterable[tuple[str, MoE]]:
    """(name, module) of every `MoE` inside `model`."""
    return ((name, m) for name, m in model.named_modules() if isinstance(m, MoE))


def expert_load_metrics(model: nn.Module) -> dict[str, float]:
    """Per-layer expert load of the last optimizer step, summed over data-parallel ranks:
    `moe/<layer>/imbalance` (max / mean tokens per expert; 1.0 is perfectly balanced),
    `moe/<layer>/max_load` (largest share of the layer's assignments one expert got), and
    `moe/imbalance_max` over all layers. Empty when no step has been recorded."""
    out: dict[str, float] = {}
    for name, moe in moe_modules(model):
        counts = moe.last_tokens_per_expert.float()
        total = float(counts.sum())
        if total == 0:
            continue
        layer = name.removesuffix(".moe").removesuffix(".mlp").removesuffix(".feed_forward")
        out[f"moe/{layer}/imbalance"] = float(counts.max()) / (total / counts.numel())
        out[f"moe/{layer}/max_load"] = float(counts.max()) / total
    return _with_imbalance_max(out)


def merge_expert_load_metrics(reports: Iterable[dict[str, float]]) -> dict[str, float]:
    """One record from the `expert_load_metrics` of several parts of a model (the pipeline
    stages on this rank and on the other pipeline ranks): their per-layer figures, and
    `moe/imbalance_max` over all of their layers."""
    out: dict[str, float] = {}
    for report in reports:
        out.update((k, v) for k, v in report.items() if k != "moe/imbalance_max")
    return _with_imbalance_max(out)


def _with_imbalance_max(per_layer: dict[str, float]) -> dict[str, float]:
    if per_layer:
        per_layer["moe/imbalance_max"] = max(v for k, v in per_layer.items() if k.endswith("/imbalance"))
    return per_layer


def inactive_expert_params(model: nn.Module) -> int:
    """Parameters of the routed experts a token is not sent to, summed over `model`'s MoE
    layers (what separates its total from its active parameter count)."""
    inactive = 0
    for _, moe in moe_modules(model):
        per_expert = sum(w.numel() for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3)) // moe.n_experts
        inactive += per_expert * (moe.n_experts - moe.top_k)
    return inactive


def switch_loss(layers: list[MoE]) -> torch.Tensor:
    """coef * E * sum_e f_e * P_e over the pooled routing statistics of `layers` (each with
    statistics, all of one coefficient and expert count): f_e is the assignments to expert e
    per counted row and P_e the mean router probability of e, rows counted once per layer.
    This is Hugging Face transformers' `load_balancing_loss_func` for the router logits of
    several layers: it sums the layers' counts and probabilities before the product."""
    coefs = {(m.aux_loss_coef, m.n_experts) for m in layers}
    if len(coefs) != 1:
        raise ValueError(f"MoE layers with different auxiliary-loss coefficients or expert counts {sorted(coefs)} "
                         "cannot share one balancing loss")
    coef, n_experts = coefs.pop()
    stats = [m.routing_statistics for m in layers]
    counts = torch.stack([s.counts for s in stats]).sum(0)
    score_sums = torch.stack([s.score_sums for s in stats]).sum(0)
    rows = torch.stack([s.tokens for s in stats]).sum().clamp(min=1)
    return coef * n_experts * ((counts / rows) * (score_sums / rows)).sum()


def moe_aux_loss(model: nn.Module, moe_layers_in_model: int | None = None) -> torch.Tensor | None:
    """The balancing loss of `model`'s last training forward, None when no layer has one:
    the Switch loss pooled over the routing statistics of all its MoE layers (`switch_loss`,
    transformers' definition of `router_aux_loss_coef`), plus the sum of the layers'
    sequence-wise losses (DeepSeek-V3's, each layer's its own).

    `moe_layers_in_model`: the MoE layer count of the whole model when `model` is one
    pipeline stage of it. A stage pools its own layers (the others run on other ranks, later)
    and its Switch loss is weighted by its share of the layers, so that the stages' losses
    add up to the whole model's when their layers route alike; in general the sum differs
    from the whole model's by the correlation of the stages' statistics. Sequence-wise
    losses add up across stages exactly."""
    modules = [m for _, m in moe_modules(model)]
    terms = []
    pooled = [m for m in modules if m.routing_statistics is not None]
    if pooled:
        loss = switch_loss(pooled)
        if moe_layers_in_model is not None and len(pooled) != moe_layers_in_model:
            loss = loss * (len(pooled) / moe_layers_in_model)
        terms.append(loss)
    terms += [m.sequence_aux_loss for m in modules if m.sequence_aux_loss is not None]
    return torch.stack(terms).sum() if terms else None


class MoEModelReports:
    """What the training engine reads off an MoE model (`titan.train.model_spec`'s
    `ReportsExpertLoad` and `HasAuxLoss`), the same for every MoE family: mixed into the
    family's model class (an `nn.Module`)."""

    def expert_load(self) -> dict[str, float]:
        """Per-layer expert load of the last optimizer step (summed over data-parallel ranks):
        `moe/layers.<i>/imbalance` (max / mean tokens per expert), `.../max_load` and
        `moe/imbalance_max`; see `expert_load_metrics`."""
        return expert_load_metrics(self)

    def merge_expert_load(self, reports: list[dict[str, float]]) -> dict[str, float]:
        """One record from the `expert_load()` of several parts of this model (pipeline
        stages); see `merge_expert_load_metrics`."""
        return merge_expert_load_metrics(reports)

    @property
    def aux_loss_pools_layers(self) -> bool:
        """Whether the auxiliary loss pools statistics over layers (the Switch loss as
        transformers computes it), so that a pipeline stage's share only approximates it."""
        return any(m.aux_loss_coef > 0 and m.aux_loss_kind == "switch" for _, m in moe_modules(self))

    def aux_loss(self) -> torch.Tensor | None:
        """The routers' auxiliary loss of the last training forward (coefficient applied),
        pooled over the MoE layers this model (or pipeline stage) holds, or None when no
        layer has one (balancing by the selection bias alone); see `moe_aux_loss`."""
        args = self.args
        in_model = sum(1 for i in range(args.n_layers) if args.is_moe_layer(i))
        return moe_aux_loss(self, moe_layers_in_model=in_model)

