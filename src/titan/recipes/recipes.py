"""Named training configurations.

A recipe is a function returning a complete ``TrainerConfig``; recipes compose by calling
shared helpers and each other. ``titan train --config <name>`` starts from one and applies
``--section.field`` overrides on top.
"""

from __future__ import annotations

from collections.abc import Callable

from titan.rl.config import RLConfig
from titan.rl.dpo import DPOConfig
from titan.rl.gkd import GKDConfig
from titan.rl.kto import KTOConfig
from titan.rl.reward_trainer import RewardConfig
from titan.train.config import TrainerConfig
from titan.train.sft import SFTConfig


def pretrain_defaults(*, flavor: str, seq_len: int, steps: int, lr: float, warmup_steps: int) -> TrainerConfig:
    """A Llama 3 pretraining config with the settings every size shares."""
    cfg = TrainerConfig()
    cfg.model.name = "llama3"
    cfg.model.flavor = flavor
    cfg.training.seq_len = seq_len
    cfg.training.steps = steps
    cfg.optimizer.lr = lr
    cfg.lr_scheduler.warmup_steps = warmup_steps
    cfg.lr_scheduler.decay_ratio = 0.2
    return cfg


def on_gpu_cluster(cfg: TrainerConfig, *, dataset: str, tokenizer_path: str) -> TrainerConfig:
    """Settings for real hardware: bf16 FSDP compute, a hub dataset (streamed: nothing is
    downloaded before the first step), the model's tokenizer."""
    cfg.training.mixed_precision_param = "bfloat16"
    cfg.dataset.name = dataset
    cfg.dataset.streaming = True
    cfg.tokenizer.kind = "hf"
    cfg.tokenizer.path = tokenizer_path
    cfg.model.vocab_multiple_of = 1  # the published vocab is already TP-friendly
    cfg.metrics.log_freq = 10
    cfg.checkpoint.interval = 500
    return cfg


def llama3_debug() -> TrainerConfig:
    """The debug model on CPU: trains in a few minutes on the Python standard library's own
    source (byte-level), no download."""
    cfg = pretrain_defaults(flavor="debugmodel", seq_len=128, steps=300, lr=2e-3, warmup_steps=20)
    cfg.training.local_batch_size = 8
    cfg.dataset.name = "stdlib"
    cfg.tokenizer.kind = "byte"
    cfg.metrics.log_freq = 10
    cfg.job.dump_folder = "./outputs/llama3_debug"
    return cfg


def llama3_debug_synthetic() -> TrainerConfig:
    """The debug model on the seeded synthetic corpus whose entropy floor is known."""
    cfg = llama3_debug()
    cfg.dataset.name = "synthetic"
    cfg.job.dump_folder = "./outputs/llama3_debug_synthetic"
    return cfg


def llama3_1b() -> TrainerConfig:
    """Llama 3.2 1B on 8 GPUs with FSDP."""
    cfg = pretrain_defaults(flavor="1B", seq_len=8192, steps=10_000, lr=3e-4, warmup_steps=200)
    cfg = on_gpu_cluster(cfg, dataset="allenai/c4", tokenizer_path="./assets/llama3/tokenizer.json")
    cfg.training.local_batch_size = 1
    cfg.job.dump_folder = "./outputs/llama3_1b"
    return cfg


def llama3_8b() -> TrainerConfig:
    """Llama 3.1 8B on 8+ GPUs: FSDP with selective activation checkpointing."""
    cfg = pretrain_defaults(flavor="8B", seq_len=8192, steps=10_000, lr=3e-4, warmup_steps=200)
    cfg = on_gpu_cluster(cfg, dataset="allenai/c4", tokenizer_path="./assets/llama3/tokenizer.json")
    cfg.training.local_batch_size = 1
    # Per-op selective AC (matmul outputs kept, the cheap ops rerun), as torchtitan's 8B recipe;
    # "selective" alone would checkpoint every second block whole (torchtitan's default).
    cfg.activation_checkpoint.mode = "selective"
    cfg.activation_checkpoint.selective_op = True
    cfg.job.dump_folder = "./outputs/llama3_8b"
    return cfg


