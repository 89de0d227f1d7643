"""hcompile.data: corpora of text files, JSON lines and parquet, byte and Hugging Face tokenizers, global batches
by token budget that are deterministic, cover each epoch's documents exactly once, and resume exactly."""

from __future__ import annotations

import contextlib
import json
import signal
import warnings

import pytest
import torch

from hcompile.data import ByteTokenizer, Corpus, DataError, HFTokenizer, TokenBatches, python_stdlib


def _corpus(tmp_path) -> Corpus:
    (tmp_path / "a.txt").write_text("hello world, " * 30)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("short")
    rows = [{"text": f"row {i} " * (i + 1)} for i in range(12)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "d.py").write_text("import os\n\ndef f(x):\n    return x\n\nclass C:\n    def m(self):\n        pass\n")
    return Corpus.from_paths(tmp_path, split_python=True)


def test_corpus_reads_files_rows_and_python_definitions(tmp_path):
    corpus = _corpus(tmp_path)
    texts = corpus.documents
    assert len(corpus) == 1 + 12 + 4 + 1  # a.txt; 12 rows; d.py: the preamble, f, class C, m; sub/b.md
    assert texts[0].startswith("hello") and texts[1] == "row 0 " and texts[13].startswith("import os")
    assert any(t.lstrip().startswith("def m") for t in texts) and texts[-1] == "short"


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["one", "two two", None]}), tmp_path / "x.parquet")
    assert Corpus.from_paths(tmp_path / "x.parquet", text_field="content").documents == ["one", "two two"]


def test_bad_corpora_are_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        Corpus.from_paths(tmp_path / "nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match="bad.jsonl:2 is not JSON"):
        Corpus.from_paths(bad)
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1 has no text field 'text'"):
        Corpus.from_paths(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text"):
        Corpus.from_paths(tmp_path / "empty")


def _all(batches: TokenBatches, n: int) -> list[list[torch.Tensor]]:
    return [batches.next_batch() for _ in range(n)]


def test_batches_respect_the_budget_and_cover_each_document_once(tmp_path):
    corpus = _corpus(tmp_path)
    data = TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=100, max_len=40, seed=3, min_len=1)
    seen = []
    while data.epoch == 0:
        batch = data.next_batch()
        assert sum(len(s) for s in batch) <= 100 and all(1 <= len(s) <= 40 for s in batch)
        assert all(s.dtype == torch.long for s in batch)
        seen += [t for s in batch for t in s.tolist()]
    order = data._order(0)
    want = [t for i in order for t in ByteTokenizer().encode(corpus.text(int(i)))]
    assert seen == want  # every token of the epoch, once, in the shuffled document order


def test_seeded_deterministic_and_resumable(tmp_path):
    corpus = _corpus(tmp_path)

    def make(seed):
        return TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=64, max_len=32, seed=seed)

    a, b, c = make(0), make(0), make(1)
    first = _all(a, 5)
    assert [[s.tolist() for s in x] for x in first] == [[s.tolist() for s in x] for x in _all(b, 5)]
    assert [[s.tolist() for s in x] for x in _all(c, 5)] != [[s.tolist() for s in x] for x in first]
    position = json.loads(json.dumps(a.state_dict()))  # what a checkpoint keeps
    expected = _all(a, 7)
    resumed = make(0)
    resumed.load_state_dict(position)
    assert [[s.tolist() for s in x] for x in _all(resumed, 7)] == [[s.tolist() for s in x] for x in expected]
    with pytest.raises(DataError, match="not of this corpus"):
        make(1).load_state_dict(position)
    with pytest.raises(DataError, match="not a data position"):
        make(0).load_state_dict({"epoch": 0})
    with pytest.raises(DataError, match="max_len 99 is more than the batch budget 64"):
        TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=64, max_len=99)


def test_a_hugging_face_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, ",": 3}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = HFTokenizer(transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]"))
    assert tok.vocab_size == 4 and tok.encode("hello world, again") == [1, 2, 3, 0]
    data = TokenBatches(_corpus(tmp_path), tok, tokens_per_batch=50, max_len=10)
    assert all(int(s.max()) < 4 for s in data.next_batch())
    with pytest.raises(DataError, match="encode method"):
        HFTokenizer(object())


def test_the_python_standard_library_is_a_corpus():
    files = python_stdlib()
    assert len(files) > 100 and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)


