"""This project's own HDF5 trajectory dumps (metrics/dump.py documents the layout; `hpcvla demos`
writes expert demonstrations in it too): one row per action chunk, /data/demo_<i>/obs/<field>
(T, *shape) named as the env's fields, actions (T, H, A).

The rows are already what SFT wants: the observation the chunk was chosen for and the whole
chunk the env executed, but for the last row of an episode that ended inside its chunk (a
success mid-chunk): the demo's `env_steps` attribute says which of its actions ran, and the
rest are padding. The chunk length is the file's root attribute `chunk_len`; a file
written with another one is refused (its observations exist only at its own chunk
boundaries). The instruction is re-tokenized from each demo's `instruction` attribute with the
spec's vocabulary, not copied from obs/instruction, whose ids index the vocabulary of the run
that wrote the file."""

from __future__ import annotations

import numpy as np
import yaml

from hpcvla.config.families import EE_DELTA_CONTROL
from hpcvla.demonstrations.common import (Episode, Problems, chunks, fit_images,
                                          image_dtype_problem, is_image, rows_problem)
from hpcvla.envs.serial import executed_actions
from hpcvla.metrics.dump import FORMAT, attr_text

NAME = "hpcvla trajectory dump"


def matches(f) -> bool:
    return attr_text(f.attrs.get("format", "")) == FORMAT and "data" in f


def _demo_names(f) -> list[str]:
    return sorted((n for n in f["data"] if n.startswith("demo_")),
                  key=lambda n: int(n.rsplit("_", 1)[-1]))


def scan(path, f, spec, problems: Problems) -> list[Episode]:
    """The demos of an open dump, and what stops reading them for `spec` (shapes only)."""
    chunk_len = int(f.attrs.get("chunk_len", -1))
    if chunk_len != spec.chunk_len:
        problems.add(path, "/.attrs[chunk_len]", chunk_len,
                     f"chunk_len {spec.chunk_len}, the spec's (env.chunk_len): dump rows hold "
                     "one observation per chunk, so re-chunking is impossible; set "
                     f"env.chunk_len={chunk_len} or use a dump written with "
                     f"chunk_len={spec.chunk_len}")
    for setting, want in (("control_mode", spec.controller), ("gripper_action", spec.gripper)):
        for where, recorded in _recorded(f, setting):
            if want and recorded and recorded != want:
                problems.add(path, f"{where}.env.{setting}", recorded,
                             f"{want}, the env's (env.{setting}): its actions mean something "
                             f"else; set env.{setting}={recorded} or record the demos with "
                             f"env.{setting}={want}")
    episodes = []
    for name in _demo_names(f):
        demo, key = f["data"][name], f"/data/{name}"
        actions = demo.get("actions")
        for field, (shape, _) in spec.obs.items():
            if field == "instruction":
                continue
            dataset = demo.get(f"obs/{field}")
            if dataset is None:
                problems.add(path, f"{key}/obs/{field}", None,
                             f"the spec's observation field {field!r} (the file has obs/"
                             f"{', obs/'.join(demo['obs']) if 'obs' in demo else ' nothing'});"
                             " record the dump with an env that observes it, or drop the field "
                             "from the env settings")
            elif not _fits(dataset.shape[1:], spec.obs[field]):
                problems.add(path, f"{key}/obs/{field}", tuple(dataset.shape[1:]),
                             f"shape {tuple(shape)} for {field!r} as the spec has it (images may "
                             "differ in size only); use a dump of the same env settings")
            else:
                if is_image(spec.obs[field]):
                    image_dtype_problem(path, f"{key}/obs/{field}", dataset, problems)
                if actions is not None:
                    rows_problem(path, f"{key}/obs/{field}", dataset, len(actions),
                                 "a row per actions row: the observation each chunk was chosen "
                                 "for", problems)
        if actions is None:
            problems.add(path, f"{key}/actions", None, "an actions dataset (T, H, A)")
        elif actions.ndim != 3 or actions.shape[1:] != (spec.chunk_len, spec.action_dim):
            problems.add(path, f"{key}/actions", tuple(actions.shape),
                         f"(T, {spec.chunk_len}, {spec.action_dim}): chunks of "
                         f"env.chunk_len actions of the spec's action_dim; the dump is of "
                         "another env or chunk length")
        episodes.append(Episode(str(path), key, attr_text(demo.attrs.get("instruction", "")),
                                f"{key}.attrs[instruction]",
                                bool(demo.attrs.get("success", False)),
                                0 if actions is None else len(actions)))
    return episodes


# What the actions of a dump mean, by env and setting, and the default of a config without it
RECORDED = {("maniskill", "control_mode"): EE_DELTA_CONTROL,
            ("libero", "gripper_action"): "closed_high", ("maniskill", "reward"): "sparse",
            ("maniskill", "success_ends_episode"): True}