def llama3_70b() -> TrainerConfig:
    """Llama 3.1 70B on 64+ GPUs: FSDP x TP 8 with full activation checkpointing."""
    cfg = llama3_8b()
    cfg.model.flavor = "70B"
    cfg.optimizer.lr = 1.5e-4
    cfg.parallelism.tensor_parallel_degree = 8
    cfg.parallelism.enable_sequence_parallel = True
    cfg.activation_checkpoint.mode = "full"
    cfg.activation_checkpoint.selective_op = False
    cfg.job.dump_folder = "./outputs/llama3_70b"
    return cfg


def llama3_405b() -> TrainerConfig:
    """Llama 3.1 405B on 512+ GPUs: FSDP x TP 8 x PP 8."""
    cfg = llama3_70b()
    cfg.model.flavor = "405B"
    cfg.optimizer.lr = 8e-5
    cfg.parallelism.pipeline_parallel_degree = 8
    cfg.parallelism.pipeline_parallel_schedule = "Interleaved1F1B"
    cfg.training.local_batch_size = 8
    cfg.job.dump_folder = "./outputs/llama3_405b"
    return cfg


QWEN3_VOCAB = 151936
"""Rows of the released Qwen3 embedding/output matrices (more than the tokenizer's tokens)."""


def qwen3_debug() -> TrainerConfig:
    """The Qwen3 debug model (QK norm, tied embeddings) on CPU: trains in a few minutes on the
    Python standard library's own source (byte-level), no download."""
    cfg = llama3_debug()
    cfg.model.name = "qwen3"
    cfg.job.dump_folder = "./outputs/qwen3_debug"
    return cfg


def qwen3_sized(flavor: str, *, lr: float = 3e-4) -> TrainerConfig:
    """A published Qwen3 dense size on GPUs with FSDP and selective activation checkpointing
    (4k context; the release's 32k native context fits with `--training.seq_len`)."""
    cfg = pretrain_defaults(flavor=flavor, seq_len=4096, steps=10_000, lr=lr, warmup_steps=200)
    cfg = on_gpu_cluster(cfg, dataset="allenai/c4", tokenizer_path="./assets/qwen3/tokenizer.json")
    cfg.model.name = "qwen3"
    cfg.model.vocab_size = QWEN3_VOCAB
    cfg.training.local_batch_size = 2
    cfg.activation_checkpoint.mode = "selective"
    cfg.activation_checkpoint.selective_op = True  # per op, as llama3_8b
    cfg.job.dump_folder = f"./outputs/qwen3_{flavor.lower().replace('.', '_')}"
    return cfg


def qwen3_0_6b() -> TrainerConfig:
    """Qwen3 0.6B (tied embeddings) on 8 GPUs with FSDP."""
    cfg = qwen3_sized("0.6B", lr=6e-4)
    cfg.activation_checkpoint.mode = "none"
    return cfg


def qwen3_1_7b() -> TrainerConfig:
    """Qwen3 1.7B (tied embeddings) on 8 GPUs with FSDP."""
    return qwen3_sized("1.7B", lr=4e-4)


def qwen3_4b() -> TrainerConfig:
    """Qwen3 4B (tied embeddings) on 8 GPUs with FSDP."""
    return qwen3_sized("4B")


def qwen3_8b() -> TrainerConfig:
    """Qwen3 8B on 8+ GPUs: FSDP with selective activation checkpointing."""
    return qwen3_sized("8B")


def qwen3_14b() -> TrainerConfig:
    """Qwen3 14B on 16+ GPUs: FSDP x TP 2 (with SP) and full activation checkpointing."""
    cfg = qwen3_sized("14B", lr=2e-4)
    cfg.parallelism.tensor_parallel_degree = 2
    cfg.parallelism.enable_sequence_parallel = True
    cfg.activation_checkpoint.mode = "full"
    return cfg