def _resume(rank, world, ckpt):
    import hcompile
    from hcompile.models import Llama, LlamaConfig, init_weights_

    def trainer():
        return hcompile.compile(init_weights_(Llama(LlamaConfig(vocab=256)), seed=0)).trainer(loss="causal_lm",
                                optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3}, tokens_per_rank=128,
                                strategies=["2x(tp1)"], calibrate=False)

    def batches():
        return TokenBatches(Corpus.from_paths(python_stdlib()[:40], split_python=True), ByteTokenizer(),
                            tokens_per_batch=256, max_len=128, seed=5)

    first, data = trainer(), batches()
    losses = [first.train_step(data.next_batch()).loss for _ in range(2)]
    first.save(ckpt, step=2, data_position=data.state_dict())
    uninterrupted = [first.train_step(data.next_batch()).loss for _ in range(2)]
    second, resumed = trainer(), batches()
    meta = second.load(ckpt)
    resumed.load_state_dict(meta["data_position"])
    return losses, uninterrupted, [second.train_step(resumed.next_batch()).loss for _ in range(2)], meta["step"]


def test_a_resumed_run_sees_the_same_batches(tmp_path):
    from dist_util import run_ranks

    for _, uninterrupted, resumed, step in run_ranks(2, tmp_path, _resume, str(tmp_path / "ckpt")):
        assert step == 2 and resumed == uninterrupted


def test_long_documents_split_or_dropped(tmp_path):
    corpus = Corpus(["x" * 10, "y" * 3, "z" * 25])
    split = TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=100, max_len=8)
    dropped = TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=100, max_len=8, long_documents="drop")
    assert [len(s) for s in split.sequences("z" * 25)] == [8, 8, 8]  # the last piece of 1 is under min_len
    assert dropped.sequences("z" * 25) == [] and [len(s) for s in dropped.sequences("y" * 3)] == [3]
    assert {len(s) for s in dropped.next_batch()} == {3}  # only y, epoch after epoch, up to the budget
    with pytest.raises(DataError, match="long_documents must be 'split' or 'drop', got 'cut'"):
        TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=100, max_len=8, long_documents="cut")


