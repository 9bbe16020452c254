"""sample.gumbel_topp on CUDA tensors.

The program is integer arithmetic (the stream), IEEE-exact elementwise fp32 operations, fixed
trees, a stable sort and exact max/compare (``cpu.sampling`` is its definition). Two forms of
it run here, with the same bytes:

- one Triton kernel per step where no row cuts a nucleus (greedy rows and rows with top_p 1,
  what RL rollouts sample with): each program walks one row's vocabulary once, drawing the
  stream's words in 32-bit integers (the same wrap-around products the definition builds from
  16-bit halves), the definition's ``log`` written out operation by operation (contraction off:
  every * and + rounds on its own; division ``div_rn``), and keeps the first maximum;
- the definition's torch operations, each its own kernel, for any step where a row has
  top_p < 1 (the nucleus needs its sort and prefix sum).

A step's form depends only on the sampling parameters, never on the values; the kernel's
tokens are gated against the definition's on the GPU (test_programs_gpu.py: ``sample``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..cpu import sampling as _cpu
from ..kernels import note
from . import exactmath as em
from .arith import EXACT, require_cuda

_BLOCK = 2048


@triton.jit
def _fmix32(x):
    """``cpu.sampling.fmix32`` on uint32 words (the products wrap as the definition's do)."""
    x = x ^ (x >> 16)
    x = x * _FMIX_A
    x = x ^ (x >> 13)
    x = x * _FMIX_B
    return x ^ (x >> 16)


_K0, _K1, _K2, _K3, _K4, _K5 = (tl.constexpr(k) for k in _cpu._KEY)
_FMIX_A, _FMIX_B = tl.constexpr(_cpu._FMIX_A), tl.constexpr(_cpu._FMIX_B)
_U_SCALE = tl.constexpr(_cpu._U_SCALE)


@triton.jit
def _key_round(key, r: tl.constexpr):
    if r % 4 == 0:
        k = _K2
    elif r % 4 == 1:
        k = _K3
    elif r % 4 == 2:
        k = _K4
    else:
        k = _K5
    return _fmix32(key ^ k)


# The seeds and positions are two halves of one device tensor: the second starts 16-byte
# aligned or not with the row count's parity, which must not make two kernels.
@triton.jit(do_not_specialize_on_alignment=["seed_ptr", "pos_ptr"])
def _sample_kernel(
    lp_ptr,
    temp_ptr,
    seed_ptr,
    pos_ptr,
    out_ptr,
    V,
    stride,
    ROUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    src = lp_ptr + row * stride
    temp = tl.load(temp_ptr + row)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key0 = _fmix32(lo ^ _K0)
    key0 = _fmix32(key0 ^ hi ^ _K1)
    key0 = _fmix32(key0 ^ pos.to(tl.uint32) ^ _K2)
    key1 = _key_round(key0, 1)
    key2 = _key_round(key1, 2)
    key3 = _key_round(key2, 3)
    greedy = temp == 0.0
    safe_temp = tl.where(greedy, 1.0, temp)
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int64) + V
    bad = tl.full((), 0, tl.int32)
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        ids = start + offs
        ok = ids < V
        lp = tl.load(src + ids, mask=ok, other=float("-inf"))
        bad = bad | tl.max((lp != lp).to(tl.int32), 0)
        x = ids.to(tl.uint32)
        x = _fmix32(x ^ key0)
        if ROUNDS > 1:
            x = _fmix32(x ^ key1)
        if ROUNDS > 2:
            x = _fmix32(x ^ key2)
        if ROUNDS > 3:
            x = _fmix32(x ^ key3)
        u = ((x >> 9) * 2 + 1).to(tl.float32) * _U_SCALE  # the definition's uniforms
        gumbel = em.log(em.neg(em.log(u)))  # u and -log(u): positive normal fp32
        z = tl.math.div_rn(lp, safe_temp)
        score = tl.where(greedy, lp, z - gumbel)
        score = tl.where(ok, score, float("-inf"))
        m = tl.max(score, 0)
        first = tl.min(tl.where(score == m, ids.to(tl.int64), V), 0)
        take = m > best
        best_id = tl.where(take, first, best_id)
        best = tl.where(take, m, best)
    # A NaN, or a row with no finite score (all -inf): -1, and the caller asks the definition
    # for the refusal's words.
    tl.store(out_ptr + row, tl.where((bad != 0) | (best_id >= V), -1, best_id))


def _host_rows(value, t: int, kind) -> list | None:
    """``value`` as a list of ``t`` host numbers, or None where it is a tensor or another
    shape (the definition then takes the step)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.dim() > 1:
            return None
        value = value.reshape(-1).tolist()
    elif not isinstance(value, Sequence):
        value = [value] * t
    value = list(value)
    if len(value) == 1 and t != 1:
        value *= t
    if len(value) != t or not all(isinstance(v, kind) for v in value):
        return None
    return value


def _one_kernel_rows(temperature, top_p, seeds, positions, t: int, rounds: int):
    """Host lists for the kernel where the step can take it, else None: every row greedy or
    at top_p 1, the parameters inside the definition's ranges, at most four stream rounds."""
    temps = _host_rows(temperature, t, (int, float))
    tops = _host_rows(top_p, t, (int, float))
    seed = _host_rows(seeds, t, int)
    pos = _host_rows(positions, t, int)
    if temps is None or tops is None or seed is None or pos is None or not 1 <= rounds <= 4:
        return None
    f32 = torch.tensor([temps, tops], dtype=torch.float32)  # the definition takes them as fp32
    temp32, top32 = f32[0], f32[1]
    ok = (
        bool(torch.isfinite(temp32).all())
        and bool(((temp32 == 0) | (temp32 >= _cpu.MIN_TEMPERATURE)).all())
        and bool(((temp32 == 0) | (top32 == 1)).all())
        and all(0 <= p <= _cpu.M32 for p in pos)
        and all(-(2**63) <= s < 2**63 for s in seed)
    )
    return (temp32, seed, pos) if ok else None


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
    """The one kernel where the step allows it, else the definition. The kernel marks a row
    it cannot draw (a NaN, no finite entry) with -1; with ``check`` the step then reads that
    on the host (a wait for the device) and asks the definition for the refusal's words,
    without it the -1 is returned for the caller to refuse once the tokens are on the host."""
    require_cuda(logprobs)
    args = dict(temperature=temperature, top_p=top_p, seeds=seeds, positions=positions)
    t = logprobs.shape[0] if logprobs.dim() == 2 else -1
    rows = None
    if logprobs.dtype == torch.float32 and t > 0 and logprobs.shape[1] > 0:
        rows = _one_kernel_rows(temperature, top_p, seeds, positions, t, rounds)
    if rows is None:
        note("cuda.sample:definition")
        return _cpu.sample(logprobs, rounds=rounds, **args)
    note("cuda.sample:one-kernel")
    temp32, seed, pos = rows
    dev = logprobs.device
    lp = logprobs if logprobs.stride(-1) == 1 else logprobs.contiguous()
    host = torch.tensor(seed + pos, dtype=torch.int64).pin_memory()
    both = host.to(dev, non_blocking=True)
    out = torch.empty(t, dtype=torch.int64, device=dev)
    _sample_kernel[(t,)](
        lp,
        temp32.pin_memory().to(dev, non_blocking=True),
        both[:t],
        both[t:],
        out,
        lp.shape[1],
        lp.stride(0),
        ROUNDS=rounds,
        BLOCK=_BLOCK,
        num_warps=8,
        **EXACT,
    )
    if check and bool((out < 0).any()):  # the definition says what is wrong with the row
        note("cuda.sample:definition")
        return _cpu.sample(logprobs, rounds=rounds, **args)
    return out
