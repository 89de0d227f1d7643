"""Real data: documents from a corpus, tokenized, shuffled deterministically, cut into global batches by a token
budget, with a position a checkpoint keeps so that a resumed run sees the same batches.

Owns :class:`Corpus` (text files, one document per file; JSON lines or parquet, one document per row's text
field; or Python sources cut into one document per function or class), the tokenizers (:class:`ByteTokenizer`,
UTF-8 bytes; :class:`HFTokenizer`, any Hugging Face tokenizer), and :class:`TokenBatches`: each epoch a
permutation of the documents drawn from ``seed`` and the epoch, every document cut into sequences of at most
``max_len`` tokens, sequences taken in order into global batches of at most ``tokens_per_batch`` tokens. A
batch is a list of 1-D int64 tensors, what ``Trainer.train_step`` takes, the same on every rank.

A ``TokenBatches`` is its own iterator: ``next_batch`` (``next(batches)``) moves its position only when it
returns a batch, so after any exception (a tokenizer that fails, a document too large for memory) ``state_dict``
is still the first sequence no batch returned. ``Trainer.fit`` puts such a source back before the batches it took
but did not train when it ends by an exception.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

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
        """The UTF-8 bytes of ``text`` (a lone surrogate becomes ``?``)."""
        return list(text.encode("utf-8", errors="replace"))

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as a uint8 array over the bytes themselves (one byte per token, no Python list)."""
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)


