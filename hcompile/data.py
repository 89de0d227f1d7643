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

import hashlib
import json
import re
import warnings
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
        self.replaced_bytes = 0
        """Bytes of the files read that were not UTF-8 (each run of them read as U+FFFD)."""
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """A hash of every document in order (computed once): what a data position is checked against."""
        if self._fingerprint is None:
            digest = hashlib.blake2b(digest_size=16)
            for text in self.documents:
                raw = text.encode("utf-8", errors="surrogatepass")
                digest.update(len(raw).to_bytes(8, "little"))
                digest.update(raw)
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    @classmethod
    def from_paths(cls, paths: str | Path | Iterable[str | Path], *, text_field: str = "text",
                   split_python: bool = False, strict: bool = False) -> "Corpus":
        """Files and folders (searched recursively for text, ``.jsonl`` and ``.parquet`` files). ``split_python``:
        a ``.py`` file is one document per top-level or nested function and class (long-tailed lengths).
        Bytes that are not UTF-8 are read as U+FFFD, counted and reported once in a warning; ``strict``: they
        are a :class:`DataError` naming the first file."""
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
        bad: dict[Path, int] = {}
        corpus = cls([t for f in files for t in _read(f, text_field, split_python, bad)])
        corpus.replaced_bytes = sum(bad.values())
        if bad and strict:
            first = next(iter(bad))
            raise DataError(f"{first} holds {bad[first]} bytes that are not UTF-8 (strict=True)")
        if bad:
            warnings.warn(f"{len(bad)} of {len(files)} corpus files hold bytes that are not UTF-8 ({sum(bad.values())} "
                          f"bytes, read as U+FFFD; first {next(iter(bad))}); strict=True refuses them", stacklevel=2)
        return corpus

    def __len__(self) -> int:
        return len(self.documents)

    def text(self, index: int) -> str:
        """Document ``index``."""
        return self.documents[index]


def _readable(f: Path) -> bool:
    return f.suffix in TEXT_SUFFIXES or f.suffix in (".jsonl", ".parquet")