@contextlib.contextmanager
def _deadline(seconds: float):
    """A TimeoutError in this (the main) thread after ``seconds``: a loop that never ends fails the test."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("options, needle", [
    ({"max_len": 1, "min_len": 1}, "max_len must be at least 2"),
    ({"max_len": 8, "min_len": 9}, "min_len 9 is more than max_len 8: no sequence could be cut"),
    ({"max_len": 8, "seed": -1}, "seed must be a non-negative integer, got -1"),
])
def test_options_that_cannot_cut_a_sequence_are_refused_at_construction(options, needle):
    with pytest.raises(DataError, match=needle):
        TokenBatches(Corpus(["some text"]), ByteTokenizer(), tokens_per_batch=64, **options)


@pytest.mark.parametrize("documents, options, needle", [
    (["x" * 20, "y" * 30], {"long_documents": "drop"}, "2 documents: 2 with more than max_len 8 tokens"),
    (["a", "b", "c"], {}, "3 documents: 3 with fewer than min_len 2 tokens"),
    (["a", "z" * 20], {"long_documents": "drop"}, "2 documents: 1 with fewer than min_len 2 tokens; 1 with more"),
])
def test_a_corpus_that_gives_no_sequence_is_an_error_not_a_spin(documents, options, needle):
    data = TokenBatches(Corpus(documents), ByteTokenizer(), tokens_per_batch=64, max_len=8, **options)
    with _deadline(10), pytest.raises(DataError, match=f"no document of the corpus gives a sequence \\({needle}"):
        data.next_batch()


def test_one_character_files_are_an_error_not_a_spin(tmp_path):
    for i in range(5):
        (tmp_path / f"{i}.txt").write_text("abcde"[i])
    data = TokenBatches(Corpus.from_paths(tmp_path), ByteTokenizer(), tokens_per_batch=64, max_len=8)
    with _deadline(10), pytest.raises(DataError, match="5 documents: 5 with fewer than min_len 2 tokens"):
        data.next_batch()


def test_a_position_of_another_corpus_or_other_options_is_refused():
    corpus, other = Corpus(["alpha " * 9, "beta " * 7]), Corpus(["gamma " * 9, "delta " * 7])
    data = TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=64, max_len=16, seed=1)
    data.next_batch()
    position = json.loads(json.dumps(data.state_dict()))
    with pytest.raises(DataError, match="not of this corpus"):  # as many documents, other text
        TokenBatches(other, ByteTokenizer(), tokens_per_batch=64, max_len=16, seed=1).load_state_dict(position)
    with pytest.raises(DataError, match="a run with max_len=16, this one has 32: its documents are cut otherwise"):
        TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=64, max_len=32, seed=1).load_state_dict(position)
    with pytest.raises(DataError, match="a run with long_documents='split', this one has 'drop'"):
        TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=64, max_len=16, seed=1,
                     long_documents="drop").load_state_dict(position)
    larger = TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=128, max_len=16, seed=1)
    larger.load_state_dict(position)  # another batch budget cuts the documents alike: accepted
    assert (larger.epoch, larger.cursor, larger.taken) == (data.epoch, data.cursor, data.taken)


def test_bytes_that_are_not_utf8_are_counted_and_reported_once_or_refused(tmp_path):
    (tmp_path / "good.txt").write_text("plain text")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 and \xff\xfe twice")
    (tmp_path / "rows.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "r\xe9sum\xe9"}\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        corpus = Corpus.from_paths(tmp_path)
    messages = [str(w.message) for w in caught]
    assert corpus.replaced_bytes == 5 and len(messages) == 1, messages
    assert "2 of 3 corpus files hold bytes that are not UTF-8 (5 bytes" in messages[0]
    assert any("\ufffd" in d for d in corpus.documents)
    with pytest.raises(DataError, match="bad.txt holds 3 bytes that are not UTF-8 \\(strict=True\\)"):
        Corpus.from_paths(tmp_path, strict=True)


def test_a_parquet_text_column_that_is_not_strings_is_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    with pytest.raises(DataError, match="ints.parquet: column 'text' holds int64, not strings"):
        Corpus.from_paths(tmp_path / "ints.parquet")


class _Failing:
    """Bytes as tokens; raises ``error`` on the document ``bad`` while ``armed``."""

    vocab_size = 256

    def __init__(self, bad: str, error: BaseException):
        self.bad, self.error, self.armed = bad, error, True

    def encode(self, text):
        if self.armed and text == self.bad:
            raise self.error
        return list(text.encode())


def test_next_batch_moves_only_when_it_returns_a_batch():
    """A tokenizer that fails mid-batch (after some sequences were counted into it) leaves the position where
    it was; the next call gives exactly the batch an undisturbed source gives."""
    corpus = Corpus([f"document {i} " * (2 + i % 5) for i in range(20)])
    plain = TokenBatches(corpus, ByteTokenizer(), tokens_per_batch=96, max_len=24, seed=4)
    expected = [plain.next_batch() for _ in range(6)]
    order = [int(i) for i in plain._order(0)]
    tokenizer = _Failing(corpus.text(order[9]), ValueError("bad record"))
    data = TokenBatches(corpus, tokenizer, tokens_per_batch=96, max_len=24, seed=4)
    got, failures = [], 0
    while len(got) < 6:
        before = data.state_dict()
        try:
            got.append(data.next_batch())
        except ValueError:
            failures += 1
            assert data.state_dict() == before
            tokenizer.armed = False
    assert failures == 1 and all(len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
                                 for a, b in zip(got, expected))
    assert iter(data) is data and len(next(data)) > 0  # its own iterator: next(data) is next_batch()


def test_a_document_too_large_for_memory_is_a_data_error_naming_it(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "small"}) + "\n" + json.dumps({"text": "big " * 50}) + "\n")
    corpus = Corpus.from_paths(tmp_path)
    data = TokenBatches(corpus, _Failing("big " * 50, MemoryError()), tokens_per_batch=256, max_len=16, seed=0)
    with pytest.raises(DataError, match=r"document 1 \(.*a.jsonl, its document 2 of 2\) \(200 characters\) does "
                                         "not fit in memory once tokenized"):
        for _ in range(4):
            before = data.state_dict()
            data.next_batch()
    assert data.state_dict() == before  # the position where the failing call found it


def test_a_long_document_is_cut_in_linear_time():
    """A 16 MB one-line document: its ids are one byte array and its pieces are taken by index, so every batch
    of it costs the same (a list consumed with pop(0) made a 200 MB line take 53 s)."""
    import time

    data = TokenBatches(Corpus(["x" * (16 << 20)]), ByteTokenizer(), tokens_per_batch=4096, max_len=512)
    started = time.monotonic()
    tokens = sum(sum(len(s) for s in data.next_batch()) for _ in range(4096))
    assert tokens == 16 << 20 and (data.epoch, data.cursor) == (1, 0)
    assert time.monotonic() - started < 20


def test_an_unreadable_parquet_file_and_a_tokenizer_name_are_refused_by_name(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(DataError, match="broken.parquet is not a readable parquet file"):
        Corpus.from_paths(tmp_path)
    for name in ("gpt2", tmp_path):
        with pytest.raises(DataError, match=r"HFTokenizer takes a loaded tokenizer, not a name or path .*"
                                            r"AutoTokenizer.from_pretrained\("):
            HFTokenizer(name)
