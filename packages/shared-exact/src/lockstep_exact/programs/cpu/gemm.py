"""gemm.kblock: y[m, n] = sum_k x[m, k] * w[n, k], in fixed K blocks."""

from __future__ import annotations

import torch

from .arith import F32, as_f32, require, round_bf16, tree_sum

# Rows per chunk are chosen so one chunk's products stay near this many bytes; the chunking
# changes no byte (each output element's operation sequence is fixed by K and bk alone).
_CHUNK_BYTES = 8 << 20


def gemm(x: torch.Tensor, w: torch.Tensor, *, bk: int, out_dtype=torch.bfloat16):
    """x [..., K] times w[N, K]^T.

    Products are formed in fp32 (exact for bf16 operands). Inside each block of ``bk``
    consecutive k the products are summed over the adjacent-pair tree; block sums are added
    left to right into an fp32 accumulator that starts as block 0. A ragged last block is
    padded with +0 products. One rounding to ``out_dtype`` (RNE) at the end.
    """
    require(x.shape[-1] == w.shape[-1], f"gemm: K mismatch {tuple(x.shape)} x {tuple(w.shape)}")
    require(w.dim() == 2, "gemm: weight must be [N, K]")
    require(bk >= 1 and bk & (bk - 1) == 0, f"gemm: bk must be a power of two, got {bk}")
    require(out_dtype in (torch.bfloat16, F32), f"gemm: unsupported out_dtype {out_dtype}")
    out = _block_sums(x, w, bk=bk, parts=1, chunk_bytes=_CHUNK_BYTES)
    return round_bf16(out) if out_dtype == torch.bfloat16 else out


# gemm.kpart's partial in one call, for any row count (rows are chunked for memory, which
# moves no byte). Its products hold every partition at once: chunks small enough to stay in
# cache (measured on this 2-core EPYC, one thread: 512 x 128 x 128 took 43.6 ms in 48 MiB
# chunks, the partitions one by one 15.3 ms).
_KPART_CHUNK_BYTES = 2 << 20


def kpart_partial(x: torch.Tensor, w: torch.Tensor, *, bk: int, parts: int) -> torch.Tensor:
    """gemm.kpart's fp32 partial [..., N]: the ``parts`` equal, contiguous K partitions of x
    [..., K] and w [N, K], each summed as ``gemm`` sums it (its own K blocks of ``bk``, a ragged
    last block padded with +0 products, block sums added left to right), then the partitions'
    sums added over the balanced adjacent-pair tree: the bytes of ``programs.kpart_partial``'s
    partition-by-partition form, with the partitions as one more batch dimension."""
    require(x.shape[-1] == w.shape[-1], f"kpart: K mismatch {tuple(x.shape)} x {tuple(w.shape)}")
    require(w.dim() == 2, "kpart: weight must be [N, K]")
    require(bk >= 1 and bk & (bk - 1) == 0, f"kpart: bk must be a power of two, got {bk}")
    k_dim = x.shape[-1]
    require(
        parts >= 1 and parts & (parts - 1) == 0 and k_dim % parts == 0,
        f"kpart: {parts} partitions must be a power of two dividing K = {k_dim}",
    )
    return _block_sums(x, w, bk=bk, parts=parts, chunk_bytes=_KPART_CHUNK_BYTES)


def _block_sums(x, w, *, bk: int, parts: int, chunk_bytes: int) -> torch.Tensor:
    """fp32 [..., N]: K cut into ``parts`` equal partitions (1: the whole of K), each summed in
    blocks of ``bk`` (products in fp32, the adjacent-pair tree inside a block, a ragged last
    block padded with +0 products, block sums added left to right from block 0), then the
    partitions' sums over the adjacent-pair tree (one partition: its sum). Rows go in chunks
    whose products stay near ``chunk_bytes``; the chunking moves no byte."""
    lead = x.shape[:-1]
    n_dim = w.shape[0]
    size = x.shape[-1] // parts
    xf = as_f32(x).reshape(-1, parts, size)
    wf = as_f32(w).reshape(n_dim, parts, size)
    nblocks = max(1, -(-size // bk))
    pad = nblocks * bk - size
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
        wf = torch.nn.functional.pad(wf, (0, pad))
    xb = xf.reshape(-1, parts, nblocks, bk)
    wb = wf.reshape(n_dim, parts, nblocks, bk)
    m_dim = xb.shape[0]
    out = torch.empty(m_dim, n_dim, dtype=F32)
    rows = max(1, chunk_bytes // max(1, n_dim * parts * bk * 4))
    for r0 in range(0, m_dim, rows):
        xs = xb[r0 : r0 + rows]
        acc = None
        for b in range(nblocks):
            part = tree_sum(xs[:, None, :, b, :] * wb[None, :, :, b, :])  # [rows, N, parts]
            acc = part if acc is None else acc + part
        out[r0 : r0 + rows] = tree_sum(acc)  # the pair tree over the partitions
    return out.reshape(*lead, n_dim)
