"""Training batches for the client: random tokens in the model's vocabulary, or token ids
from a file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np


def random_batches(
    *, vocab_size: int, batch_size: int, sequence_length: int, seed: int = 0
) -> Iterator[np.ndarray]:
    """Endless batches of uniformly random token ids, shape [batch, sequence]."""
    rng = np.random.default_rng(seed)
    while True:
        yield rng.integers(0, vocab_size, size=(batch_size, sequence_length), dtype=np.int64)


def repeated_batch(
    *, vocab_size: int, batch_size: int, sequence_length: int, seed: int = 0
) -> Iterator[np.ndarray]:
    """The same random batch every step: the loss must fall as the model memorises it."""
    batch = next(
        random_batches(
            vocab_size=vocab_size, batch_size=batch_size, sequence_length=sequence_length, seed=seed
        )
    )
    while True:
        yield batch


def file_batches(
    *, path: Path, vocab_size: int, batch_size: int, sequence_length: int
) -> Iterator[np.ndarray]:
    """Batches cut from a token file: ``.npy`` (any int array) or whitespace-separated ids.

    The stream wraps around at the end of the file. Ids outside ``[0, vocab_size)`` are an error.
    """
    if path.suffix == ".npy":
        tokens = np.load(path).astype(np.int64).reshape(-1)
    else:
        tokens = np.array(path.read_text().split(), dtype=np.int64)
    if tokens.size < sequence_length:
        raise ValueError(
            f"{path}: {tokens.size} tokens is fewer than one sequence of {sequence_length}; supply "
            "more tokens"
        )
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bad.any():
        raise ValueError(
            f"{path}: token id {int(tokens[bad][0])} is outside the model's vocabulary [0, "
            f"{vocab_size}); re-tokenise or raise model.vocabSize"
        )
    per_batch = batch_size * sequence_length
    offset = 0
    while True:
        idx = (np.arange(per_batch) + offset) % tokens.size
        offset = (offset + per_batch) % tokens.size
        yield tokens[idx].reshape(batch_size, sequence_length)
