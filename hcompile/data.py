"""Real data: documents from a corpus, tokenized, shuffled deterministically, cut into global batches by a token
budget, with a position a checkpoint keeps so that a resumed run sees the same batches.

Owns :class:`Corpus` (text files, one document per file; JSON lines or parquet, one document per row's text
field; or Python sources cut into one document per function or class), the tokenizers (:class:`ByteTokenizer`,
UTF-8 bytes; :class:`HFTokenizer`, any Hugging Face tokenizer), and :class:`TokenBatches`: each epoch a
permutation of the documents drawn from ``seed`` and the epoch, every document cut into sequences of at most
``max_len`` tokens, sequences taken in order into global batches of at most ``tokens_per_batch`` tokens. A
batch is a list of 1-D int64 tensors, what ``Trainer.train_step`` takes, the same on every rank.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol, Sequence

import numpy as np
import torch

__all__ = ["Corpus", "Tokenizer", "ByteTokenizer", "HFTokenizer", "TokenBatches", "DataError", "python_stdlib"]

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".c", ".h", ".json")
"""File suffixes read as one document each (``.jsonl`` and ``.parquet`` hold one document per row)."""


class DataError(ValueError):
    """A corpus, tokenizer or position that cannot be used; the message names the value."""


class Tokenizer(Protocol):
    """Turns a document into token ids."""

    vocab_size: int
    """Ids are in [0, vocab_size)."""

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``."""


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, nothing to download."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))


class HFTokenizer:
    """A Hugging Face tokenizer (``transformers.AutoTokenizer.from_pretrained(...)``), without special tokens."""

    def __init__(self, tokenizer: Any) -> None:
        if not callable(getattr(tokenizer, "encode", None)):
            raise DataError(f"a Hugging Face tokenizer has an encode method; got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.vocab_size = int(len(tokenizer))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


_DEFINITION = re.compile(r"\n(?=[ \t]*(?:async def |def |class ))")


class Corpus:
    """Documents in a fixed order (sorted paths, then rows), held in memory."""

    def __init__(self, documents: Sequence[str]):
        self.documents = [d for d in documents if d.strip()]
        if not self.documents:
            raise DataError("the corpus holds no documents")

    @classmethod
    def from_paths(cls, paths: str | Path | Iterable[str | Path], *, text_field: str = "text",
                   split_python: bool = False) -> "Corpus":
        """Files and folders (searched recursively for text, ``.jsonl`` and ``.parquet`` files). ``split_python``:
        a ``.py`` file is one document per top-level or nested function and class (long-tailed lengths)."""
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        files: list[Path] = []
        for p in map(Path, paths):
            if p.is_dir():
                files += sorted(f for f in p.rglob("*") if f.is_file() and _readable(f))
            elif p.is_file():
                files.append(p)
            else:
                raise DataError(f"corpus path {str(p)!r} does not exist")
        if not files:
            raise DataError(f"no text, .jsonl or .parquet files under {[str(p) for p in paths]}")
        return cls([t for f in files for t in _read(f, text_field, split_python)])

    def __len__(self) -> int:
        return len(self.documents)

    def text(self, index: int) -> str:
        """Document ``index``."""
        return self.documents[index]


def _readable(f: Path) -> bool:
    return f.suffix in TEXT_SUFFIXES or f.suffix in (".jsonl", ".parquet")


def _read(path: Path, field: str, split_python: bool) -> list[str]:
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{n} is not JSON: {exc}") from None
                if not isinstance(row, dict) or not isinstance(row.get(field), str):
                    raise DataError(f"{path}:{n} has no text field {field!r}")
                rows.append(row[field])
        return rows
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"reading {path} needs pyarrow (pip install pyarrow)") from None
        table = pq.read_table(path, columns=[field]) if field in pq.read_schema(path).names else None
        if table is None:
            raise DataError(f"{path} has no column {field!r}")
        return [str(t) for t in table.column(field).to_pylist() if t is not None]
    text = path.read_text(encoding="utf-8", errors="replace")
    return _DEFINITION.split(text) if split_python and path.suffix == ".py" else [text]


