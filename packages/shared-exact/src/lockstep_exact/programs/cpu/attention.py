"""attention.blocked: causal GQA over absolute-position-aligned KV blocks."""

from __future__ import annotations

import torch

from .arith import BF16, F32, as_f32, exp, require, round_bf16, sqrt_rn, tree_sum

_CHUNK_BYTES = 8 << 20


def default_scale(head_dim: int) -> torch.Tensor:
    """1 / sqrt(D) as float32, from IEEE sqrt and division."""
    return 1.0 / sqrt_rn(torch.tensor(float(head_dim), dtype=F32))


def check_inputs(q, k, v, positions) -> tuple[int, int, int, int, int]:
    """The input rules of attention.blocked on every backend; (T, Hq, D, S, Hkv)."""
    require(q.dtype == BF16 and k.dtype == BF16 and v.dtype == BF16, "attention: bf16 q/k/v")
    require(
        q.dim() == 3 and k.dim() == 3 and v.shape == k.shape, "attention: q [T,Hq,D], k/v [S,Hkv,D]"
    )
    n_q, h_q, d = q.shape
    s_len, h_kv, _ = k.shape
    require(k.shape[-1] == d, "attention: q and k head dims differ")
    require(h_q % h_kv == 0, f"attention: {h_q} query heads over {h_kv} kv heads")
    require(positions.shape == (n_q,), "attention: one position per query")
    return n_q, h_q, d, s_len, h_kv