def qwen3_32b() -> TrainerConfig:
    """Qwen3 32B on 32+ GPUs: FSDP x TP 8 (with SP) and full activation checkpointing."""
    cfg = qwen3_14b()
    cfg.model.flavor = "32B"
    cfg.optimizer.lr = 1.5e-4
    cfg.parallelism.tensor_parallel_degree = 8
    cfg.job.dump_folder = "./outputs/qwen3_32b"
    return cfg


def qwen3_moe_debug() -> TrainerConfig:
    """The Qwen3-MoE debug model (8 experts, top-2, load-balancing bias) on CPU: trains in a
    few minutes on the Python standard library's own source (byte-level), no download.
    Add `--parallelism.expert_parallel_degree 2` under `NGPU=4` for expert parallel."""
    cfg = llama3_debug()
    cfg.model.name = "qwen3_moe"
    cfg.job.dump_folder = "./outputs/qwen3_moe_debug"
    return cfg


def qwen3_moe_30b_a3b() -> TrainerConfig:
    """Qwen3-30B-A3B on 8+ GPUs: FSDP, the 128 experts split 8 ways (EP 8), full activation
    checkpointing."""
    cfg = pretrain_defaults(flavor="30B-A3B", seq_len=4096, steps=10_000, lr=3e-4, warmup_steps=200)
    cfg = on_gpu_cluster(cfg, dataset="allenai/c4", tokenizer_path="./assets/qwen3/tokenizer.json")
    cfg.model.name = "qwen3_moe"
    cfg.model.vocab_size = QWEN3_VOCAB
    cfg.training.local_batch_size = 2
    cfg.parallelism.expert_parallel_degree = 8
    cfg.activation_checkpoint.mode = "full"
    cfg.job.dump_folder = "./outputs/qwen3_moe_30b_a3b"
    return cfg


def qwen3_moe_235b_a22b() -> TrainerConfig:
    """Qwen3-235B-A22B on 128+ GPUs: FSDP, EP 32 (4 experts per rank), full activation
    checkpointing."""
    cfg = qwen3_moe_30b_a3b()
    cfg.model.flavor = "235B-A22B"
    cfg.optimizer.lr = 1.5e-4
    cfg.training.local_batch_size = 1
    cfg.parallelism.expert_parallel_degree = 32
    cfg.job.dump_folder = "./outputs/qwen3_moe_235b_a22b"
    return cfg


def deepseek_v3_debug() -> TrainerConfig:
    """The DeepSeek-V3 debug model (MLA with low-rank queries, YaRN, 8 experts in 2 groups,
    a shared expert, one dense block) on CPU: trains in a few minutes on the Python standard
    library's own source (byte-level), no download. Add `--parallelism.expert_parallel_degree 2`
    under `NGPU=4` for expert parallel."""
    cfg = llama3_debug()
    cfg.model.name = "deepseek_v3"
    cfg.job.dump_folder = "./outputs/deepseek_v3_debug"
    return cfg


def deepseek_v3_16b() -> TrainerConfig:
    """The 16B-class DeepSeek-V3 (64 experts top-6 + 2 shared) on 8+ GPUs: FSDP, EP 8 (8
    experts per rank), full activation checkpointing."""
    cfg = pretrain_defaults(flavor="16B", seq_len=4096, steps=10_000, lr=2.2e-4, warmup_steps=200)
    cfg = on_gpu_cluster(cfg, dataset="allenai/c4", tokenizer_path="./assets/deepseek_v3/tokenizer.json")
    cfg.model.name = "deepseek_v3"
    cfg.model.vocab_size = 102400
    cfg.training.local_batch_size = 4
    cfg.parallelism.expert_parallel_degree = 8
    cfg.activation_checkpoint.mode = "full"
    cfg.job.dump_folder = "./outputs/deepseek_v3_16b"
    return cfg


