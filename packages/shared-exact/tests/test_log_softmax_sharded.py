"""Vocab-parallel log_softmax.tree: ranks holding contiguous shards of the row (even, uneven,
Megatron's padded vocabulary) get, concatenated in rank order, the bytes of the unsharded
program; a one-ulp change in one shard is caught; bad shard layouts are refused by name.

In-process ranks are threads exchanging tensors through a barrier (the programs' ``Gather``);
one test runs the real distributed path (two processes over gloo)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from sharded_support import INF, gloo_rank, rows

from lockstep_exact import programs as P
from lockstep_exact.parity import same_bytes
from lockstep_exact.programs.cpu.softmax import tree_node_count, tree_spans, tree_width
from lockstep_exact.testing import nudge_ulp


class _Board:
    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots: list = [None] * size


class ThreadGather(P.Gather):
    """One rank of ``board``: ``all`` returns every rank's tensor in rank order."""

    def __init__(self, board: _Board, rank: int):
        self.board, self.rank, self.size = board, rank, board.size

    def all(self, t):
        b = self.board
        b.slots[self.rank] = t
        b.barrier.wait()
        out = list(b.slots)
        b.barrier.wait()
        return out


def run_ranks(fn, size: int) -> list:
    """``fn(rank, gather)`` in ``size`` threads; results in rank order, the first error raised."""
    board = _Board(size)
    results: list = [None] * size
    errors: list = []

    def main(rank):
        try:
            results[rank] = fn(rank, ThreadGather(board, rank))
        except BaseException as err:  # noqa: BLE001 (re-raised below)
            errors.append(err)
            board.barrier.abort()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next(
            (e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0]
        )
    return results


def sharded(x: torch.Tensor, bounds: list[int], vocab: int) -> torch.Tensor:
    """Every rank r holds columns [bounds[r], bounds[r+1]) (of a row padded to bounds[-1]);
    their log_softmax_sharded results concatenated in rank order."""

    def rank(r, gather):
        lo, hi = bounds[r], bounds[r + 1]
        return P.log_softmax_sharded(x[..., lo:hi].contiguous(), lo, vocab, gather)

    return torch.cat(run_ranks(rank, len(bounds) - 1), dim=-1)


