"""What the policy wrote: every completion of a rollout as one JSON line (``--rl.log_completions``)
and a few of them in the log at each logged step (``--rl.num_completions_to_print``).

A line of ``<dump_folder>/completions.jsonl`` holds the step the rollout trained at (the
``step`` of its metrics record; a rollout with nothing to learn keeps the step before it), the
rollout's index and policy version, the group (prompt) index, the prompt text as the rewards
see it, the reference answer, the completion text, its reward and advantage (REINFORCE++'s:
its first token's), whether it
trained (its group kept, not masked as truncated), its length in tokens and its finish reason.
A resumed run appends the redone steps again, as ``metrics.jsonl`` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from titan.rl.rollouts import Rollout, completion_advantages

COMPLETIONS_FILE = "completions.jsonl"
PRINTED_CHARS = 400
"""Longest prompt or completion text printed to the log (the JSONL keeps the whole text)."""


def completion_records(rollout: Rollout, *, step: int, rl: Any) -> list[dict[str, Any]]:
    """One record per completion of ``rollout`` (module docstring); ``rl`` is the run's
    ``--rl.*`` section, whose advantage settings the records' advantages follow."""
    if not rollout.groups:
        return []
    advantages, keep, *_ = completion_advantages(rollout, **rl.advantage_options())
    records = []
    for i, group in enumerate(rollout.groups):
        for j, completion in enumerate(group):
            truncated = completion.finish_reason == "length"
            records.append({
                "step": step, "rollout": rollout.index, "policy_version": rollout.version, "group": i,
                "prompt": rollout.prompts[i] if rollout.prompts else None,
                "answer": rollout.answers[i] if rollout.answers else None,
                "completion": rollout.texts[i][j] if rollout.texts else None,
                "reward": rollout.rewards[i][j],
                "rewards": {label: values[j] for label, values in rollout.reward_terms[i].items()}
                if rollout.reward_terms else {},
                "advantage": float(advantages[i, j]),
                "trained": bool(keep[i]) and not (rl.mask_truncated and truncated),
                "tokens": len(completion.token_ids), "finish_reason": completion.finish_reason,
            })
    return records


def append_completions(dump_folder: str, records: Sequence[dict[str, Any]]) -> None:
    """Append ``records`` to ``<dump_folder>/completions.jsonl``, one JSON object per line."""
    os.makedirs(dump_folder, exist_ok=True)
    with open(os.path.join(dump_folder, COMPLETIONS_FILE), "a", encoding="utf-8") as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def _clipped(text: str | None) -> str:
    """``text`` as one log line's field: repr-quoted, cut at :data:`PRINTED_CHARS`."""
    if text is None:
        return "-"
    return repr(text if len(text) <= PRINTED_CHARS else text[:PRINTED_CHARS] + "...")


def format_completion(record: dict[str, Any]) -> str:
    """One completion record as a log line: group, reward, advantage, prompt, completion."""
    answer = f" (answer {_clipped(record['answer'])})" if record.get("answer") is not None else ""
    return (f"  group {record['group']} reward {record['reward']:.3f} advantage {record['advantage']:+.3f} "
            f"{record['tokens']} tokens{'' if record['trained'] else ' (not trained)'}: "
            f"{_clipped(record['prompt'])} -> {_clipped(record['completion'])}{answer}")


__all__ = ["COMPLETIONS_FILE", "append_completions", "completion_records", "format_completion"]
