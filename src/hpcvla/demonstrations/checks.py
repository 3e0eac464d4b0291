"""The checks of what demonstration files hold, beyond their layouts' own (scan): the
instructions against the env's vocabulary, the demonstrations per task, and for prior data
the rewards and episode ends (demonstration_problems and select_demonstrations run them)."""

from __future__ import annotations

from collections import Counter

from hpcvla.demonstrations.common import Episode, Problems
from hpcvla.envs.base import EnvSpec
from hpcvla.text import words


def check_instructions(spec: EnvSpec, episodes: list[Episode], problems: Problems) -> None:
    vocab, length = set(spec.vocab), spec.obs.get("instruction", ((0,), ""))[0][0]
    for e in {(e.path, e.instruction): e for e in episodes}.values():
        unknown = sorted({w for w in words(e.instruction) if w not in vocab})
        if "instruction" in spec.obs and unknown:
            problems.add(e.path, e.instruction_key, e.instruction,
                         f"only words of the env's vocabulary (the policy's comes from the "
                         f"env; unknown: {', '.join(unknown)}): demonstrations of the env's "
                         "own tasks, or env settings whose tasks include this one")
        elif "instruction" in spec.obs and len(words(e.instruction)) > length:
            problems.add(e.path, e.instruction_key, e.instruction,
                         f"at most {length} words (the spec's instruction length)")
        elif "instruction" in spec.obs and not words(e.instruction):
            problems.add(e.path, e.instruction_key, e.instruction, "an instruction")


def check_per_task(per_task, found, successful_only: bool, problems: Problems) -> None:
    """Every task has `per_task` demonstrations to read (successful ones where only those
    are read): a few-shot run reads as many as it names, or is refused."""
    if per_task is None:
        return
    if not isinstance(per_task, int) or per_task < 1:
        problems.add("per_task", "", per_task, "a number of demonstrations per task >= 1, or "
                     "None for all")
        return
    episodes = [e for _, _, eps in found for e in eps]
    counts = Counter(e.instruction for e in episodes if e.success or not successful_only)
    for task in dict.fromkeys(e.instruction for e in episodes):
        if counts[task] < per_task:
            first = next(e for e in episodes if e.instruction == task)
            which = "successful demonstrations" if successful_only else "demonstrations"
            problems.add(first.path, first.instruction_key, task,
                         f"at least per_task={per_task} {which} of this task (the files hold "
                         f"{counts[task]}); lower per_task or add demonstrations")


def check_outcomes(found, problems: Problems, spec: EnvSpec) -> None:
    """Rewards and episode ends per chunk-step: only the layouts that record them, each
    recorded under the env's reward."""
    for path, layout, _ in found:
        if not hasattr(layout, "outcomes"):
            problems.add(path, "/", layout.NAME, "a file with each chunk's reward and how its "
                         "episode ended (this project's trajectory dumps and `hpcvla demos` "
                         f"files); {layout.NAME} files are read for `hpcvla sft` only")
        else:
            layout.outcome_problems(path, spec, problems)
