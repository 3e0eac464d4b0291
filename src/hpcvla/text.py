"""Instruction text as token ids: the word vocabulary the envs build from their
instructions, and the tokenizer the envs and the checkpoint processors share."""

from __future__ import annotations

import re

import numpy as np


def words(text: str) -> list[str]:
    """Lower-case words of an instruction, punctuation dropped but for apostrophes and
    hyphens inside a word (LIBERO-PRO's "cabinet’s", "yellow-white")."""
    return re.findall(r"[a-z0-9_]+(?:['’-][a-z0-9_]+)*", text.lower())


def vocab_of(texts) -> tuple[str, ...]:
    """Token vocabulary of a set of instructions: "" (padding, id 0), then the sorted words."""
    return ("", *sorted({w for t in texts for w in words(t)}))


def tokenize(text: str, vocab: tuple[str, ...], length: int) -> np.ndarray:
    """(length,) int32 token ids of `text`, padded with 0; unknown words are dropped."""
    index = {w: i for i, w in enumerate(vocab)}
    ids = [index[w] for w in words(text) if w in index][:length]
    return np.array(ids + [0] * (length - len(ids)), dtype=np.int32)


def detokenize(ids, vocab: tuple[str, ...]) -> str:
    """The words of `tokenize`'s ids (padding dropped), joined by spaces."""
    return " ".join(vocab[i] for i in ids if i)