def even(vocab: int, t: int) -> list[int]:
    return [vocab * r // t for r in range(t + 1)]


def uneven(vocab: int, t: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(vocab - 1, generator=g)[: t - 1].add(1).tolist())
    return [0, *cuts, vocab]


def megatron(vocab: int, t: int, divisible_by: int = 128) -> list[int]:
    """Megatron's padded vocabulary: a multiple of divisible_by * t, equal shards."""
    step = divisible_by * t
    padded = -(-vocab // step) * step
    return [padded * r // t for r in range(t + 1)]


def padded_row(x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """The logits a padded head computes: the padding columns hold some value (here 0)."""
    return torch.nn.functional.pad(x, (0, bounds[-1] - x.shape[-1]), value=0.0)


VOCABS = [1000, 1024, 32003, 151936]


def bumped(x: torch.Tensor) -> torch.Tensor:
    """The input control: ``x`` with row 0's largest logit one fp32 ulp up."""
    out = x.clone()
    flat = out.view(-1, out.shape[-1])
    col = int(flat[0].argmax())
    flat[0, col] = torch.nextafter(flat[0, col], torch.tensor(INF, device=x.device))
    return out


def moved_row_0_only(got: torch.Tensor, ref: torch.Tensor) -> bool:
    got, ref = got.reshape(-1, got.shape[-1]), ref.reshape(-1, ref.shape[-1])
    return not same_bytes(got[0], ref[0]) and same_bytes(got[1:], ref[1:])


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("t", [2, 3, 4, 8])
def test_sharded_log_softmax_has_the_unsharded_bytes(vocab, t):
    x = rows(vocab, seed=vocab + t)
    ref = P.log_softmax(x)
    for what, bounds in (
        ("even", even(vocab, t)),
        ("uneven", uneven(vocab, t, seed=t)),
        ("megatron-padded", megatron(vocab, t)),
    ):
        got = sharded(padded_row(x, bounds), bounds, vocab)
        assert got.shape == ref.shape, what
        assert same_bytes(got, ref), (vocab, t, what)


def test_megatron_padding_may_leave_whole_ranks_without_a_real_column():
    vocab = 1000
    bounds = megatron(vocab, 8, divisible_by=256)  # 2048 columns: ranks 4..7 are all padding
    assert bounds[4] >= vocab
    x = rows(vocab, seed=3)
    assert same_bytes(sharded(padded_row(x, bounds), bounds, vocab), P.log_softmax(x))
    moved = sharded(padded_row(bumped(x), bounds), bounds, vocab)
    assert moved_row_0_only(moved, P.log_softmax(x))


@pytest.mark.parametrize("vocab", [1000, 32003])
def test_control_one_ulp_in_one_shard_is_caught(vocab):
    x = rows(vocab, seed=1)
    ref = P.log_softmax(x)
    bounds = uneven(vocab, 3, seed=5)
    col = bounds[1] + int(x[0, bounds[1] : bounds[2]].argmax())  # rank 1's largest logit
    bumped = x.clone()
    bumped[0, col] = torch.nextafter(x[0, col], torch.tensor(INF))
    got = sharded(bumped, bounds, vocab)
    assert not same_bytes(got, ref)
    assert same_bytes(got[1:], ref[1:])  # only the bumped row moved


def test_per_shard_sums_added_in_rank_order_would_not_be_the_same_bytes():
    """Why the nodes: each rank summing its whole shard and adding the partials misses the
    unsharded tree's additions (shown on uneven shards), so the test above can fail."""
    from lockstep_exact.programs.cpu.arith import exp, log, tree_sum

    vocab, bounds = 32003, uneven(32003, 3, seed=5)
    x = torch.randn(16, vocab, generator=torch.Generator().manual_seed(0))
    s = x - x.amax(-1, keepdim=True)
    total = sum(tree_sum(exp(s[:, a:b])) for a, b in zip(bounds, bounds[1:], strict=False))
    assert not same_bytes(s - log(total)[:, None], P.log_softmax(x))


def test_one_rank_is_todays_program_and_batches_of_any_shape_work():
    x = rows(1000, seed=2)
    assert same_bytes(P.log_softmax_sharded(x, 0, 1000), P.log_softmax(x))
    assert moved_row_0_only(P.log_softmax_sharded(bumped(x), 0, 1000), P.log_softmax(x))
    x3 = x.view(3, 3, 1000)
    got = sharded(x3, even(1000, 4), 1000)
    assert got.shape == (3, 3, 1000) and same_bytes(got, P.log_softmax(x3))
    assert moved_row_0_only(sharded(bumped(x3), even(1000, 4), 1000), P.log_softmax(x3))


def test_a_backend_without_the_node_split_gathers_the_whole_row(monkeypatch):
    """cuda's path (exercised here with the cpu programs): all-gather the fp32 row, run the
    one-device log_softmax, keep this rank's columns."""
    cpu = P.cpu
    lacking = SimpleNamespace(log_softmax=cpu.log_softmax)
    monkeypatch.setattr(P, "backend_module", lambda backend: lacking)
    vocab = 1000
    x = rows(vocab, seed=4)
    ref = cpu.log_softmax(x)
    for bounds in (uneven(vocab, 3, seed=1), megatron(vocab, 4)):
        assert same_bytes(sharded(padded_row(x, bounds), bounds, vocab), ref)
        moved = sharded(padded_row(bumped(x), bounds), bounds, vocab)
        assert moved_row_0_only(moved, ref)


@pytest.mark.parametrize("vocab", [1, 2, 3, 1000, 1024, 32003, 151936])
def test_tree_spans_tile_a_range_with_aligned_subtrees(vocab):
    width = tree_width(vocab)
    g = torch.Generator().manual_seed(vocab)
    for _ in range(50):
        lo, hi = sorted(torch.randint(0, width + 1, (2,), generator=g).tolist())
        spans = tree_spans(lo, hi)
        assert len(spans) <= tree_node_count(vocab)
        p = lo
        for start, size in spans:
            assert start == p and size & (size - 1) == 0 and start % size == 0
            p += size
        assert p == hi or (lo == hi and not spans)


# --- refusals ------------------------------------------------------------------------------------
def test_refuses_logits_that_are_not_fp32():
    with pytest.raises(
        ValueError, match="log_softmax.tree takes float32 logits, got torch.bfloat16"
    ):
        P.log_softmax_sharded(torch.zeros(2, 8, dtype=torch.bfloat16), 0, 8)


def test_refuses_one_rank_that_holds_part_of_the_row():
    with pytest.raises(ValueError, match=r"one rank holds columns \[4, 8\) of a 8-column row"):
        P.log_softmax_sharded(torch.zeros(2, 4), 4, 8)


def test_refuses_a_negative_start():
    with pytest.raises(ValueError, match="shard at column -1 of a 8-column row"):
        P.log_softmax_sharded(torch.zeros(2, 4), -1, 8)


def test_refuses_shards_that_do_not_tile_the_row_in_rank_order():
    x = torch.zeros(2, 12)
    with pytest.raises(
        ValueError, match="rank 1 holds columns from 6, but the ranks before it end"
    ):
        run_ranks(lambda r, g: P.log_softmax_sharded(x[:, :4], [0, 6][r], 12, g), 2)
    with pytest.raises(ValueError, match="the 2 shards end at column 8 < 12"):
        run_ranks(lambda r, g: P.log_softmax_sharded(x[:, :4], 4 * r, 12, g), 2)


def test_refuses_ranks_with_different_rows():
    with pytest.raises(ValueError, match=r"the ranks hold different numbers of rows: \[2, 3\]"):
        run_ranks(lambda r, g: P.log_softmax_sharded(torch.zeros(2 + r, 4), 4 * r, 8, g), 2)


# --- the real distributed path -----------------------------------------------------------------
def test_two_gloo_processes_get_the_unsharded_bytes(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(
        gloo_rank,
        args=(str(tmp_path / "store"), str(tmp_path / "lp")),
        nprocs=2,
        start_method="spawn",
    )
    got = torch.cat([torch.load(tmp_path / f"lp.{r}") for r in range(2)], dim=-1)
    assert same_bytes(got, P.log_softmax(rows(32003, seed=7)))


def test_the_sharded_backward_is_the_textbook_vjp_of_the_whole_row():
    """Not a parity claim (the trainer owns its backward): each rank's gradient of a loss over
    its own columns equals, on its columns, the gradient of log_softmax over the whole row."""
    from lockstep_exact.lanes.ops import _sharded_log_softmax_ideal
    from lockstep_exact.programs import vjp as V

    vocab = 1000
    x = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 3.0
    w = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    bounds = megatron(vocab, 3)

    def rank(r, gather):
        lo, hi = bounds[r], bounds[r + 1]
        xs = padded_row(x, bounds)[:, lo:hi].clone().requires_grad_(True)
        out = V.exact(
            lambda z: P.log_softmax_sharded(z, lo, vocab, gather),
            _sharded_log_softmax_ideal(lo, vocab, gather),
            xs,
        )
        (w[:, lo : lo + out.shape[-1]] * out).sum().backward()
        return xs.grad[:, : out.shape[-1]]

    got = torch.cat(run_ranks(rank, 3), dim=-1)
    xf = x.clone().requires_grad_(True)
    (w * torch.log_softmax(xf, -1)).sum().backward()
    torch.testing.assert_close(got, xf.grad)


def test_lm_head_rows_give_the_whole_heads_bytes_for_their_columns():
    """gemm.kblock computes each output element alone, so a vocab-parallel head's logits are
    the whole head's columns (what the sharded log_softmax is fed)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    w = torch.randn(1000, 96, generator=g).to(torch.bfloat16)
    full = P.gemm(x, w, bk=32, out_dtype=torch.float32)
    for lo, hi in ((0, 333), (333, 334), (334, 1000), (17, 911)):
        assert same_bytes(P.gemm(x, w[lo:hi], bk=32, out_dtype=torch.float32), full[:, lo:hi])
        # input control: the shard's first head row, its largest element one bf16 ulp off,
        # moves that column and no other
        ws = w[lo:hi].clone()
        ws[0] = nudge_ulp(ws[0], int(ws[0].float().argmax()))
        moved = P.gemm(x, ws, bk=32, out_dtype=torch.float32)
        assert not same_bytes(moved[:, 0], full[:, lo])
        assert same_bytes(moved[:, 1:], full[:, lo + 1 : hi])


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [1000, 32003, 151936])
def test_on_cuda_the_gathered_row_gives_the_unsharded_bytes(vocab):
    """cuda has no node split: each rank gathers the fp32 row and keeps its columns of the
    cuda program's bytes (threads stand in for the ranks, on one device); one ulp is caught."""
    x = rows(vocab, seed=7).cuda()
    ref = P.log_softmax(x)
    for bounds in (uneven(vocab, 3, seed=2), megatron(vocab, 4)):
        assert same_bytes(sharded(padded_row(x, bounds), bounds, vocab), ref), bounds
    bumped = x.clone()
    col = int(x[0].argmax())
    bumped[0, col] = torch.nextafter(x[0, col], torch.tensor(INF, device="cuda"))
    assert not same_bytes(sharded(bumped, even(vocab, 2), vocab), ref)
