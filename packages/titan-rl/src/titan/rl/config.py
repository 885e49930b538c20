"""The RL run's config tree: the shared training sections plus ``--rl.*``, ``--sampling.*``,
``--rl_data.*`` and ``--generator.*``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titan.rl.advantages import ESTIMATORS
from titan.rl.data import RLDataConfig
from titan.rl.generate.base import SamplingConfig
from titan.rl.losses import DEFAULT_CLIP, KL_ESTIMATORS, LOSS_TYPES, SAPO_TEMPERATURES
from titan.rl.rewards import REWARD_NAMES, reward_labels
from titan.train.config import RunConfig, TrainingConfig


@dataclass(kw_only=True)
class RLSection:
    """``--rl.*``: the algorithm (group size, loss, clipping, KL, staleness, rewards)."""

    prompts_per_step: int = 8
    """Prompts per step over all data-parallel ranks; each gets --rl.group_size completions."""
    group_size: int = 8
    """Completions per prompt (G): advantages compare a completion with its group."""
    loss_type: Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo", "luspo", "sapo"] = "grpo"
    """grpo: per-completion token mean; dapo: asymmetric clip, every token weighs the same;
    dr_grpo: no length or std normalization; gspo: sequence-level importance ratio; cispo
    (MiniMax-M1): the importance weight is clipped, never the token's update; luspo: gspo with
    each sequence weighed by its length; sapo: a soft gate instead of the hard clip
    (--rl.sapo_temperature_pos/neg)."""
    clip_eps_low: float | None = None
    """Lower clip of the ratio (1 - eps_low; 1: no lower bound); None: the loss type's default
    (0.2; 3e-4 for gspo; 2e-3 for luspo; 1 for cispo). sapo has no clip."""
    clip_eps_high: float | None = None
    """Upper clip of the ratio (1 + eps_high); None: the loss type's default (0.2; 0.28 for dapo
    and cispo; 4e-4 for gspo; 2.5e-3 for luspo). sapo has no clip."""
    sapo_temperature_pos: float = SAPO_TEMPERATURES[0]
    """sapo's gate temperature for tokens with a positive advantage (TRL's
    sapo_temperature_pos): larger fades a token's gradient faster as its ratio leaves 1."""
    sapo_temperature_neg: float = SAPO_TEMPERATURES[1]
    """sapo's gate temperature for the other tokens (TRL's sapo_temperature_neg)."""
    dual_clip: float = 0.0
    """Dual-clip PPO (verl's clip_ratio_c, TRL's delta): a token with a negative advantage whose
    ratio exceeds this adds no gradient, its loss held at -dual_clip x A; must exceed 1 +
    eps_high; 0: off. Not read by cispo (its weight is clipped already)."""
    old_logprobs: Literal["trainer", "generator"] = "trainer"
    """What the PPO ratio pi/pi_old is taken against. trainer: the trainer's own log-probs of
    the rollout before its first update (the detached current ones when a single update uses
    the rollout, a forward pass over the rollout otherwise), and the trainer/generator
    mismatch is corrected by a detached importance weight (--rl.is_level); generator (verl's
    bypass mode): the generator's log-probs, the ratio itself is capped by --rl.is_cap."""
    is_level: Literal["token", "sequence", "off"] = "token"
    """Importance correction of the trainer/generator mismatch: token: a weight
    pi_old/pi_generator per token; sequence: their product over the completion (trainer
    mode only); off: none."""
    is_cap: float = 2.0
    """Truncated importance sampling: the weight is min(w, is_cap) (0: no cap). In generator
    (bypass) mode it caps the value of the PPO ratio's unclipped branch."""
    is_mask_low: float = 0.0
    """Masked importance sampling: tokens (sequences) whose raw weight is below this get no
    loss (0: no lower bound; trainer mode only)."""
    is_mask_high: float = 0.0
    """Masked importance sampling: tokens (sequences) whose raw weight is above this get no
    loss (0: no upper bound; trainer mode only)."""
    ppo_epochs: int = 1
    """Passes over each rollout; every pass takes --rl.minibatches_per_rollout optimizer steps."""
    minibatches_per_rollout: int = 1
    """Optimizer steps per pass over a rollout (its rows split into this many minibatches, in
    the same order every pass); at most --rl.group_size."""
    advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"] = "grpo"
    """grpo: reward minus the group mean (divided by the group std, --rl.normalize_std);
    rloo: reward minus the mean of the other completions of the group (never std-divided);
    reinforce_plus_plus (verl's name): each token's return (the reward at the end, less the
    KL in the reward after it, discounted by --rl.gamma) whitened over every token of the
    rollout, no group baseline; reinforce_plus_plus_baseline: the reward less its group mean,
    whitened over the rollout's tokens; gae (PPO with a critic, verl's gae): a value model
    trained beside the policy gives each token a baseline, the advantages are GAE's
    (--rl.gamma, --rl.gae_lambda) whitened over the rollout's tokens (--rl.critic_lr,
    --rl.value_clip, --rl.critic_model)."""
    normalize_std: bool | None = None
    """Divide advantages by their group's std; None: on, except for dr_grpo and rloo."""
    advantage_std: Literal["population", "sample"] = "population"
    """The group std advantages are divided by: population (divide by G) or sample (by G - 1,
    torch.std's default, which TRL and verl use)."""
    advantage_std_scope: Literal["group", "batch"] = "group"
    """Which rewards that std is taken over: group (each prompt's own completions) or batch
    (every reward of the rollout, TRL's scale_rewards="batch")."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """How several --rl.rewards become one advantage (TRL's multi_objective_aggregation).
    sum_then_normalize: the weighted sum's group advantage; normalize_then_sum (GDPO): each
    reward normalized within its group first (so a reward with a wide spread cannot drown the
    others), summed with --rl.reward_weights, the sum normalized over the groups that train."""
    drop_zero_variance: bool = True
    """Leave out groups whose completions all got the same reward (no signal against their
    group). reinforce_plus_plus has no group baseline: there such a group still has a signal
    against the rest of the rollout; --rl.no_drop_zero_variance keeps it (verl does not drop)."""
    max_refill_rounds: int = 0
    """DAPO's dynamic sampling: when groups are dropped for zero variance, generate up to this
    many more rounds of --rl.prompts_per_step fresh prompts to fill the step with groups that
    have variance (the bound on extra generation); 0: dropped groups are not replaced."""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong punishment: completions longer than --sampling.max_new_tokens
    minus this many tokens get a penalty growing linearly to -overlong_penalty_factor at the
    budget, added to their reward; 0: off."""
    overlong_penalty_factor: float = 1.0
    """The soft overlong penalty at the full budget (see --rl.overlong_buffer_len)."""
    mask_truncated: bool = False
    """No loss on completions that hit --sampling.max_new_tokens (finish_reason "length")."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to a frozen reference: the weights the run's RL phase started
    from (after the warm-up or the initial load), saved in every checkpoint so a resumed run
    keeps it; 0: off."""
    teacher_model: str | None = None
    """A teacher as the KL reference in place of the weights RL starts from: a Hugging Face
    folder or Hub id of the policy's model family (any size) over the same tokenizer (TRL's
    ``teacher_model_name_or_path``). With ``--rl.kl_in_reward_coef 1 --rl.advantage_estimator
    reinforce_plus_plus --rl.gamma 0`` each token's advantage is its reverse KL to the teacher
    (on-policy distillation); with --rl.kl_coef the KL term of the loss pulls toward it. Loaded
    once per run (a resumed run reads it again), frozen, not checkpointed."""
    ref_sync_steps: int = 0
    """Move the KL reference toward the policy every this many optimizer steps (TRL's
    sync_ref_model / ref_model_sync_steps, after TR-DPO): reference = alpha x policy +
    (1 - alpha) x reference, alpha --rl.ref_mixup_alpha; 0: the reference stays frozen."""
    ref_mixup_alpha: float = 0.6
    """The policy's share of the reference at each --rl.ref_sync_steps (1: the reference
    becomes the policy)."""
    kl_in_reward_coef: float = 0.0
    """verl's KL in the reward (algorithm.use_kl_in_reward with kl_ctrl.kl_coef): each
    completion's reward loses this times its summed per-token KL to the frozen reference
    (the generator's log-probs against the reference's), per token under reinforce_plus_plus;
    0: off. Independent of --rl.kl_coef (the KL term of the loss)."""
    kl_in_reward_estimator: Literal["k1", "k2", "k3"] = "k1"
    """The per-token KL estimator of --rl.kl_in_reward_coef (verl's algorithm.kl_penalty: kl is
    k1, mse k2, low_var_kl k3)."""
    kl_in_reward_target: float | None = None
    """Adapt --rl.kl_in_reward_coef (its starting value) after every rollout toward this KL
    (Ziegler et al.'s adaptive controller: verl's kl_ctrl.type adaptive with kl_ctrl.target_kl,
    OpenRLHF's --kl_target): the rollout's KL to the reference, each completion's per-token mean
    of --rl.kl_in_reward_estimator averaged over the completions, against this target; the
    coefficient is checkpointed and logged (kl_in_reward_coef). None: a fixed coefficient."""
    kl_in_reward_horizon: int = 10000
    """The adaptive controller's horizon (verl's kl_ctrl.horizon, OpenRLHF's --kl_horizon): a
    rollout of n completions moves the coefficient by at most 20% x n / horizon."""
    gamma: float = 1.0
    """reinforce_plus_plus's and gae's discount of a token's return per token (verl's
    algorithm.gamma); 0: each token's return is its own reward (its KL penalty; the outcome on
    the last token), as on-policy distillation takes it."""
    gae_lambda: float = 1.0
    """gae: GAE's lambda (verl's algorithm.lam): 1, each token's advantage is its return less
    the critic's value; 0, the one-step TD error."""
    critic_lr: float = 1e-5
    """gae: the critic's AdamW learning rate (verl's critic.optim.lr), constant after
    --rl.critic_lr_warmup_steps."""
    critic_lr_warmup_steps: int = 0
    """gae: the critic's optimizer steps of linear warmup to --rl.critic_lr (verl's
    critic.optim.lr_warmup_steps), from critic_lr / N at its first step; every critic step
    counts (its --rl.critic_warmup rollouts, each of --rl.critic_epochs passes), and a resume
    continues where it was. Logged as ``value_lr``."""
    value_clip: float = 0.5
    """gae: how far an update may move a value from the one the rollout was scored with before
    the clipped value loss takes over (verl's critic.cliprange_value)."""
    critic_model: str | None = None
    """gae: start the critic from this reward model (a Hugging Face ...ForSequenceClassification
    folder or Hub id of the policy's family, any size over the policy's tokenizer, one label;
    OpenRLHF's critic_pretrain), its architecture and weights, in place of the policy's weights
    RL starts from with a fresh score head."""
    critic_epochs: int | None = None
    """gae: passes of the critic over each rollout's minibatches, one optimizer step per
    minibatch and pass (verl's critic.ppo_epochs); None: --rl.ppo_epochs, as the policy."""
    critic_warmup: int = 0
    """gae: rollouts the critic trains on before the policy's first update (verl's
    trainer.critic_warmup), so a fresh score head is a baseline before it weighs advantages.
    The policy does not move on them and they come on top of --training.steps (titan's steps
    count policy updates); each is logged as a ``critic_warmup`` record."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: k1 log(p/q), k2 (log(p/q))^2/2, k3 q/p - 1 - log(q/p)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (0: the entropy is only logged)."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's off-policy sequence masking (TRL's off_policy_mask_threshold): a
    completion with a negative advantage whose tokens the generator found, on average, more
    than this many nats per token likelier than the policy being trained does, trains no policy
    term (the KL term keeps it). None: off."""
    kl_bias_correction: bool = False
    """DeepSeek-V3.2's unbiased KL estimate (TRL's use_bias_correction_kl): each token's KL
    estimate is weighted by its ratio to the policy it was sampled from (the PPO ratio's
    denominator), with its gradient. Needs --rl.kl_coef."""
    adaptive_entropy: bool = False
    """Adaptive entropy control (TRL's use_adaptive_entropy): after every optimizer step the
    entropy bonus's coefficient (starting at --rl.entropy_coef) rises by --rl.entropy_coef_delta
    when the step's mean token entropy is at or below --rl.entropy_target and falls by it
    otherwise, within [--rl.entropy_coef_min, --rl.entropy_coef_max]; checkpointed; logged as
    entropy_coef."""
    entropy_target: float = 0.2
    """The mean token entropy (nats) --rl.adaptive_entropy holds the policy at or above."""
    entropy_coef_delta: float = 0.005
    """The step of --rl.adaptive_entropy's coefficient per optimizer step."""
    entropy_coef_min: float = 0.0
    """The lowest coefficient --rl.adaptive_entropy moves to."""
    entropy_coef_max: float = 1.0
    """The highest coefficient --rl.adaptive_entropy moves to."""
    padding_free: bool = False
    """Pack several completions into each training row (best-fit decreasing, each its own
    document: attention and positions stay inside it), instead of one per row padded to
    --training.seq_len (TRL's padding_free, verl's use_remove_padding): fewer rows to run for
    the same tokens; the loss is the same up to float summation order. --training.local_batch_size
    counts packed rows. Sequence-level terms (gspo, luspo, --rl.is_level sequence,
    --rl.off_policy_mask_threshold) sum over each completion's own document."""
    top_entropy_quantile: float = 1.0
    """The share of completion tokens that carry the policy gradient: the rollout's tokens whose
    entropy under the policy before the update is in this top fraction (TRL's
    top_entropy_quantile; 0.2 in "Beyond the 80/20 Rule", Wang et al. 2025). The cut is taken
    over every loss token of the rollout on every rank, so it does not depend on the layout or
    microbatching; KL and entropy terms keep every token. Below 1 the rollout takes one more
    no-grad forward pass (unless --rl.ppo_epochs/--rl.minibatches_per_rollout already make
    one); 1: every token (off)."""
    max_logprob_diff: float = 0.5
    """Warn when an on-policy step's largest |trainer - generator| token log-prob difference
    (``logprob_diff_max``) exceeds this: the trainer and the generator then compute different
    models (a weight or buffer that did not sync, a kernel mismatch). In fp32 they agree to
    ~1e-5; bf16 training legitimately reaches ~0.1. 0: never warn."""
    max_policy_staleness: int = 0
    """0: on-policy (generate with the current weights, then train). k >= 1: generation of the
    next rollout overlaps training, on weights at most k versions old (synced when needed)."""
    generator_ranks: int = 0
    """0: colocated (the trainer's rank 0 generates every rollout for all trainer ranks).
    N >= 1: disaggregated: the launch's last N ranks generate (each its share of a rollout's
    prompts, with its own model copy) and the engine spans the other ranks; weights reach them
    by broadcast after each update, with a checksum of every tensor."""
    colocated_generation: Literal["rank0", "every_rank"] = "rank0"
    """Who generates a colocated run's rollouts (--rl.generator_ranks 0). rank0: the trainer's
    rank 0, every rollout for all ranks (the rollouts do not depend on the layout: a 1-rank and
    an 8-rank run generate the same). every_rank: each trainer rank holds a generator (and the
    KL reference) and generates and scores its contiguous share of each rollout's prompts and
    held-out prompts, the shares gathered on every rank (as TRL's colocate mode and verl do):
    N times the generation throughput on N ranks, and the rollouts equal those of N generator
    ranks (--rl.generator_ranks N)."""
    generator_timeout_s: float = 1800.0
    """Disaggregated runs: how long a generator rank waits for the trainer's next command (the
    trainer may be training, evaluating or saving meanwhile), and any collective between them."""
    sft_warmup_steps: int = 0
    """Optimizer steps of supervised fine-tuning on the synthetic task (its answers) before RL
    starts; counted in --training.steps."""
    rewards: tuple[str, ...] = ("exact_match",)
    """Rewards summed into each completion's reward (exact_match, char_match, numeric,
    format, math_verify, function)."""
    reward_weights: tuple[float, ...] = ()
    """One weight per --rl.rewards entry (empty: 1 each)."""
    format_regex: str | None = None
    """The regex of the format reward (re.fullmatch over the completion)."""
    reward_function: str | None = None
    """The function reward: package.module:function(prompt=, completion=, answer=) -> float."""
    reward_model: str | None = None
    """The model reward (--rl.rewards model): a Hugging Face sequence-classification model
    folder or Hub id with its tokenizer, scoring prompt + completion by its one logit (TRL's
    reward model). One of the policy's family runs on titan's model code; any other
    architecture on transformers (the titan-rl[reward-model] extra)."""
    reward_model_batch_size: int = 32
    """Completions the reward model scores per forward pass."""
    numeric_tolerance: float = 1e-6
    """Tolerance of the numeric reward."""
    reward_timeout_s: float = 10.0
    """Seconds one reward call may take, in any thread (0: no limit); a call that times out
    scores 0 for that reward and is counted in the metrics' reward_timeouts."""
    log_completions: bool = False
    """Append every completion of every rollout to <dump_folder>/completions.jsonl (rank 0): its
    step, rollout, group, prompt, reference answer, completion text, reward, advantage, whether
    it trained, length and finish reason (TRL's log_completions; verl's rollout_data_dir)."""
    num_completions_to_print: int = 0
    """At each logged step, print this many of the rollout's completions (prompt, completion,
    reward, advantage) to the log; 0: none."""
    eval_freq: int = 0
    """Score greedy completions of the held-out prompts every this many steps (and at the first
    RL step and the last step); 0: never."""
    eval_prompts: int = 32
    """How many held-out prompts to score."""

    def __post_init__(self) -> None:
        for flag in ("prompts_per_step", "group_size", "eval_prompts", "ppo_epochs", "minibatches_per_rollout"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--rl.{flag} must be >= 1, got {getattr(self, flag)}")
        for flag in ("max_policy_staleness", "sft_warmup_steps", "eval_freq", "max_refill_rounds",
                     "overlong_buffer_len", "generator_ranks", "num_completions_to_print", "ref_sync_steps"):
            if getattr(self, flag) < 0:
                raise ValueError(f"--rl.{flag} must be >= 0, got {getattr(self, flag)}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"--rl.loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"--rl.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        if self.clip_eps_low is not None and not 0 <= self.clip_eps_low <= 1:
            raise ValueError(f"--rl.clip_eps_low must be in [0, 1] (1: no lower bound), got {self.clip_eps_low}")
        self._check_sapo()
        if self.dual_clip:
            if self.loss_type == "cispo":
                raise ValueError("--rl.dual_clip bounds the PPO surrogate; cispo clips its weight at 1 + "
                                 "--rl.clip_eps_high instead: drop --rl.dual_clip")
            high = DEFAULT_CLIP[self.loss_type][1] if self.clip_eps_high is None else self.clip_eps_high
            if self.dual_clip <= 1 + high:
                raise ValueError(f"--rl.dual_clip {self.dual_clip} must exceed 1 + --rl.clip_eps_high ({1 + high:g}) "
                                 "(verl's default is 3), or be 0 (off)")
        if self.loss_type == "cispo" and self.old_logprobs == "generator" and self.is_cap:
            raise ValueError("--rl.old_logprobs generator caps the PPO ratio at --rl.is_cap; cispo clips its weight at "
                             "1 + --rl.clip_eps_high instead: set --rl.is_cap 0")
        if self.clip_eps_high is not None and self.clip_eps_high < 0:
            raise ValueError(f"--rl.clip_eps_high must be >= 0, got {self.clip_eps_high}")
        for flag in ("kl_coef", "entropy_coef", "is_cap", "dual_clip", "numeric_tolerance", "max_logprob_diff", "reward_timeout_s",
                     "overlong_penalty_factor"):
            if getattr(self, flag) < 0:
                raise ValueError(f"--rl.{flag} must be >= 0, got {getattr(self, flag)}")
        if self.is_cap and self.is_cap < 1:
            raise ValueError(f"--rl.is_cap {self.is_cap} would cap ratios below 1; use a cap >= 1, or 0 to disable")
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold < 0:
            raise ValueError(f"--rl.off_policy_mask_threshold must be >= 0 (nats per token), got "
                             f"{self.off_policy_mask_threshold}")
        if self.kl_bias_correction and not self.kl_coef:
            raise ValueError("--rl.kl_bias_correction weights the KL penalty, which this run does not have "
                             "(--rl.kl_coef 0): set --rl.kl_coef or drop the flag")
        self._check_adaptive_entropy()
        if not 0 < self.top_entropy_quantile <= 1:
            raise ValueError(f"--rl.top_entropy_quantile must be in (0, 1] (the top share of tokens by entropy that "
                             f"trains; 1: all), got {self.top_entropy_quantile}")
        if not 0 < self.ref_mixup_alpha <= 1:
            raise ValueError(f"--rl.ref_mixup_alpha must be in (0, 1], got {self.ref_mixup_alpha}")
        if self.ref_sync_steps and not self.uses_reference:
            raise ValueError(f"--rl.ref_sync_steps {self.ref_sync_steps} moves the KL reference, and this run has no KL "
                             "penalty (--rl.kl_coef and --rl.kl_in_reward_coef 0): set one or drop the flag")
        if self.teacher_model and not self.uses_reference:
            raise ValueError(f"--rl.teacher_model {self.teacher_model} is the KL reference, and this run has no KL "
                             "(--rl.kl_coef and --rl.kl_in_reward_coef 0): set one (--rl.kl_in_reward_coef for "
                             "on-policy distillation) or drop the flag")
        if self.teacher_model and self.ref_sync_steps:
            raise ValueError("--rl.ref_sync_steps moves the KL reference toward the policy, and --rl.teacher_model fixes "
                             "it to a teacher: drop one of the two")
        if not self.ref_sync_steps and self.ref_mixup_alpha != RLSection.ref_mixup_alpha:
            raise ValueError("--rl.ref_mixup_alpha is read at each --rl.ref_sync_steps, which this run does not set: "
                             "set --rl.ref_sync_steps or drop the flag")
        if self.generator_timeout_s <= 0:
            raise ValueError(f"--rl.generator_timeout_s must be > 0, got {self.generator_timeout_s}")
        if not self.generator_ranks and self.generator_timeout_s != RLSection.generator_timeout_s:
            raise ValueError(
                "--rl.generator_timeout_s bounds the waits of generator ranks, which this run does not have: "
                "set --rl.generator_ranks, or drop the flag"
            )
        if self.colocated_generation not in ("rank0", "every_rank"):
            raise ValueError(f"--rl.colocated_generation must be rank0 or every_rank, got {self.colocated_generation!r}")
        if self.generator_ranks and self.colocated_generation != "rank0":
            raise ValueError(
                f"--rl.colocated_generation {self.colocated_generation} is for colocated runs; this run's "
                f"--rl.generator_ranks {self.generator_ranks} generate instead: drop one of the two flags"
            )
        self._check_importance_sampling()
        self._check_advantages()
        if self.minibatches_per_rollout > self.group_size:
            raise ValueError(
                f"--rl.minibatches_per_rollout {self.minibatches_per_rollout} exceeds --rl.group_size "
                f"{self.group_size}: a rollout that keeps one group could not fill every minibatch"
            )
        for name in self.rewards:
            if name not in REWARD_NAMES:
                raise ValueError(f"--rl.rewards {name!r} is not a reward; choose from {', '.join(REWARD_NAMES)}")
        if ("model" in self.rewards) != bool(self.reward_model):
            raise ValueError("--rl.rewards model needs --rl.reward_model (a sequence-classification model folder or Hub "
                             "id)" if not self.reward_model else
                             f"--rl.reward_model {self.reward_model} is read by --rl.rewards model, which this run does "
                             "not name: add it (with a --rl.reward_weights entry if weighted) or drop the flag")
        if self.reward_model_batch_size < 1:
            raise ValueError(f"--rl.reward_model_batch_size must be >= 1, got {self.reward_model_batch_size}")
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise ValueError(
                f"--rl.reward_weights has {len(self.reward_weights)} values for {len(self.rewards)} "
                "--rl.rewards; give one weight per reward"
            )
        if self.reward_weights and not any(self.reward_weights) and self.drop_zero_variance:
            raise ValueError(
                "--rl.reward_weights are all 0, so every group's rewards are equal and --rl.drop_zero_variance "
                "would drop every group: add --rl.no_drop_zero_variance (on-policy distillation learns from the KL "
                "in the reward alone)"
            )

    def _check_adaptive_entropy(self) -> None:
        """The controller's flags are read only with it; its bounds must hold the start."""
        flags = ("entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max")
        if not self.adaptive_entropy:
            changed = [f"--rl.{f}" for f in flags if getattr(self, f) != getattr(RLSection, f)]
            if changed:
                raise ValueError(f"{', '.join(changed)} steer --rl.adaptive_entropy, which this run does not set: "
                                 "add --rl.adaptive_entropy or drop the flag")
            return
        for flag in flags:
            if getattr(self, flag) < 0:
                raise ValueError(f"--rl.{flag} must be >= 0, got {getattr(self, flag)}")
        if not self.entropy_coef_delta:
            raise ValueError("--rl.entropy_coef_delta 0 never moves the coefficient: give a step, or drop "
                             "--rl.adaptive_entropy")
        if not self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max:
            raise ValueError(f"--rl.entropy_coef {self.entropy_coef} is where --rl.adaptive_entropy starts; it must lie "
                             f"in [--rl.entropy_coef_min {self.entropy_coef_min}, --rl.entropy_coef_max "
                             f"{self.entropy_coef_max}]")

    def _check_sapo(self) -> None:
        """sapo's gate replaces the clip: the clip flags are refused with it, its temperatures
        without it."""
        temperatures = ("sapo_temperature_pos", "sapo_temperature_neg")
        if self.loss_type != "sapo":
            changed = [f"--rl.{f}" for f, default in zip(temperatures, SAPO_TEMPERATURES, strict=True)
                       if getattr(self, f) != default]
            if changed:
                raise ValueError(f"{' and '.join(changed)} shape the gate of --rl.loss_type sapo, and this run's "
                                 f"loss is {self.loss_type}: set --rl.loss_type sapo or drop the flag")
            return
        for flag in temperatures:
            if getattr(self, flag) <= 0:
                raise ValueError(f"--rl.{flag} must be > 0, got {getattr(self, flag)}")
        clips = [f"--rl.{f}" for f in ("clip_eps_low", "clip_eps_high") if getattr(self, f) is not None]
        clips += ["--rl.dual_clip"] if self.dual_clip else []
        clips += ["--rl.is_cap (with --rl.old_logprobs generator)"] if self.old_logprobs == "generator" and self.is_cap else []
        if clips:
            raise ValueError(f"--rl.loss_type sapo has no hard clip (its gate fades the gradient instead): drop "
                             f"{', '.join(clips)}, or tune --rl.sapo_temperature_pos/neg")

    def _check_importance_sampling(self) -> None:
        if self.old_logprobs not in ("trainer", "generator"):
            raise ValueError(f"--rl.old_logprobs must be trainer or generator, got {self.old_logprobs!r}")
        if self.is_level not in ("token", "sequence", "off"):
            raise ValueError(f"--rl.is_level must be token, sequence or off, got {self.is_level!r}")
        for flag in ("is_mask_low", "is_mask_high"):
            if getattr(self, flag) < 0:
                raise ValueError(f"--rl.{flag} must be >= 0 (0: no bound), got {getattr(self, flag)}")
        if self.is_mask_high and self.is_mask_low >= self.is_mask_high:
            raise ValueError(
                f"--rl.is_mask_low {self.is_mask_low} must be below --rl.is_mask_high {self.is_mask_high}"
            )
        if self.old_logprobs == "generator" and (self.is_level == "sequence" or self.is_mask_low or self.is_mask_high):
            raise ValueError(
                "--rl.is_level sequence and --rl.is_mask_low/high weight the trainer/generator mismatch, which "
                "needs the trainer's own old log-probs: use --rl.old_logprobs trainer"
            )

    def _check_advantages(self) -> None:
        if self.advantage_estimator not in ESTIMATORS:
            raise ValueError(f"--rl.advantage_estimator must be one of {', '.join(ESTIMATORS)}, got "
                             f"{self.advantage_estimator!r}")
        self._check_reinforce_pp()
        if self.advantage_std not in ("population", "sample"):
            raise ValueError(f"--rl.advantage_std must be population or sample, got {self.advantage_std!r}")
        if self.advantage_std_scope not in ("group", "batch"):
            raise ValueError(f"--rl.advantage_std_scope must be group or batch, got {self.advantage_std_scope!r}")
        if self.advantage_std_scope != "group" and not self.use_std:
            raise ValueError(f"--rl.advantage_std_scope {self.advantage_std_scope} sets the std advantages are divided "
                             "by, and this run divides by none (--rl.normalize_std False, dr_grpo, rloo or reinforce_plus_plus*, "
                             "which whiten over tokens): drop it")
        if self.advantage_estimator == "rloo" and self.normalize_std:
            raise ValueError("--rl.advantage_estimator rloo does not divide by a std: drop --rl.normalize_std")
        if self.group_size < 2 and self.advantage_estimator not in ("reinforce_plus_plus", "gae"):
            # Both estimators compare a completion with the rest of its group: alone in it,
            # every advantage is 0 and no step would ever change the policy.
            raise ValueError(
                f"--rl.group_size {self.group_size}: --rl.advantage_estimator {self.advantage_estimator} "
                "compares each completion with its group, so every advantage of a group of one is 0; "
                "use --rl.group_size >= 2"
            )
        if self.multi_objective_aggregation == "normalize_then_sum" and (
                not self.use_std or self.advantage_std_scope != "group"):
            raise ValueError(
                "--rl.multi_objective_aggregation normalize_then_sum divides each reward by its group std and the sum "
                "by the batch's: it cannot run with --rl.normalize_std False, dr_grpo's or rloo's default, or "
                "--rl.advantage_std_scope batch"
            )
        if self.group_size < 2 and self.drop_zero_variance:
            raise ValueError(f"--rl.group_size {self.group_size}: a group of one has no reward variance, and "
                             "--rl.drop_zero_variance would drop every group: add --rl.no_drop_zero_variance")
        if self.max_refill_rounds and not self.drop_zero_variance:
            raise ValueError(
                "--rl.max_refill_rounds replaces the groups --rl.drop_zero_variance drops; it needs "
                "--rl.drop_zero_variance"
            )

    def _check_reinforce_pp(self) -> None:
        """REINFORCE++ whitens over tokens (no group std to switch); its discount and the KL in
        the reward's estimator are read only where they apply."""
        reinforce = self.advantage_estimator.startswith("reinforce_plus_plus")
        if reinforce and self.normalize_std is not None:
            raise ValueError(f"--rl.advantage_estimator {self.advantage_estimator} whitens over the rollout's tokens, "
                             "never by a group std: drop --rl.normalize_std")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"--rl.gamma must be in [0, 1], got {self.gamma}")
        if self.gamma != 1 and self.advantage_estimator not in ("reinforce_plus_plus", "gae"):
            raise ValueError(f"--rl.gamma discounts reinforce_plus_plus's and gae's per-token returns; "
                             f"--rl.advantage_estimator {self.advantage_estimator} scores whole completions: drop it")
        self._check_critic()
        if self.kl_in_reward_coef < 0:
            raise ValueError(f"--rl.kl_in_reward_coef must be >= 0, got {self.kl_in_reward_coef}")
        if not self.kl_in_reward_coef and self.kl_in_reward_estimator != RLSection.kl_in_reward_estimator:
            raise ValueError("--rl.kl_in_reward_estimator is read with --rl.kl_in_reward_coef, which this run does not "
                             "set: set it or drop the flag")
        adaptive = self.kl_in_reward_target is not None
        if (adaptive or self.kl_in_reward_horizon != RLSection.kl_in_reward_horizon) and not self.kl_in_reward_coef:
            raise ValueError("--rl.kl_in_reward_target and --rl.kl_in_reward_horizon adapt --rl.kl_in_reward_coef, which "
                             "this run does not set (its starting value): set it or drop the flags")
        if self.kl_in_reward_horizon != RLSection.kl_in_reward_horizon and not adaptive:
            raise ValueError("--rl.kl_in_reward_horizon is read by the adaptive controller of --rl.kl_in_reward_target, "
                             "which this run does not set: set it or drop the flag")
        if adaptive and not self.kl_in_reward_target > 0:
            raise ValueError(f"--rl.kl_in_reward_target must be > 0, got {self.kl_in_reward_target}")
        if self.kl_in_reward_horizon < 1:
            raise ValueError(f"--rl.kl_in_reward_horizon must be >= 1, got {self.kl_in_reward_horizon}")

    def _check_critic(self) -> None:
        """The critic's flags are read with gae only, and must be in range."""
        gae = self.advantage_estimator == "gae"
        for flag in ("gae_lambda", "critic_lr", "critic_lr_warmup_steps", "value_clip", "critic_model", "critic_epochs",
                     "critic_warmup"):
            if not gae and getattr(self, flag) != getattr(RLSection, flag):
                raise ValueError(f"--rl.{flag} is read by the critic of --rl.advantage_estimator gae, which this run "
                                 f"does not use (it uses {self.advantage_estimator}): set gae or drop the flag")
        if gae and self.normalize_std is not None:
            raise ValueError("--rl.advantage_estimator gae whitens over the rollout's tokens, never by a group std: drop "
                             "--rl.normalize_std")
        if not 0 <= self.gae_lambda <= 1:
            raise ValueError(f"--rl.gae_lambda must be in [0, 1], got {self.gae_lambda}")
        if self.critic_epochs is not None and self.critic_epochs < 1:
            raise ValueError(f"--rl.critic_epochs must be >= 1, got {self.critic_epochs}")
        if self.critic_warmup < 0:
            raise ValueError(f"--rl.critic_warmup counts rollouts and must be >= 0, got {self.critic_warmup}")
        if self.critic_lr_warmup_steps < 0:
            raise ValueError(f"--rl.critic_lr_warmup_steps counts the critic's optimizer steps and must be >= 0, got "
                             f"{self.critic_lr_warmup_steps}")
        if self.critic_lr <= 0 or self.value_clip <= 0:
            raise ValueError(f"--rl.critic_lr and --rl.value_clip must be > 0, got {self.critic_lr} and {self.value_clip}")

    @property
    def uses_reference(self) -> bool:
        """Whether the run keeps a frozen reference policy: for the KL term of the loss or the
        KL in the reward."""
        return self.kl_coef > 0 or self.kl_in_reward_coef > 0

    @property
    def critic_passes(self) -> int:
        """The critic's passes over each rollout (--rl.critic_epochs, else --rl.ppo_epochs)."""
        return self.ppo_epochs if self.critic_epochs is None else self.critic_epochs

    @property
    def updates_per_rollout(self) -> int:
        """Optimizer steps each rollout trains (--rl.ppo_epochs x --rl.minibatches_per_rollout)."""
        return self.ppo_epochs * self.minibatches_per_rollout

    def advantage_options(self) -> dict[str, object]:
        """The keyword arguments of ``titan.rl.rollouts.completion_advantages`` (and
        ``rollout_rows``) for this run's advantage flags."""
        options: dict[str, object] = dict(
            normalize_std=self.use_std, drop_zero_variance=self.drop_zero_variance,
            estimator=self.advantage_estimator, std=self.advantage_std, std_scope=self.advantage_std_scope,
            aggregation=self.multi_objective_aggregation, kl_in_reward_coef=self.kl_in_reward_coef,
            kl_in_reward_estimator=self.kl_in_reward_estimator, gamma=self.gamma, gae_lambda=self.gae_lambda,
        )
        if self.multi_objective_aggregation == "normalize_then_sum":
            weights = self.reward_weights or (1.0,) * len(self.rewards)
            # The soft overlong penalty is a term of its own, added unweighted to the reward.
            options["term_weights"] = {**dict(zip(reward_labels(self.rewards), weights, strict=True)),
                                       "overlong_penalty": 1.0}
        return options

    @property
    def use_std(self) -> bool:
        """Whether advantages are divided by the group std (default: not for dr_grpo or rloo;
        never for reinforce_plus_plus*, which whiten over tokens)."""
        if self.advantage_estimator.startswith("reinforce_plus_plus") or self.advantage_estimator == "gae":
            return False
        if self.normalize_std is not None:
            return self.normalize_std
        return self.loss_type != "dr_grpo" and self.advantage_estimator != "rloo"


@dataclass(kw_only=True)
class GeneratorConfig:
    """``--generator.*``: which rollout backend generates completions."""

    kind: Literal["native", "vllm"] = "native"
    """native: titan's torch generator over the same model code (KV cache), on rank 0's
    device (each generator rank's with --rl.generator_ranks); vllm: vLLM running titan's model
    code in the trainer's process, one trainer rank, or in each generator rank's process (the
    titan-rl[vllm] extra; on a CPU machine vLLM's CPU build)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """vllm: the dtype vLLM runs the model in (float32 matches the trainer's log-probs
    closest; bfloat16 halves the KV cache and the weights)."""
    kv_cache_memory_bytes: int = 256 << 20
    """vllm: bytes of the paged KV cache (vLLM's own default would take most of the device's
    memory, which the colocated trainer needs)."""
    max_num_seqs: int = 256
    """vllm: the most sequences decoded together."""
    tensor_parallel_size: int = 1
    """vllm: the ranks each engine's model is sharded over (TRL's vllm_tensor_parallel_size,
    verl's rollout.tensor_model_parallel_size), for a model too large for one device's share:
    consecutive ranks of the trainer's group, N by N, run one engine together, each holding
    1/N of its weights and KV cache. Needs an engine on every rank (titan rl
    --rl.colocated_generation every_rank, titan gkd on several ranks) and a rank count it divides,
    or generator ranks (titan rl --rl.generator_ranks, a multiple of N): the engines are then
    sharded over those, verl's and OpenRLHF's layout."""

    def __post_init__(self) -> None:
        if self.kind not in ("native", "vllm"):
            raise ValueError(f"--generator.kind must be native or vllm, got {self.kind!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--generator.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"--generator.kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--generator.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--generator.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.kind == "native":
            changed = [name for name in ("dtype", "kv_cache_memory_bytes", "max_num_seqs", "tensor_parallel_size")
                       if getattr(self, name) != getattr(GeneratorConfig, name)]
            if changed:
                raise ValueError(
                    f"--generator.{changed[0]} sets up the vLLM generator; it has no effect with "
                    "--generator.kind native (which runs in the trainer's float32, without a paged cache)"
                )


def _rl_training() -> TrainingConfig:
    return TrainingConfig(document_mask=True)


@dataclass(kw_only=True)
class RLConfig(RunConfig):
    """A complete RL post-training run: the shared sections (model, engine, checkpoints...),
    the algorithm (``--rl.*``), sampling (``--sampling.*``), prompts (``--rl_data.*``) and
    the generator (``--generator.*``). Document masking is on, as in SFT."""

    training: TrainingConfig = field(default_factory=_rl_training)
    rl: RLSection = field(default_factory=RLSection)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rl_data: RLDataConfig = field(default_factory=RLDataConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt a rollout can take: the generator's context is
        ``--training.seq_len`` and every prompt leaves room for ``--sampling.max_new_tokens``."""
        return self.training.seq_len - self.sampling.max_new_tokens

    def __post_init__(self) -> None:
        if self.sampling.n not in (1, self.rl.group_size):
            raise ValueError(
                f"--sampling.n {self.sampling.n} differs from --rl.group_size {self.rl.group_size}; the group "
                "size sets the completions per prompt: leave --sampling.n at 1"
            )
        if self.validation.enable:
            raise ValueError(
                "--validation.enable scores a held-out corpus in titan train and titan sft; titan rl scores "
                "held-out prompts greedily instead (--rl.eval_freq, --rl_data.eval_path)"
            )
        if self.rl.sft_warmup_steps and self.rl_data.resolved_format != "synthetic":
            raise ValueError(
                "--rl.sft_warmup_steps trains on the synthetic task's answers; with --rl_data.format "
                "jsonl start from an SFT checkpoint instead (--checkpoint.initial_load_path)"
            )
        if self.rl.overlong_buffer_len >= self.sampling.max_new_tokens:
            raise ValueError(
                f"--rl.overlong_buffer_len {self.rl.overlong_buffer_len} must be below --sampling.max_new_tokens "
                f"{self.sampling.max_new_tokens}"
            )
        updates = self.rl.updates_per_rollout
        if (self.training.steps - self.rl.sft_warmup_steps) % updates:
            raise ValueError(
                f"--training.steps {self.training.steps} minus --rl.sft_warmup_steps {self.rl.sft_warmup_steps} is "
                f"not a multiple of the {updates} optimizer steps each rollout trains (--rl.ppo_epochs x "
                "--rl.minibatches_per_rollout)"
            )
        if self.rl.generator_ranks % self.generator.tensor_parallel_size:
            raise ValueError(
                f"--generator.tensor_parallel_size {self.generator.tensor_parallel_size} must divide --rl.generator_ranks "
                f"{self.rl.generator_ranks} (N consecutive generator ranks run one vLLM engine together)"
            )
        if self.generator.tensor_parallel_size > 1 and self.rl.max_refill_rounds:
            raise ValueError(
                "--rl.max_refill_rounds refills each rank's share on its own, as often as it needs, and the ranks "
                "sharing a vLLM engine (--generator.tensor_parallel_size) must generate together: drop one of the two"
            )
        if self.rl.sft_warmup_steps >= self.training.steps:
            raise ValueError(
                f"--rl.sft_warmup_steps {self.rl.sft_warmup_steps} leaves no RL steps of --training.steps "
                f"{self.training.steps}; raise --training.steps"
            )