def _recorded(f, setting: str) -> list[tuple[str, str]]:
    """The env setting each start of the run that wrote the file recorded its actions under
    (its /starts/<n> config, a file before those: the root's; a resume may change any
    setting): (where, value), the value "" where unknown, or not one of its env's
    (RECORDED), or the default of a config without it."""
    configs = [(f"/starts/{n}.attrs[config]", start.attrs.get("config", ""))
               for n, start in f.get("starts", {}).items()] or \
        [("/.attrs[config]", f.attrs.get("config", ""))]
    out = []
    for where, text in configs:
        try:
            env = yaml.safe_load(attr_text(text)).get("env", {})
        except (yaml.YAMLError, AttributeError):
            out.append((where, ""))
            continue
        default = RECORDED.get((env.get("name"), setting))
        out.append((where, env.get(setting, default) if default is not None else ""))
    return out


def _fits(have, entry) -> bool:
    """The spec's shape, or an image of another size (resized on reading)."""
    return tuple(have) == tuple(entry[0]) or (
        is_image(entry) and len(have) == 3 and have[2] == entry[0][2])


def load(f, episode: Episode, spec, horizon: int | None = None
         ) -> tuple[dict, np.ndarray, np.ndarray]:
    """(obs fields but the instruction, (T, H, A) float32 actions, (T, H) padding mask): a
    row's chunk (H = spec.chunk_len), or its `horizon` actions, the rows after it continuing
    it within the episode (padded past its end)."""
    demo = f[episode.key]
    obs = {}
    for field, (shape, dtype) in spec.obs.items():
        if field == "instruction":
            continue
        value = demo[f"obs/{field}"][()]
        obs[field] = (fit_images(value, shape) if is_image(spec.obs[field])
                      else value).astype(np.dtype(dtype), copy=False)
    actions = executed_actions(demo["actions"][()])  # a run's: as drawn, before the env clips
    rows, chunk = actions.shape[:2]
    horizon = horizon or chunk
    # The actions that ran, the episode's env steps: after a success mid-chunk the rest of the
    # last chunk never did (padding, as past the end). A dump without `env_steps` has every
    # action taken as run.
    ran = min(int(demo.attrs.get("env_steps", rows * chunk)), rows * chunk)
    if ran == rows * chunk and horizon == chunk:
        return obs, actions, np.zeros(actions.shape[:2], dtype=bool)
    windows, pad = chunks(actions.reshape(rows * chunk, -1)[:max(ran, 1)], horizon,
                          starts=np.arange(rows) * chunk)
    return obs, windows, pad | (ran == 0)


OUTCOMES = {"rewards": np.float32, "terminated": bool, "truncated": bool, "env_fault": bool}


def outcome_problems(path, spec, problems: Problems) -> None:
    """Prior data's rewards and episode ends must be the env's: a dump recorded under another
    env.reward (spec.reward) holds another reward's values (dense's up to 1 a step,
    dense_delta's changes of it); one recorded under another env.success_ends_episode
    (spec.success_ends_episode) ends its episodes elsewhere (a success terminal, nothing after
    it, where the env's episodes go on to the horizon: contradictory targets for a critic)."""
    from hpcvla.metrics.dump import open_dump
    with open_dump(path) as f:
        rewards, ends = _recorded(f, "reward"), _recorded(f, "success_ends_episode")
    for where, reward in rewards:
        if spec.reward and reward and reward != spec.reward:
            problems.add(path, f"{where}.env.reward", reward,
                         f"{spec.reward}, the env's (env.reward): its rewards are another "
                         f"reward's; record the demos again with env.reward={spec.reward} "
                         f"(`hpcvla demos`), or set env.reward={reward}")
    want = spec.success_ends_episode
    for where, recorded in ends:
        if recorded != "" and bool(recorded) != want:
            problems.add(path, f"{where}.env.success_ends_episode", recorded,
                         f"{want}, the env's (env.success_ends_episode): its episodes "
                         f"{'run on past success' if recorded is False else 'end at success'};"
                         f" record the demos again with env.success_ends_episode={want} "
                         f"(`hpcvla demos`), or set env.success_ends_episode={recorded}")


def outcomes(f, episode: Episode) -> dict[str, np.ndarray]:
    """Per row (chunk-step): its reward and how the episode ended there (the last row only);
    what an off-policy learner's prior data needs beside the observations and actions."""
    demo = f[episode.key]
    missing = [name for name in OUTCOMES if name not in demo]
    if missing:
        raise KeyError(f"{episode.path}:{episode.key}: no {', '.join(missing)}")
    return {name: demo[name][()].astype(dtype) for name, dtype in OUTCOMES.items()}
