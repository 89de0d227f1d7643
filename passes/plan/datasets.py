"""Sequence-length datasets and global-batch sampling.

A dataset is a length histogram: the presets ``commoncrawl``, ``github`` (synthetic, fitted to published
statistics) and ``python-code`` (real file lengths) ship with the project; a user file is either a JSON
histogram of the same form (``{"lengths": {"<len>": count, ...}}``) or a text file with one length per line.
Global batches are drawn as in the paper: sequences in random order until the token budget is reached, the
last one truncated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from passes.plan.ir import PlanError

__all__ = ["LengthDataset", "PRESET_DATASETS", "load_dataset", "read_lengths_file", "sample_batches", "check_batch"]

PRESET_DATASETS = ("commoncrawl", "github", "python-code", "long-context")


MAX_SEQUENCES = 10_000_000
"""Most sequences a length dataset may hold: sampling expands the histogram (8 bytes per sequence)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthDataset:
    """A histogram of sequence lengths."""

    name: str
    """Preset name or file stem."""
    lengths: tuple[int, ...]
    """Distinct lengths, ascending."""
    counts: tuple[int, ...]
    """How many sequences have each length."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        if not self.lengths:
            raise PlanError(f"dataset {self.name!r} holds no sequence")
        if len(self.lengths) != len(self.counts):
            raise PlanError(f"dataset {self.name!r}: {len(self.lengths)} lengths but {len(self.counts)} counts")
        for length in self.lengths:
            check_length(length, where=f"dataset {self.name!r}")
        for count in self.counts:
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise PlanError(f"dataset {self.name!r}: a count must be a positive integer, got {count!r}")
        if sum(self.counts) > MAX_SEQUENCES:
            raise PlanError(f"dataset {self.name!r} holds {sum(self.counts)} sequences (largest count "
                            f"{max(self.counts)}); at most {MAX_SEQUENCES} are supported")

    @property
    def max_len(self) -> int:
        """The longest sequence in the dataset."""
        return max(self.lengths)

    @property
    def num_seqs(self) -> int:
        """Sequences in the dataset."""
        return sum(self.counts)

    @property
    def mean_len(self) -> float:
        """Mean sequence length."""
        return float(np.dot(self.lengths, self.counts) / self.num_seqs)

    @classmethod
    def from_lengths(cls, name: str, seq_lens: list[int], source: str = "") -> "LengthDataset":
        """A histogram of the given lengths."""
        for length in seq_lens:
            check_length(length, where=f"dataset {name!r}")
        values, counts = np.unique(np.asarray(seq_lens, dtype=np.int64), return_counts=True)
        return cls(name=name, lengths=tuple(int(v) for v in values), counts=tuple(int(c) for c in counts),
                   source=source)


def check_length(value: object, where: str) -> int:
    """A sequence length must be a positive integer; anything else is a PlanError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise PlanError(f"{where}: a sequence length must be a positive integer, got {value!r}")
    return int(value)


def check_batch(seq_lens: list[int]) -> list[int]:
    """Validate one global batch: non-empty, every length a positive integer."""
    if len(seq_lens) == 0:
        raise PlanError("the batch is empty: a global batch needs at least one sequence")
    return [check_length(s, where=f"sequence {i} of the batch") for i, s in enumerate(seq_lens)]


def _dataset_from_json(data: object, name: str) -> LengthDataset:
    if not isinstance(data, dict) or not isinstance(data.get("lengths"), dict):
        raise PlanError(f"dataset {name!r}: expected a JSON object with a 'lengths' histogram")
    lengths, counts = [], []
    for key, count in sorted(data["lengths"].items(), key=lambda kv: _parse_int(kv[0], name)):
        lengths.append(_parse_int(key, name))
        counts.append(count)
    return LengthDataset(name=name, lengths=tuple(lengths), counts=tuple(counts), source=str(data.get("source", "")))


def _parse_int(text: str, where: str) -> int:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise PlanError(f"{where}: a sequence length must be a positive integer, got {text!r}") from None
    if not value.is_integer() or value < 1:
        raise PlanError(f"{where}: a sequence length must be a positive integer, got {text!r}")
    return int(value)


def read_lengths_file(path: str | Path) -> list[int] | LengthDataset:
    """A user file: a JSON histogram (returns a LengthDataset) or a text file of lengths (returns the list)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanError(f"lengths file {str(path)!r} does not exist") from None
    except (IsADirectoryError, UnicodeDecodeError):
        raise PlanError(f"lengths file {str(path)!r} is not a text file") from None
    if text.lstrip().startswith("{"):
        try:
            return _dataset_from_json(json.loads(text), path.stem)
        except json.JSONDecodeError as exc:
            raise PlanError(f"lengths file {str(path)!r} is not valid JSON: {exc}") from None
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    seq_lens = [_parse_int(line, f"{path.name} line {n}") for n, line in lines]
    return check_batch(seq_lens)


def load_dataset(name: str) -> LengthDataset:
    """A preset dataset by name."""
    if name not in PRESET_DATASETS:
        raise PlanError(f"unknown dataset {name!r}; known: {', '.join(PRESET_DATASETS)} (or --lengths FILE)")
    text = resources.files("passes.plan").joinpath("data", "lengths", f"{name}.json").read_text()
    return _dataset_from_json(json.loads(text), name)


def sample_batches(dataset: LengthDataset, global_tokens: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` global batches of exactly ``global_tokens`` tokens: the dataset's sequences in a random
    order (reshuffled each epoch), consumed until the budget is reached, the last one truncated."""
    if isinstance(global_tokens, bool) or not isinstance(global_tokens, int) or global_tokens < 1:
        raise PlanError(f"global tokens must be a positive integer, got {global_tokens!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PlanError(f"steps must be a positive integer, got {steps!r}")
    rng = np.random.default_rng(seed)
    population = np.repeat(np.asarray(dataset.lengths, dtype=np.int64), dataset.counts)
    order = rng.permutation(population)
    cursor, batches = 0, []
    for _ in range(steps):
        batch, total = [], 0
        while total < global_tokens:
            if cursor == len(order):
                order, cursor = rng.permutation(population), 0
            length = int(min(order[cursor], global_tokens - total))
            cursor += 1
            batch.append(length)
            total += length
        batches.append(batch)
    return batches