def _decode(path: Path, bad: dict[Path, int]) -> str:
    """The text of ``path``; bytes that are not UTF-8 become U+FFFD and are counted in ``bad``."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        bad[path] = sum(1 for c in raw.decode("utf-8", errors="surrogateescape") if "\udc80" <= c <= "\udcff")
        return raw.decode("utf-8", errors="replace")


def _read(path: Path, field: str, split_python: bool, bad: dict[Path, int]) -> list[str]:
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(_decode(path, bad).splitlines(), 1):
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
        import pyarrow as pa

        schema = pq.read_schema(path)
        if field not in schema.names:
            raise DataError(f"{path} has no column {field!r}")
        kind = schema.field(field).type
        if not any(getattr(pa.types, f"is_{t}", lambda _: False)(kind) for t in ("string", "large_string",
                                                                                 "string_view")):
            raise DataError(f"{path}: column {field!r} holds {kind}, not strings")
        return [t for t in pq.read_table(path, columns=[field]).column(field).to_pylist() if t is not None]
    text = _decode(path, bad)
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
        left out (``drop``). What can be checked here is; a corpus no document of which gives a sequence is
        a :class:`DataError` after one pass over it, never a loop."""
        if long_documents not in ("split", "drop"):
            raise DataError(f"long_documents must be 'split' or 'drop', got {long_documents!r}")
        self.long_documents = long_documents
        for name, value in (("tokens_per_batch", tokens_per_batch), ("max_len", max_len), ("min_len", min_len),
                            ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
                raise DataError(f"{name} must be a {'non-negative' if name == 'seed' else 'positive'} integer, "
                                f"got {value!r}")
        if max_len < 2:
            raise DataError(f"max_len must be at least 2 (a sequence needs two tokens for one next-token pair), "
                            f"got {max_len}")
        if min_len > max_len:
            raise DataError(f"min_len {min_len} is more than max_len {max_len}: no sequence could be cut")
        if max_len > tokens_per_batch:
            raise DataError(f"max_len {max_len} is more than the batch budget {tokens_per_batch}")
        self.corpus, self.tokenizer = corpus, tokenizer
        self.tokens_per_batch, self.max_len, self.seed, self.min_len = tokens_per_batch, max_len, seed, min_len
        self.epoch, self.cursor, self.taken = 0, 0, 0
        """Where the next batch starts: the epoch, the index into its permutation of documents, and how many
        sequences of that document earlier batches took."""
        self._pending: list[list[int]] = []

    def _options(self) -> dict:
        """What decides how documents are cut, and by which tokenizer."""
        return {"max_len": self.max_len, "min_len": self.min_len, "long_documents": self.long_documents,
                "tokenizer": f"{type(self.tokenizer).__name__}/{self.tokenizer.vocab_size}"}

    def state_dict(self) -> dict:
        """The position (JSON-serialisable), for a checkpoint, with what it is a position of: the seed, the
        corpus's fingerprint and the options that cut its documents."""
        return {"epoch": self.epoch, "cursor": self.cursor, "taken": self.taken, "seed": self.seed,
                "documents": len(self.corpus), "corpus": self.corpus.fingerprint(), **self._options()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position ``state_dict`` gave; a position of another corpus, seed, ``max_len``,
        ``min_len``, ``long_documents`` or tokenizer is refused (``tokens_per_batch`` may change)."""
        try:
            epoch, cursor, taken, seed, documents = (int(state[k]) for k in ("epoch", "cursor", "taken", "seed",
                                                                             "documents"))
            saved = {k: state[k] for k in ("corpus", *self._options())}
        except (KeyError, TypeError, ValueError):
            raise DataError(f"not a data position: {state!r}") from None
        if (seed != self.seed or documents != len(self.corpus) or saved["corpus"] != self.corpus.fingerprint()
                or not 0 <= cursor < documents or epoch < 0 or taken < 0):
            raise DataError(f"data position {state!r} is not of this corpus ({len(self.corpus)} documents, "
                            f"fingerprint {self.corpus.fingerprint()}, seed {self.seed})")
        for key, value in self._options().items():
            if saved[key] != value:
                raise DataError(f"data position of a run with {key}={saved[key]!r}, this one has {value!r}: its "
                                "documents are cut otherwise")
        self.epoch, self.cursor, self.taken = epoch, cursor, taken
        self._pending = self.sequences(self.corpus.text(int(self._order(epoch)[cursor])))[taken:] if taken else []

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.corpus))

    def _cut(self, text: str) -> tuple[list[list[int]], str]:
        """The sequences a document becomes, and when there are none, why."""
        ids = self.tokenizer.encode(text)
        if ids and max(ids) >= self.tokenizer.vocab_size:
            raise DataError(f"the tokenizer gave id {max(ids)} >= its vocab_size {self.tokenizer.vocab_size}")
        if not ids:
            return [], "no tokens"
        if len(ids) > self.max_len and self.long_documents == "drop":
            return [], f"more than max_len {self.max_len} tokens (long_documents='drop')"
        pieces = [ids[i:i + self.max_len] for i in range(0, len(ids), self.max_len)]
        kept = [p for p in pieces if len(p) >= self.min_len]
        return kept, "" if kept else f"fewer than min_len {self.min_len} tokens"

    def sequences(self, text: str) -> list[list[int]]:
        """The sequences a document becomes: its tokens in pieces of at most ``max_len`` (none when it is longer
        and long documents are dropped), pieces shorter than ``min_len`` left out."""
        return self._cut(text)[0]

    def next_batch(self) -> list[torch.Tensor]:
        """The next global batch: sequences in order while they fit ``tokens_per_batch`` (a document's
        sequences continue in the next batch when they do not). A :class:`DataError` when a whole pass over
        the corpus gives no sequence."""
        batch: list[torch.Tensor] = []
        total, order = 0, self._order(self.epoch)
        empty: dict[int, str] = {}  # documents met since the last sequence that gave none, and why
        while True:
            if not self._pending:
                document = int(order[self.cursor])
                self._pending, why = self._cut(self.corpus.text(document))
                self.taken = 0
                if why:
                    empty[document] = why
                    if len(empty) == len(self.corpus):
                        raise DataError(_nothing_to_cut(empty))
                else:
                    empty.clear()
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


def _nothing_to_cut(why: dict[int, str]) -> str:
    """One line: no document of the corpus gives a sequence, and how many for each reason."""
    counts: dict[str, int] = {}
    for reason in why.values():
        counts[reason] = counts.get(reason, 0) + 1
    reasons = "; ".join(f"{n} with {reason}" for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"no document of the corpus gives a sequence ({len(why)} documents: {reasons})"