def deepseek_v3_671b() -> TrainerConfig:
    """DeepSeek-V3 671B on 256+ GPUs: FSDP over all ranks, EP 64 (4 of the 256 experts per
    rank), full activation checkpointing; `titan dry-run --world_size 256` checks it on a laptop."""
    cfg = deepseek_v3_16b()
    cfg.model.flavor = "671B"
    cfg.model.vocab_size = 129280
    cfg.training.local_batch_size = 1
    cfg.parallelism.expert_parallel_degree = 64
    cfg.job.dump_folder = "./outputs/deepseek_v3_671b"
    return cfg


def sft_debug() -> SFTConfig:
    """SFT of the debug model on a synthetic string-reversal task (no download): loss only on
    the answers, packed examples with document masks; greedy answers become right."""
    cfg = SFTConfig()
    cfg.model.name = "llama3"
    cfg.model.flavor = "debugmodel"
    cfg.tokenizer.kind = "byte"
    cfg.sft_data.synthetic_task = "reverse"
    cfg.training.seq_len = 64
    cfg.training.local_batch_size = 16
    cfg.training.steps = 300
    cfg.optimizer.lr = 2e-3
    cfg.lr_scheduler.warmup_steps = 20
    cfg.lr_scheduler.decay_ratio = 0.2
    cfg.metrics.log_freq = 10
    cfg.job.dump_folder = "./outputs/sft_debug"
    return cfg


def grpo_debug() -> RLConfig:
    """GRPO of a tiny model on the synthetic sort task on CPU: an SFT warm-up on 32 fixed
    demonstrations teaches the format, then RL on fresh prompts raises held-out exact match
    beyond what more SFT on the demonstrations reaches; logprob_diff_max shows
    trainer/generator agreement."""
    cfg = RLConfig()
    cfg.model.name = "llama3"
    cfg.model.flavor = "debugmodel_tiny"
    cfg.tokenizer.kind = "byte"
    cfg.rl_data.synthetic_task = "sort"
    cfg.training.seq_len = 32
    cfg.training.local_batch_size = 32
    cfg.training.steps = 120
    cfg.rl.sft_warmup_steps = 60
    cfg.rl.prompts_per_step = 16
    cfg.rl.group_size = 8
    cfg.rl.rewards = ("char_match",)
    cfg.rl_data.sft_demonstrations = 32  # the warm-up teaches the format; RL sees all 4096 prompts
    # Two passes over each rollout (the clip bounds the second) and a KL anchor to the policy
    # RL starts from: measured the steadiest gain over seeds 0-2 (README, Post-training).
    cfg.rl.ppo_epochs = 2
    cfg.rl.kl_coef = 0.05
    cfg.rl.eval_freq = 20
    cfg.rl.eval_prompts = 64
    cfg.sampling.max_new_tokens = 10
    cfg.sampling.temperature = 1.0
    cfg.optimizer.lr = 2e-3
    cfg.lr_scheduler.warmup_steps = 10
    cfg.lr_scheduler.decay_ratio = 0.0  # RL keeps the peak LR
    cfg.metrics.log_freq = 10
    cfg.job.dump_folder = "./outputs/grpo_debug"
    return cfg


def dpo_debug() -> DPOConfig:
    """DPO of the tiny debug model on the synthetic sort task (no download): the right answer
    chosen over a near miss (its last letter changed), the reference the starting weights
    (start from an SFT checkpoint with --checkpoint.initial_load_path); rewards_accuracies
    climbs from 0 toward 1."""
    return _preference_debug(DPOConfig(), "dpo_debug")


def kto_debug() -> KTOConfig:
    """KTO of the tiny debug model on the synthetic sort task (no download): right answers
    labelled desirable, near misses (the last letter changed) undesirable, unpaired; the
    reference the starting weights. rewards_margins grows from 0 (and kl, the reference point,
    with the policy's drift)."""
    return _preference_debug(KTOConfig(), "kto_debug")


