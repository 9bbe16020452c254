"""sample.gumbel_topp: the token a row's exact log-probabilities, seed and position draw.

Two parts, both made of operations whose results are fixed to the bit:

- a counter-based random stream: one uniform in (0, 1) per (seed, position, vocabulary id),
  from a 32-bit integer mixer evaluated inside int64 (every product is split so that no
  step leaves 49 bits: nothing overflows, nothing depends on a library RNG);
- a fixed rule over the fp32 log-probabilities of the row: temperature 0 is the argmax (ties
  to the lowest id); otherwise the row is divided by the temperature, cut to the top-p
  nucleus (sorted by value, ties by id, a fixed-tree prefix sum), and the token is the
  argmax of ``z - log(-log(u))`` over the kept ids (Gumbel-max with the stream's uniforms),
  using the exp and log of ``arith``.

A row's token depends only on that row's log-probabilities, seed, position, temperature and
top-p: never on the batch, the row's place in it, or the thread count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .arith import F32, exp, log, require, tree_sum

I64 = torch.int64
M32 = 0xFFFFFFFF

# Temperatures below this (other than exactly 0, the argmax) are refused: vLLM itself never
# samples below 1e-2, and the scaled row must stay finite.
MIN_TEMPERATURE = 1e-2

# Constants folded into the key words (hex digits of pi) and the MurmurHash3 32-bit finalizer's
# multipliers.
_KEY = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0)
_FMIX_A = 0x85EBCA6B
_FMIX_B = 0xC2B2AE35
_U_SCALE = 2.0**-24


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, c a 32-bit constant.

    The constant is split into 16-bit halves: x * lo < 2**48 and the high half's product is
    cut to 16 bits before its shift, so the sum stays below 2**49.
    """
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche mixer on 32-bit words (the MurmurHash3 finalizer's shape)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _FMIX_A)
    x = x ^ (x >> 13)
    x = _mul32(x, _FMIX_B)
    return x ^ (x >> 16)


def stream_words(
    seeds: torch.Tensor, positions: torch.Tensor, vocab: int, rounds: int = 3
) -> torch.Tensor:
    """int64 [T, vocab] of 32-bit words, one per (seed, position, vocabulary id).

    ``seeds`` int64 [T] (any int64; taken modulo 2**64), ``positions`` int64 [T] in
    [0, 2**32). Per row a key word is folded from the seed's two halves and the position;
    ``rounds`` key words derived from it then mix each id: ``x = fmix32(x ^ k_r)``. For a
    fixed row the map from id to word is a bijection, so no two ids share a word.
    """
    require(rounds >= 1, f"sample.gumbel_topp: rounds must be at least 1, got {rounds}")
    lo = seeds & M32
    hi = (seeds >> 32) & M32
    key = fmix32(lo ^ _KEY[0])
    key = fmix32(key ^ hi ^ _KEY[1])
    key = fmix32(key ^ positions ^ _KEY[2])
    keys = [key]
    for r in range(1, rounds):
        keys.append(fmix32(keys[-1] ^ _KEY[2 + r % 4]))
    x = torch.arange(vocab, dtype=I64, device=seeds.device).expand(seeds.shape[0], vocab)
    for k in keys:
        x = fmix32(x ^ k[:, None])
    return x


def uniforms(
    seeds: torch.Tensor, positions: torch.Tensor, vocab: int, rounds: int = 3
) -> torch.Tensor:
    """fp32 [T, vocab] in (0, 1): ``(2 * (word >> 9) + 1) * 2**-24``, exact in fp32."""
    words = stream_words(seeds, positions, vocab, rounds)
    return ((words >> 9) * 2 + 1).to(F32) * _U_SCALE


def _first_max(x: torch.Tensor) -> torch.Tensor:
    """Per row, the lowest index holding the row's maximum (exact: max and compare)."""
    ids = torch.arange(x.shape[-1], dtype=I64, device=x.device).expand_as(x)
    at_max = x == x.amax(dim=-1, keepdim=True)
    return torch.where(at_max, ids, torch.full_like(ids, x.shape[-1])).amin(dim=-1)


def prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sum along the last dim over a fixed tree (Hillis-Steele).

    Step d adds element i - d to element i for every i >= d, d = 1, 2, 4, ...: the tree
    depends on the length only, and every add is one fp32 rounding.
    """
    n = x.shape[-1]
    d = 1
    while d < n:
        x = torch.cat([x[..., :d], x[..., d:] + x[..., :-d]], dim=-1)
        d *= 2
    return x


def _as_rows(value, t: int, dtype: torch.dtype, device, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        out = value.detach().to(device=device)
        require(
            not out.dtype.is_floating_point or dtype.is_floating_point,
            f"sample.gumbel_topp: {what} must be integers, got {out.dtype}",
        )
        out = out.to(dtype).reshape(-1)
        if out.numel() == 1 and t != 1:
            out = out.expand(t)
    elif isinstance(value, Sequence):
        out = torch.tensor(list(value), dtype=dtype, device=device)
    else:
        out = torch.full((t,), value, dtype=dtype, device=device)
    require(out.shape == (t,), f"sample.gumbel_topp: {what} has {out.numel()} entries for {t} rows")
    return out


def sample(
    logprobs: torch.Tensor,
    *,
    temperature,
    top_p,
    seeds,
    positions,
    rounds: int = 3,
    check: bool = True,
) -> torch.Tensor:
    """int64 [T]: the token each row of ``logprobs`` (fp32 [T, V]) draws.

    ``temperature`` and ``top_p`` (a number, or one per row) are taken as fp32 (rounded to
    nearest from the value given); ``seeds`` and ``positions`` are int64, one per row (a
    number is used for every row). Temperature 0 is the argmax (ties to the lowest id);
    otherwise temperature must be at least 1e-2 and top-p in (0, 1]. A row with a NaN or
    no finite entry is refused whatever ``check`` says (here the check reads no device).
    """
    del check
    require(logprobs.dtype == F32, f"sample.gumbel_topp takes float32, got {logprobs.dtype}")
    require(logprobs.dim() == 2, f"sample.gumbel_topp takes [T, V], got {tuple(logprobs.shape)}")
    t, v = logprobs.shape
    require(v >= 1, "sample.gumbel_topp over an empty vocabulary")
    dev = logprobs.device
    temp = _as_rows(temperature, t, F32, dev, "temperature")
    top = _as_rows(top_p, t, F32, dev, "top_p")
    seed = _as_rows(seeds, t, I64, dev, "seeds")
    pos = _as_rows(positions, t, I64, dev, "positions")
    if t == 0:
        return torch.zeros(0, dtype=I64, device=dev)
    require(not bool(torch.isnan(logprobs).any()), "sample.gumbel_topp: NaN log-probability")
    require(
        bool((logprobs.amax(dim=-1) > float("-inf")).all()),
        "sample.gumbel_topp: a row whose log-probabilities are all -inf",
    )
    require(
        bool(torch.isfinite(temp).all()) and bool(((temp == 0) | (temp >= MIN_TEMPERATURE)).all()),
        f"sample.gumbel_topp: temperature must be 0 (greedy) or finite and >= {MIN_TEMPERATURE}, "
        f"got {temp.tolist()}",
    )
    require(
        bool(((top > 0) & (top <= 1)).all()),
        f"sample.gumbel_topp: top_p must be in (0, 1], got {top.tolist()}",
    )
    require(
        bool(((pos >= 0) & (pos <= M32)).all()),
        f"sample.gumbel_topp: positions must be in [0, 2**32), got {pos.tolist()}",
    )
    out = _first_max(logprobs)
    rand = torch.nonzero(temp != 0).reshape(-1)
    if rand.numel():
        out[rand] = _race(logprobs[rand], temp[rand], top[rand], seed[rand], pos[rand], rounds)
    return out


def nucleus(z: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [T, V]: the ids of the smallest prefix (by value, ties by id) reaching top_p.

    Probabilities are ``exp(z - max) / tree_sum``; a sorted id is kept when the prefix sum
    of the ids before it is below top_p, so the first is always kept. top_p 1 keeps all.
    """
    keep = torch.ones(z.shape, dtype=torch.bool, device=z.device)
    cut = torch.nonzero(top_p < 1).reshape(-1)
    if not cut.numel():
        return keep
    zc = z[cut]
    e = exp(zc - zc.amax(dim=-1, keepdim=True))
    p = e / tree_sum(e)[:, None]
    # Descending by z with ties by ascending id: a stable sort of -z keeps the id order.
    order = torch.sort(-zc, dim=-1, stable=True).indices
    cum = prefix_sum(torch.gather(p, -1, order))
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    keep_sorted = before < top_p[cut][:, None]
    keep[cut] = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return keep


# Rows are drawn in groups of this many to bound the [rows, V] temporaries (rows never mix).
_ROWS = 64


def _race(lp, temp, top_p, seeds, positions, rounds: int) -> torch.Tensor:
    out = []
    for a in range(0, lp.shape[0], _ROWS):
        b = a + _ROWS
        z = lp[a:b] / temp[a:b, None]
        keep = nucleus(z, top_p[a:b])
        u = uniforms(seeds[a:b], positions[a:b], lp.shape[-1], rounds)
        score = z - log(-log(u))
        score = torch.where(keep, score, torch.full_like(score, float("-inf")))
        out.append(_first_max(score))
    return torch.cat(out)