def check_tiling(block: int, segment: int) -> None:
    """The parameter rules of attention.blocked on every backend."""
    require(block >= 1 and block & (block - 1) == 0, "attention: block must be a power of two")
    require(
        segment >= block and segment % block == 0,
        f"attention: segment ({segment}) must be a positive multiple of block ({block})",
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    block: int,
    segment: int,
) -> torch.Tensor:
    """Causal attention of the queries of ONE sequence.

    q [T, Hq, D] bf16 at absolute ``positions`` [T]; k, v [S, Hkv, D] bf16 hold that
    sequence's keys and values for positions 0..S-1 (S > max(positions)). Query t attends to
    keys 0..t. Keys are cut into segments of ``segment`` positions and blocks of ``block``,
    both aligned to absolute position 0. Per row, for each segment in ascending order, a fresh
    state (m=-inf, l=0, acc=0) and for each block of the segment, ascending:

      s = tree_sum_D(q*k) * scale           masked (key > t) -> -inf
      m' = max(m, max_block(s)); a = exp(m - m'); p = exp(s - m')
      l' = l*a + tree_sum_B(p);  acc' = acc*a + tree_sum_B(p*v)   (masked p*v -> +0)

    then the segment is merged into the running state (Mg=-inf, Lg=0, Ag=0 at the start):
      M = max(Mg, m); a = exp(Mg - M); b = exp(m - M); Lg = Lg*a + l*b; Ag = Ag*a + acc*b
    out = bf16(Ag / Lg).

    A row's operation sequence depends on t and the key/value bytes only, so the output for
    position t is the same in a prefill of T tokens, in any chunk of a chunked prefill, and as
    one decode step over a cache. The segments are the cuda program's unit of parallel work
    (a decode computes them side by side); here they only fix where the merges happen.
    """
    n_q, h_q, d, s_len, h_kv = check_inputs(q, k, v, positions)
    check_tiling(block, segment)
    if n_q == 0:
        return q.clone()
    require(int(positions.min()) >= 0, "attention: negative position")
    require(int(positions.max()) < s_len, "attention: a query position has no key in k/v")
    if scale is None:
        scale = default_scale(d)
    g = h_q // h_kv
    pos = positions.to(torch.int64)
    qf = as_f32(q).reshape(n_q, h_kv, g, d)
    kf = as_f32(k)
    vf = as_f32(v)
    n_blocks = int(pos.max()) // block + 1
    pad = n_blocks * block - s_len
    if pad > 0:
        kf = torch.nn.functional.pad(kf, (0, 0, 0, 0, 0, pad))
        vf = torch.nn.functional.pad(vf, (0, 0, 0, 0, 0, pad))
    out = torch.empty(n_q, h_kv, g, d, dtype=F32)
    rows = max(1, _CHUNK_BYTES // max(1, h_q * block * d * 4))
    for r0 in range(0, n_q, rows):
        out[r0 : r0 + rows] = _rows(
            qf[r0 : r0 + rows], kf, vf, pos[r0 : r0 + rows], scale, block, segment
        )
    return round_bf16(out.reshape(n_q, h_q, d))


def _rows(qf, kf, vf, pos, scale, block, segment):
    n_q, h_kv, g, d = qf.shape
    m_g = torch.full((n_q, h_kv, g), float("-inf"), dtype=F32)
    l_g = torch.zeros(n_q, h_kv, g, dtype=F32)
    a_g = torch.zeros(n_q, h_kv, g, d, dtype=F32)
    seg_blocks = segment // block
    last = int(pos.max()) // block
    for j0 in range(0, last + 1, seg_blocks):
        m, l_s, acc = _segment(qf, kf, vf, pos, scale, block, j0, min(j0 + seg_blocks, last + 1))
        m_g, l_g, a_g = _merge(m_g, l_g, a_g, m, l_s, acc, pos >= j0 * block)
    return a_g / l_g[..., None]


def _segment(qf, kf, vf, pos, scale, block, j_lo, j_hi):
    """The online-softmax state of the rows over key blocks [j_lo, j_hi), from a fresh state."""
    n_q, h_kv, g, d = qf.shape
    neg_inf = torch.tensor(float("-inf"), dtype=F32)
    m = torch.full((n_q, h_kv, g), float("-inf"), dtype=F32)
    l_sum = torch.zeros(n_q, h_kv, g, dtype=F32)
    acc = torch.zeros(n_q, h_kv, g, d, dtype=F32)
    for j in range(j_lo, j_hi):
        kb = kf[j * block : (j + 1) * block].permute(1, 0, 2)  # [Hkv, B, D]
        vb = vf[j * block : (j + 1) * block].permute(1, 0, 2)
        key_pos = torch.arange(j * block, (j + 1) * block)
        valid = key_pos[None, :] <= pos[:, None]  # [T, B]
        active = pos >= j * block  # the row has at least one valid key in this block
        s = tree_sum(qf[:, :, :, None, :] * kb[None, :, None, :, :]) * scale  # [T,Hkv,G,B]
        s = torch.where(valid[:, None, None, :], s, neg_inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(active[:, None, None], m_new, torch.zeros_like(m_new))
        alpha = exp(m - m_safe)
        p = exp(s - m_safe[..., None])
        pv = p[..., None] * vb[None, :, None, :, :]  # [T,Hkv,G,B,D]
        pv = torch.where(valid[:, None, None, :, None], pv, torch.zeros_like(pv))
        l_new = l_sum * alpha + tree_sum(p)
        acc_new = acc * alpha[..., None] + tree_sum(pv, dim=-2)
        keep = active[:, None, None]
        m = torch.where(keep, m_new, m)
        l_sum = torch.where(keep, l_new, l_sum)
        acc = torch.where(keep[..., None], acc_new, acc)
    return m, l_sum, acc


def _merge(m_g, l_g, a_g, m, l_s, acc, active):
    """Fold one segment's state into the running one, for the rows where ``active``."""
    m_new = torch.maximum(m_g, m)
    keep = active[:, None, None]
    m_safe = torch.where(keep, m_new, torch.zeros_like(m_new))
    alpha = exp(m_g - m_safe)
    beta = exp(m - m_safe)
    l_new = l_g * alpha + l_s * beta
    a_new = a_g * alpha[..., None] + acc * beta[..., None]
    return (
        torch.where(keep, m_new, m_g),
        torch.where(keep, l_new, l_g),
        torch.where(keep[..., None], a_new, a_g),
    )


def check_starts(q_starts, k_starts) -> None:
    """The rules of attention.blocked's many-sequence call on the starts tensors themselves
    (their values are checked where they are read): [R + 1] int32 or int64 offsets each."""
    for name, s in (("q_starts", q_starts), ("k_starts", k_starts)):
        require(
            s.dim() == 1 and s.shape[0] >= 1 and s.dtype in (torch.int32, torch.int64),
            f"attention_varlen: {name} must be a 1-D int32 or int64 tensor of R + 1 offsets",
        )
    require(q_starts.shape == k_starts.shape, "attention_varlen: q_starts and k_starts differ")


def spans(q_starts, k_starts, n_q: int, s_len: int, max_rows: int) -> list[tuple[int, ...]]:
    """The requests' (row start, row end, key start, key end), read on the host and checked:
    rows cover 0..n_q in order, each request's keys lie in 0..s_len, no request has more
    than ``max_rows`` rows."""
    qs, ks = q_starts.tolist(), k_starts.tolist()
    require(qs[0] == 0 and qs[-1] == n_q, f"attention_varlen: q_starts must run from 0 to {n_q}")
    out = []
    for r in range(len(qs) - 1):
        q_lo, q_hi, k_lo, k_hi = qs[r], qs[r + 1], ks[r], ks[r + 1]
        require(
            0 <= q_hi - q_lo <= max_rows,
            f"attention_varlen: request {r} has {q_hi - q_lo} rows (0..{max_rows} allowed)",
        )
        require(
            0 <= k_lo <= k_hi <= s_len,
            f"attention_varlen: request {r}'s keys [{k_lo}, {k_hi}) are not within 0..{s_len}",
        )
        out.append((q_lo, q_hi, k_lo, k_hi))
    return out


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    q_starts: torch.Tensor,
    k_starts: torch.Tensor,
    *,
    max_rows: int,
    scale: torch.Tensor | None = None,
    block: int,
    segment: int,
) -> torch.Tensor:
    """attention.blocked for many sequences at once: request r's query rows are
    q[q_starts[r]:q_starts[r+1]] at those ``positions``, its keys and values
    k/v[k_starts[r]:k_starts[r+1]] (its positions 0, 1, ...). Each request runs through
    ``attention`` on its own rows and keys, so every row has that program's bytes by
    construction. ``max_rows`` bounds every request's row count (the cuda form sizes its
    launch from it)."""
    n_q, _, _, s_len, _ = check_inputs(q, k, v, positions)
    check_tiling(block, segment)
    check_starts(q_starts, k_starts)
    out = torch.empty_like(q)
    for q_lo, q_hi, k_lo, k_hi in spans(q_starts, k_starts, n_q, s_len, max_rows):
        if q_hi > q_lo:
            out[q_lo:q_hi] = attention(
                q[q_lo:q_hi], k[k_lo:k_hi], v[k_lo:k_hi], positions[q_lo:q_hi],
                scale=scale, block=block, segment=segment,
            )  # fmt: skip
    return out
