"""The transformers models inside the VLA policies (SigLIP, Gemma, Llama, DINOv2), built one
way: at random from run.seed, or, for a pretrained folder that will overwrite them, without
their random init. π0's 3.2 B parameters take 35 s to minutes to initialise on a node's CPU,
on every inference and learner rank and at every restart, for values the folder replaces.

Only the backbones skip it: the heads around them (projections, RL heads) stay initialised,
since a published folder may lack the RL heads (folders.RL_HEAD_PREFIX) and those start from
their init. A backbone tensor the folder lacks is refused by name (folders.load_weights, the
published-folder readers), so no uninitialised value is ever used."""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

_FROM_FOLDER = contextvars.ContextVar("backbones_from_folder", default=False)


@contextmanager
def backbones_from_folder(enabled: bool = True):
    """Inside: the policy under construction will load a pretrained folder (`enabled`)."""
    token = _FROM_FOLDER.set(enabled)
    try:
        yield
    finally:
        _FROM_FOLDER.reset(token)


def backbone(model_cls, config, dtype):
    """A transformers `model_cls` of `config`, in `dtype` (never a float32 copy first)."""
    if not _FROM_FOLDER.get():
        return model_cls._from_config(config, dtype=dtype)
    from transformers.initialization import no_init_weights
    with no_init_weights():
        return model_cls._from_config(config, dtype=dtype)


__all__ = ["backbone", "backbones_from_folder"]
