"""The cases of the ``round-four`` job (``tests/test_fault_round_four.py``), run on every rank of one ``hcompile
launch --nproc 2`` job with a trained ``Trainer``: one rank's data iterator raises inside ``fit`` (every rank
catches it, saves and goes on, as a script's ``except: save; raise`` does), one rank's iterator ends early, and
``save``, ``save_pretrained`` and ``load`` called on rank 0 alone while rank 1 trains. Each case prints one line
per rank, ``case <name> <rank> <json>``, with the error it met and whether the files on disk and the weights are
as they were."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
from fault_refusals import files, refused, say, unchanged

from hcompile.data import Corpus, DataError, TokenBatches

DOCS = [("abcdefghij" * 6)[: 20 + 7 * (i % 6)] + str(i) for i in range(30)]  # one sequence each (max_len 64)


class Tokens:
    """Bytes modulo 64; on ``fail_rank``, encode call ``fail_at`` (1-based) raises ``ValueError`` once."""

    vocab_size = 64

    def __init__(self, rank: int = 0, fail_rank: int = -1, fail_at: int = 0):
        self.calls, self.fail = 0, fail_at if rank == fail_rank else 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        if self.calls == self.fail:
            raise ValueError(f"corrupt record in encode call {self.calls}")
        return [b % 64 for b in text.encode()]


def data(tokenizer: Tokens | None = None) -> TokenBatches:
    return TokenBatches(Corpus(DOCS), tokenizer or Tokens(), tokens_per_batch=128, max_len=64, seed=2)


def position_after(n: int) -> dict:
    """A fresh source's position after ``n`` batches (what a run that trained ``n`` of them must save)."""
    source = data()
    for _ in range(n):
        source.next_batch()
    return source.state_dict()


def one_rank_raises(trainer, tmp: Path, rank: int) -> dict:
    """Rank 1's tokenizer raises while ``fit`` takes batch 4 (batch 3 held, untrained): the same ``DataError``
    on both ranks naming rank 1 and its ``ValueError`` (chained on rank 1); each rank catches it and saves
    ``data.state_dict()``, which is the first untrained batch on both; the save is whole and loads."""
    probe = Tokens()
    reference = data(probe)
    for _ in range(4):
        reference.next_batch()
    source, trained = data(Tokens(rank, fail_rank=1, fail_at=probe.calls + 1)), []
    ckpt = tmp / "caught"
    result: dict = {}
    try:
        trainer.fit(source, steps=10, on_step=lambda step, stats: trained.append(step))
    except DataError as exc:  # the script's "except: save; raise"
        result["error"] = [type(exc).__name__, str(exc)]
        result["cause"] = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        trainer.save(str(ckpt), step=len(trained), data_position=source.state_dict())
    result["trained"] = len(trained)
    result["position_first_untrained"] = source.state_dict() == position_after(3)
    meta = json.loads((ckpt / (ckpt / "LATEST").read_text().strip() / "meta.json").read_text())
    result["saved_position_first_untrained"] = meta["data_position"] == position_after(3) and meta["step"] == 3
    before = trainer.full_state_dict()
    result["loads"] = trainer.load(str(ckpt))["step"] == 3 and unchanged(before, trainer)
    return result


def one_rank_ends(trainer, tmp: Path, rank: int) -> dict:
    """Rank 1's batches end one batch before rank 0's: the same ``DataError`` on both ranks."""
    batches = [data().next_batch()] * (2 if rank == 1 else 3)
    return {"refused": refused(lambda: trainer.fit(batches))}


def _rank0_only(trainer, tmp: Path, rank: int, call) -> dict:
    """``call`` on rank 0 while rank 1 runs ``train_step``: the same ``CollectiveCallError`` on both ranks, the
    folder and the weights as they were, and the ranks still in step (a ``train_step`` on both works)."""
    folder = tmp / "theirs"
    if rank == 0 and not folder.exists():
        folder.mkdir()
        (folder / "notes.txt").write_text("the user's notes\n")
    dist.barrier()
    before, weights = files(folder), trainer.full_state_dict()
    batch = data().next_batch()
    error = refused(lambda: call(str(folder)) if rank == 0 else trainer.train_step(batch))
    same = files(folder) == before and unchanged(weights, trainer)
    then_trains = trainer.train_step(batch) is not None
    return {"refused": error, "unchanged": same, "then_trains": then_trains}


def rank0_save(trainer, tmp: Path, rank: int) -> dict:
    return _rank0_only(trainer, tmp, rank, lambda path: trainer.save(path, step=1, data_position=1))


def rank0_export(trainer, tmp: Path, rank: int) -> dict:
    return _rank0_only(trainer, tmp, rank, trainer.save_pretrained)


def rank0_load(trainer, tmp: Path, rank: int) -> dict:
    return _rank0_only(trainer, tmp, rank, lambda path: trainer.load(str(tmp / "caught")))


CASES = {"one-rank-raises": one_rank_raises, "one-rank-ends": one_rank_ends, "rank0-save": rank0_save,
         "rank0-export": rank0_export, "rank0-load": rank0_load}


def run(trainer, tmp: str, rank: int) -> None:
    """Every case in order, on every rank (the collective ones in step), each printing its line."""
    for name, case in CASES.items():
        say(name, rank, case(trainer, Path(tmp), rank))