def gkd_debug() -> GKDConfig:
    """GKD of the tiny debug model on the synthetic sort task (no download) from a teacher you
    give (--gkd.teacher_model: e.g. sft_debug's model exported with --checkpoint.last_save_in_hf);
    half the microbatches the student's own completions; held-out loss with --validation.enable."""
    cfg = GKDConfig()
    cfg.model.name = "llama3"
    cfg.model.flavor = "debugmodel_tiny"
    cfg.tokenizer.kind = "byte"
    cfg.sft_data.synthetic_task = "sort"
    cfg.sampling.max_new_tokens = 16
    cfg.training.seq_len = 32
    cfg.training.local_batch_size = 16
    cfg.training.steps = 100
    cfg.optimizer.lr = 3e-3
    cfg.lr_scheduler.warmup_steps = 10
    cfg.lr_scheduler.decay_ratio = 0.2
    cfg.metrics.log_freq = 10
    cfg.job.dump_folder = "./outputs/gkd_debug"
    return cfg


def reward_debug() -> RewardConfig:
    """A reward model from the tiny debug model on the synthetic sort task (no download): a score
    head ranks the right answer over a near miss (its last letter changed); rewards_accuracies
    climbs from chance toward 1. Start from a language model with
    --checkpoint.initial_load_path (its body loads, the head starts fresh); export for
    titan rl --rl.rewards model with --checkpoint.last_save_in_hf."""
    return _preference_debug(RewardConfig(), "reward_debug")


def _preference_debug(cfg: DPOConfig | KTOConfig | RewardConfig, name: str) -> DPOConfig | KTOConfig | RewardConfig:
    """``cfg`` (a DPO or KTO config) set up as the debug recipe ``name``: the tiny debug model
    on the synthetic task (sort, the default), 60 steps on a CPU."""
    cfg.model.name = "llama3"
    cfg.model.flavor = "debugmodel_tiny"
    cfg.tokenizer.kind = "byte"
    cfg.training.seq_len = 128
    cfg.training.local_batch_size = 8
    cfg.training.steps = 60
    cfg.optimizer.lr = 1e-3
    cfg.lr_scheduler.warmup_steps = 5
    cfg.metrics.log_freq = 10
    cfg.job.dump_folder = f"./outputs/{name}"
    return cfg


RECIPES: dict[str, Callable[[], TrainerConfig | SFTConfig | RLConfig | DPOConfig | KTOConfig | RewardConfig | GKDConfig]] = {
    "llama3_debug": llama3_debug,
    "llama3_debug_synthetic": llama3_debug_synthetic,
    "llama3_1b": llama3_1b,
    "llama3_8b": llama3_8b,
    "llama3_70b": llama3_70b,
    "llama3_405b": llama3_405b,
    "qwen3_debug": qwen3_debug,
    "qwen3_0_6b": qwen3_0_6b,
    "qwen3_1_7b": qwen3_1_7b,
    "qwen3_4b": qwen3_4b,
    "qwen3_8b": qwen3_8b,
    "qwen3_14b": qwen3_14b,
    "qwen3_32b": qwen3_32b,
    "qwen3_moe_debug": qwen3_moe_debug,
    "qwen3_moe_30b_a3b": qwen3_moe_30b_a3b,
    "qwen3_moe_235b_a22b": qwen3_moe_235b_a22b,
    "deepseek_v3_debug": deepseek_v3_debug,
    "deepseek_v3_16b": deepseek_v3_16b,
    "deepseek_v3_671b": deepseek_v3_671b,
    "sft_debug": sft_debug,
    "grpo_debug": grpo_debug,
    "dpo_debug": dpo_debug,
    "kto_debug": kto_debug,
    "reward_debug": reward_debug,
    "gkd_debug": gkd_debug,
}
DEFAULT_RECIPE = "llama3_debug"


def recipe(name: str) -> TrainerConfig | SFTConfig | RLConfig | DPOConfig | KTOConfig | RewardConfig | GKDConfig:
    """The config of recipe ``name``; a ValueError lists the recipes otherwise."""
    try:
        return RECIPES[name]()
    except KeyError:
        raise ValueError(f"--config {name!r} is not a recipe; choose one of: {', '.join(RECIPES)}") from None