def python_stdlib() -> list[Path]:
    """The ``.py`` sources of the running interpreter's standard library (installed packages left out), sorted:
    real text that ships with every Python."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(f for f in root.rglob("*.py") if "site-packages" not in f.relative_to(root).parts)


class TokenBatches:
    """Global batches of whole sequences by token budget, deterministic from ``seed``; iterable, resumable."""

    def __init__(self, corpus: Corpus, tokenizer: Tokenizer, *, tokens_per_batch: int, max_len: int, seed: int = 0,
                 min_len: int = 2, long_documents: str = "split"):
        """``long_documents``: a document of more than ``max_len`` tokens is cut into pieces (``split``) or
        left out (``drop``)."""
        if long_documents not in ("split", "drop"):
            raise DataError(f"long_documents must be 'split' or 'drop', got {long_documents!r}")
        self.long_documents = long_documents
        for name, value in (("tokens_per_batch", tokens_per_batch), ("max_len", max_len), ("min_len", min_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataError(f"{name} must be a positive integer, got {value!r}")
        if max_len > tokens_per_batch:
            raise DataError(f"max_len {max_len} is more than the batch budget {tokens_per_batch}")
        self.corpus, self.tokenizer = corpus, tokenizer
        self.tokens_per_batch, self.max_len, self.seed, self.min_len = tokens_per_batch, max_len, seed, min_len
        self.epoch, self.cursor, self.taken = 0, 0, 0
        """Where the next batch starts: the epoch, the index into its permutation of documents, and how many
        sequences of that document earlier batches took."""
        self._pending: list[list[int]] = []

    def state_dict(self) -> dict:
        """The position (JSON-serialisable), for a checkpoint."""
        return {"epoch": self.epoch, "cursor": self.cursor, "taken": self.taken, "seed": self.seed,
                "documents": len(self.corpus)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position ``state_dict`` gave; a position of another corpus or seed is refused."""
        try:
            epoch, cursor, taken, seed, documents = (int(state[k]) for k in ("epoch", "cursor", "taken", "seed",
                                                                             "documents"))
        except (KeyError, TypeError, ValueError):
            raise DataError(f"not a data position: {state!r}") from None
        if (seed != self.seed or documents != len(self.corpus) or not 0 <= cursor < documents or epoch < 0
                or taken < 0):
            raise DataError(f"data position {state!r} is not of this corpus ({len(self.corpus)} documents, "
                            f"seed {self.seed})")
        self.epoch, self.cursor, self.taken = epoch, cursor, taken
        self._pending = self.sequences(self.corpus.text(int(self._order(epoch)[cursor])))[taken:] if taken else []

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.corpus))

    def sequences(self, text: str) -> list[list[int]]:
        """The sequences a document becomes: its tokens in pieces of at most ``max_len`` (none when it is longer
        and long documents are dropped), pieces shorter than ``min_len`` left out."""
        ids = self.tokenizer.encode(text)
        if ids and max(ids) >= self.tokenizer.vocab_size:
            raise DataError(f"the tokenizer gave id {max(ids)} >= its vocab_size {self.tokenizer.vocab_size}")
        if len(ids) > self.max_len and self.long_documents == "drop":
            return []
        pieces = [ids[i:i + self.max_len] for i in range(0, len(ids), self.max_len)]
        return [p for p in pieces if len(p) >= self.min_len]

    def next_batch(self) -> list[torch.Tensor]:
        """The next global batch: sequences in order while they fit ``tokens_per_batch`` (a document's
        sequences continue in the next batch when they do not)."""
        batch, total, order = [], 0, self._order(self.epoch)
        while True:
            if not self._pending:
                self._pending, self.taken = self.sequences(self.corpus.text(int(order[self.cursor]))), 0
            if self._pending and total + len(self._pending[0]) > self.tokens_per_batch and batch:
                return batch
            if self._pending:
                seq = self._pending.pop(0)
                batch.append(torch.tensor(seq, dtype=torch.long))
                total, self.taken = total + len(seq), self.taken + 1
            if not self._pending:  # this document is done
                self.cursor, self.taken = self.cursor + 1, 0
                if self.cursor == len(order):
                    self.epoch, self.cursor, order = self.epoch + 1, 0, self._order(self.epoch + 1)

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        while True:
            yield self.next_batch()