class HFTokenizer:
    """A Hugging Face tokenizer (``transformers.AutoTokenizer.from_pretrained(...)``), without special tokens."""

    def __init__(self, tokenizer: Any) -> None:
        if isinstance(tokenizer, (str, bytes, os.PathLike)):
            raise DataError(f"HFTokenizer takes a loaded tokenizer, not a name or path ({tokenizer!r}): "
                            f"HFTokenizer(transformers.AutoTokenizer.from_pretrained({str(tokenizer)!r}))")
        if not callable(getattr(tokenizer, "encode", None)):
            raise DataError(f"a Hugging Face tokenizer has an encode method; got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.vocab_size = int(len(tokenizer))

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without special tokens."""
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
        self._files: list[tuple[int, str, int]] = []
        """(index of its first document, path, documents) of each file read by ``from_paths``."""

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
        documents: list[str] = []
        spans: list[tuple[int, str, int]] = []
        for f in files:
            try:
                texts = [t for t in _read(f, text_field, split_python, bad) if t.strip()]
            except MemoryError:
                raise DataError(f"{f} ({f.stat().st_size} bytes) does not fit in memory when read: split it into "
                                "smaller files or documents") from None
            spans.append((len(documents), str(f), len(texts)))
            documents += texts
        corpus = cls(documents)
        corpus._files = spans
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

    def origin(self, index: int) -> str:
        """Where document ``index`` comes from, for messages: its file (and its place among the file's
        documents) when read by ``from_paths``, else its index."""
        at = bisect.bisect_right([start for start, _, _ in self._files], index) - 1
        if at < 0:
            return f"document {index}"
        start, path, count = self._files[at]
        return f"document {index} ({path})" if count == 1 else \
            f"document {index} ({path}, its document {index - start + 1} of {count})"


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

        try:
            schema = pq.read_schema(path)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{path} is not a readable parquet file: {exc}") from None
        if field not in schema.names:
            raise DataError(f"{path} has no column {field!r}")
        kind = schema.field(field).type
        if not any(getattr(pa.types, f"is_{t}", lambda _: False)(kind) for t in ("string", "large_string",
                                                                                 "string_view")):
            raise DataError(f"{path}: column {field!r} holds {kind}, not strings")
        try:
            column = pq.read_table(path, columns=[field]).column(field)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{path} is not a readable parquet file: {exc}") from None
        return [t for t in column.to_pylist() if t is not None]
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
        self._document: tuple[int, np.ndarray, int] | None = None
        """(document, its token ids, the sequences it gives) of the document at ``cursor`` once tokenized."""

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
        document = self._tokens(int(self._order(epoch)[cursor])) if taken else None
        if document is not None and taken >= document[2]:
            raise DataError(f"data position {state!r} takes {taken} sequences of a document that gives "
                            f"{document[2]}")
        self.epoch, self.cursor, self.taken, self._document = epoch, cursor, taken, document

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.corpus))

    def _ids(self, text: str, document: int | None) -> np.ndarray:
        """The token ids of ``text`` (the corpus's ``document``) as a 1-D integer array; a :class:`DataError`
        naming the document when they are out of the vocabulary or do not fit in memory."""
        def what() -> str:  # only when there is something to say: finding the file costs a search
            return "the document" if document is None else self.corpus.origin(document)

        try:
            fast = getattr(self.tokenizer, "encode_array", None)
            ids = np.asarray(fast(text) if callable(fast) else self.tokenizer.encode(text))
            if ids.size and not np.issubdtype(ids.dtype, np.integer):
                ids = ids.astype(np.int64)
        except MemoryError:
            raise DataError(f"{what()} ({len(text)} characters) does not fit in memory once tokenized: split it "
                            "into smaller documents") from None
        ids = ids.reshape(-1)
        if ids.size and (int(ids.max()) >= self.tokenizer.vocab_size or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= self.tokenizer.vocab_size else int(ids.min())
            raise DataError(f"the tokenizer gave id {bad} for {what()}, outside its vocabulary "
                            f"[0, {self.tokenizer.vocab_size})")
        return ids

    def _cut(self, ids: np.ndarray) -> tuple[int, str]:
        """How many sequences ``ids`` gives (piece k is ``ids[k * max_len:(k + 1) * max_len]``; only the last
        piece can be shorter than ``min_len``, and is then left out), and when none, why."""
        if not ids.size:
            return 0, "no tokens"
        if ids.size > self.max_len and self.long_documents == "drop":
            return 0, f"more than max_len {self.max_len} tokens (long_documents='drop')"
        count = -(-ids.size // self.max_len)
        if ids.size - (count - 1) * self.max_len < self.min_len:
            count -= 1
        return count, "" if count else f"fewer than min_len {self.min_len} tokens"

    def _tokens(self, document: int) -> tuple[int, np.ndarray, int]:
        """(document, its ids, the sequences they give)."""
        ids = self._ids(self.corpus.text(document), document)
        return document, ids, self._cut(ids)[0]

    def _piece(self, ids: np.ndarray, k: int) -> torch.Tensor:
        return torch.from_numpy(ids[k * self.max_len:(k + 1) * self.max_len].astype(np.int64))

    def sequences(self, text: str) -> list[list[int]]:
        """The sequences a document becomes: its tokens in pieces of at most ``max_len`` (none when it is longer
        and long documents are dropped), pieces shorter than ``min_len`` left out."""
        ids = self._ids(text, None)
        return [self._piece(ids, k).tolist() for k in range(self._cut(ids)[0])]

    def next_batch(self) -> list[torch.Tensor]:
        """The next global batch: sequences in order while they fit ``tokens_per_batch`` (a document's
        sequences continue in the next batch when they do not). A :class:`DataError` when a whole pass over
        the corpus gives no sequence. The position moves only when a batch is returned: after an exception
        (the tokenizer's, a document too large for memory) ``state_dict`` is what it was before the call."""
        epoch, cursor, taken, current = self.epoch, self.cursor, self.taken, self._document
        batch: list[torch.Tensor] = []
        total, order = 0, self._order(epoch)
        empty: dict[int, str] = {}  # documents met since the last sequence that gave none, and why
        while True:
            if current is None:
                document = int(order[cursor])
                text = self.corpus.text(document)
                ids = self._ids(text, document)
                count, why = self._cut(ids)
                current = (document, ids, count)
                if why:
                    empty[document] = why
                    if len(empty) == len(self.corpus):
                        raise DataError(_nothing_to_cut(empty))
                else:
                    empty.clear()
            _, ids, count = current
            if taken < count:
                length = min(self.max_len, ids.size - taken * self.max_len)
                if total + length > self.tokens_per_batch and batch:
                    self.epoch, self.cursor, self.taken, self._document = epoch, cursor, taken, current
                    return batch
                batch.append(self._piece(ids, taken))
                total, taken = total + length, taken + 1
            if taken >= count:  # this document is done
                cursor, taken, current = cursor + 1, 0, None
                if cursor == len(order):
                    epoch, cursor, order = epoch + 1, 0, self._order(epoch + 1)

    def __iter__(self) -> "TokenBatches":
        """The batches themselves: ``next(batches)`` is ``next_batch()``, endlessly."""
        return self

    def __next__(self) -> list[torch.Tensor]:
        return self.next_batch()


def _nothing_to_cut(why: dict[int, str]) -> str:
    """One line: no document of the corpus gives a sequence, and how many for each reason."""
    counts: dict[str, int] = {}
    for reason in why.values():
        counts[reason] = counts.get(reason, 0) + 1
    reasons = "; ".join(f"{n} with {reason}" for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"no document of the corpus gives a sequence ({len(why)} documents: {reasons})"
