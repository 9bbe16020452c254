"""sample.gumbel_topp: the counter-based stream and the fixed rule over exact log-probabilities.

Tokens are compared with torch.equal; each invariance has a control showing that the same
comparison sees a one-ulp change of one log-probability, or a changed seed.
"""

from __future__ import annotations

import pytest
import torch

from lockstep_exact import programs as P
from lockstep_exact.programs.cpu import arith
from lockstep_exact.programs.cpu import sampling as S

F32 = torch.float32


def logprobs(t: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return P.log_softmax((torch.randn(t, v, generator=g) * scale).to(F32))


def batch(t: int = 96, v: int = 1000):
    """A fixed mixed batch: greedy and random rows, several temperatures and top-p values."""
    lp = logprobs(t, v)
    temps = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 2.0] * (t // 6), dtype=torch.float64)
    tops = torch.tensor([1.0, 1.0, 0.9, 0.5, 0.05, 1.0, 0.95, 1.0] * (t // 8), dtype=F32)
    seeds = torch.arange(t, dtype=torch.int64) * 7919 - 11
    positions = torch.arange(t, dtype=torch.int64) * 37 + 5
    return lp, temps, tops, seeds, positions


def draw(lp, temps, tops, seeds, positions, **kw):
    return P.sample(lp, temperature=temps, top_p=tops, seeds=seeds, positions=positions, **kw)


def test_the_program_is_in_the_catalog_with_its_parameters():
    assert P.Program.of("sample.gumbel_topp").ident == "sample.gumbel_topp@1{rounds=3}"


def test_draws_are_deterministic():
    args = batch()
    a, b = draw(*args), draw(*args)
    assert a.dtype == torch.int64 and torch.equal(a, b)


def test_a_rows_token_does_not_depend_on_the_batch_its_order_or_threads():
    lp, temps, tops, seeds, pos = batch()
    ref = draw(lp, temps, tops, seeds, pos)
    for m in (1, 3, 64, 95):
        s = (lp.shape[0] - m) // 2
        sl = slice(s, s + m)
        assert torch.equal(draw(lp[sl], temps[sl], tops[sl], seeds[sl], pos[sl]), ref[sl]), m
    perm = torch.randperm(lp.shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.equal(draw(lp[perm], temps[perm], tops[perm], seeds[perm], pos[perm]), ref[perm])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = draw(lp, temps, tops, seeds, pos)
        torch.set_num_threads(2)
        two = draw(lp, temps, tops, seeds, pos)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, ref) and torch.equal(two, ref)


def test_a_seed_or_position_change_moves_draws_in_the_fixed_batch():
    lp, temps, tops, seeds, pos = batch()
    ref = draw(lp, temps, tops, seeds, pos)
    random_rows = temps != 0
    moved_seed = draw(lp, temps, tops, seeds + 1, pos)
    moved_pos = draw(lp, temps, tops, seeds, pos + 1)
    assert not torch.equal(moved_seed, ref) and not torch.equal(moved_pos, ref)
    # Greedy rows ignore the stream entirely.
    assert torch.equal(moved_seed[~random_rows], ref[~random_rows])


def _edge_row(seed: int, position: int):
    """A 2-token row where id 1 loses the Gumbel race, but wins once its logprob moves up
    by one ulp (found by walking one ulp at a time across id 0's score)."""
    u = S.uniforms(torch.tensor([seed]), torch.tensor([position]), 2)[0]
    lt = arith.log(-arith.log(u))  # score = z - lt
    z0 = torch.tensor([-40.0], dtype=F32)  # |z| > |lt|: each ulp of z moves the score
    s0 = z0 - lt[0]
    z1 = s0 + lt[1]
    up, down = torch.tensor([float("inf")]), torch.tensor([float("-inf")])
    while bool(z1 - lt[1] <= s0):  # above id 0's score first
        z1 = torch.nextafter(z1, up)
    while bool(z1 - lt[1] > s0):  # then the largest value that does not beat it
        z1 = torch.nextafter(z1, down)
    return torch.cat([z0, z1])[None]


def test_a_one_ulp_change_of_one_logprob_moves_a_draw():
    row = _edge_row(seed=12345, position=40)
    assert P.sample(row, temperature=1.0, top_p=1.0, seeds=[12345], positions=[40]).item() == 0
    up = row.clone()
    up[0, 1] = torch.nextafter(up[0, 1], torch.tensor(float("inf")))
    assert P.sample(up, temperature=1.0, top_p=1.0, seeds=[12345], positions=[40]).item() == 1


def test_the_race_winner_is_the_lowest_id_among_equal_scores():
    scores = torch.tensor([[1.0, 3.0, 3.0, -1.0], [float("-inf"), 2.0, 0.0, 2.0]])
    assert S._first_max(scores).tolist() == [1, 1]


def test_temperature_zero_is_the_argmax_with_ties_to_the_lowest_id():
    lp = logprobs(5, 300, seed=3)
    lp[2, 17] = lp[2, 250] = lp[2].amax() + 0.5
    toks = P.sample(lp, temperature=0.0, top_p=1.0, seeds=[0] * 5, positions=[0] * 5)
    assert toks[2].item() == 17
    assert torch.equal(toks, torch.stack([row.argmax() for row in lp]))
    # Greedy is greedy whatever top_p, seed and position say.
    other = P.sample(lp, temperature=0.0, top_p=0.3, seeds=[9] * 5, positions=[77] * 5)
    assert torch.equal(other, toks)


def test_top_p_one_keeps_every_token():
    z = logprobs(4, 500, seed=4)
    assert bool(S.nucleus(z, torch.ones(4)).all())


def test_a_tiny_top_p_keeps_only_the_most_likely_token():
    lp = logprobs(1, 200, seed=5).expand(300, 200).contiguous()
    toks = P.sample(lp, temperature=1.0, top_p=1e-6, seeds=torch.arange(300), positions=[3] * 300)
    assert bool((toks == lp[0].argmax()).all())


def test_top_p_ties_are_broken_by_id():
    z = torch.zeros(1, 4, dtype=F32)  # four equal probabilities, 0.25 each
    keep = S.nucleus(z, torch.tensor([0.5]))
    assert keep.tolist() == [[True, True, False, False]]
    keep = S.nucleus(z, torch.tensor([0.6]))
    assert keep.tolist() == [[True, True, True, False]]
    toks = P.sample(
        z.expand(400, 4).contiguous(),
        temperature=1.0,
        top_p=0.5,
        seeds=torch.arange(400),
        positions=[0] * 400,
    )
    assert set(toks.tolist()) == {0, 1}


def test_prefix_sum_is_a_fixed_tree_that_equals_the_sequential_sum_on_exact_values():
    x = torch.arange(1, 11, dtype=F32)[None]
    assert S.prefix_sum(x).tolist() == [torch.cumsum(x, -1).tolist()[0]]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_follow_the_distribution_chi_square():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0, 3.0, 0.2, -2.0]])
    lp = P.log_softmax(logits)
    n = 20000
    rows = lp.expand(n, 8).contiguous()
    probs = lp[0].double().exp()
    # Many seeds at one position, and one seed over many positions: 7 degrees of freedom,
    # 24.3 is the 0.999 quantile.
    by_seed = P.sample(rows, temperature=1.0, top_p=1.0, seeds=torch.arange(n), positions=[7] * n)
    by_pos = P.sample(rows, temperature=1.0, top_p=1.0, seeds=[3] * n, positions=torch.arange(n))
    for toks in (by_seed, by_pos):
        assert _chi_square(torch.bincount(toks, minlength=8).double(), probs) < 24.3
    # Temperature 2 flattens: the tempered distribution is softmax(lp / 2).
    hot = P.sample(rows, temperature=2.0, top_p=1.0, seeds=torch.arange(n), positions=[1] * n)
    tempered = torch.softmax(lp[0].double() / 2, -1)
    assert _chi_square(torch.bincount(hot, minlength=8).double(), tempered) < 24.3
    # top-p 0.8 keeps ids 5, 2, 1 (0.62 + 0.23 < 0.8 before id 1), renormalized.
    cut = P.sample(rows, temperature=1.0, top_p=0.8, seeds=torch.arange(n), positions=[2] * n)
    counts = torch.bincount(cut, minlength=8).double()
    assert counts[[0, 3, 4, 6, 7]].sum() == 0
    kept = probs[[1, 2, 5]] / probs[[1, 2, 5]].sum()
    assert _chi_square(counts[[1, 2, 5]], kept) < 13.8  # 2 dof, 0.999 quantile


def test_the_stream_is_a_bijection_per_row_and_differs_between_rows():
    words = S.stream_words(torch.tensor([0, 0, 1, -1]), torch.tensor([0, 1, 0, 0]), 4096)
    assert bool((words >= 0).all()) and bool((words <= 0xFFFFFFFF).all())
    for row in words:
        assert row.unique().numel() == 4096
    assert len({tuple(r.tolist()) for r in words}) == 4
    u = S.uniforms(torch.tensor([5]), torch.tensor([9]), 100000)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(float(u.double().mean()) - 0.5) < 0.005


def test_the_mixer_never_leaves_int64_and_matches_python_integers():
    x = torch.tensor([0, 1, 0xFFFFFFFF, 0x80000000, 123456789], dtype=torch.int64)

    def ref(v: int) -> int:
        m = 0xFFFFFFFF
        v ^= v >> 16
        v = (v * 0x85EBCA6B) & m
        v ^= v >> 13
        v = (v * 0xC2B2AE35) & m
        return v ^ (v >> 16)

    assert S.fmix32(x).tolist() == [ref(v) for v in x.tolist()]


def test_rounds_is_a_bit_relevant_parameter():
    lp, temps, tops, seeds, pos = batch()
    assert not torch.equal(
        draw(lp, temps, tops, seeds, pos, rounds=2), draw(lp, temps, tops, seeds, pos)
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lp": torch.zeros(2, 4, dtype=torch.bfloat16)}, "takes float32, got torch.bfloat16"),
        ({"lp": torch.zeros(4)}, r"takes \[T, V\], got \(4,\)"),
        ({"temperature": 1e-3}, "temperature must be 0 \\(greedy\\) or finite and >= 0.01"),
        ({"temperature": float("inf")}, "temperature must be 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"positions": [-1, 0]}, r"positions must be in \[0, 2\*\*32\)"),
        ({"seeds": [1, 2, 3]}, "seeds has 3 entries for 2 rows"),
        ({"seeds": torch.tensor([1.0, 2.0])}, "seeds must be integers"),
        ({"lp": torch.tensor([[0.0, float("nan")]] * 2)}, "NaN log-probability"),
        ({"lp": torch.full((2, 3), float("-inf"))}, "all -inf"),
    ],
)
def test_bad_input_is_refused_with_its_reason(kwargs, message):
    args = {
        "lp": torch.log(torch.full((2, 4), 0.25)),
        "temperature": 1.0,
        "top_p": 1.0,
        "seeds": [1, 2],
        "positions": [0, 1],
    }
    args.update(kwargs)
    lp = args.pop("lp")
    with pytest.raises(ValueError, match=message):
        P.sample(lp, **args)


def test_a_device_without_the_program_fails_closed():
    with pytest.raises(P.BackendUnavailable):
        P.sample(
            torch.zeros(1, 4, device="meta"), temperature=1.0, top_p=1.0, seeds=[0], positions=[0]
        )


# --- what a trace records for the rule -----------------------------------------------------------
def _trace(sampling):
    from lockstep_exact.trace import Trace

    return Trace.from_sequences(
        [[1, 2], [3]],
        [[4, 5], [6]],
        [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])],
        contract_fingerprint="sha256:" + "0" * 64,
        model_hash="m" * 64,
        sampling=sampling,
    )


def test_a_trace_keeps_the_rule_and_each_sequences_seed(tmp_path):
    from lockstep_exact.trace import SamplingSettings, Trace

    settings = SamplingSettings(0.8, 0.9, 3, seeds=(3, 4), rule="sample.gumbel_topp@1{rounds=3}")
    loaded = Trace.load(_trace(settings).save(tmp_path / "t"))
    assert loaded.sampling == settings
    # Unset seeds stay out of the manifest; the rule is always written.
    assert "seeds" not in SamplingSettings(1.0, 1.0, 0, rule="x").to_json()
    assert SamplingSettings(1.0, 1.0, 0, rule="x").to_json()["rule"] == "x"


def test_a_trace_refuses_seeds_that_are_not_one_per_sequence():
    from lockstep_exact.trace import SamplingSettings, TraceError

    with pytest.raises(TraceError, match="sampling.seeds has 3 entries for 2 sequences"):
        _trace(SamplingSettings(1.0, 1.0, 0, seeds=(1, 2, 3), rule="x"))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("seeds", [1, "2"], "sampling.seeds must be a list of ints"),
        ("seeds", 7, "sampling.seeds must be a list of ints"),
        ("rule", 3, "sampling.rule must be a non-empty string"),
    ],
)
def test_a_manifest_with_malformed_rule_fields_is_refused(key, value, message):
    from lockstep_exact.trace import SamplingSettings, TraceError

    obj = {"temperature": 1.0, "top_p": 1.0, "seed": 0, key: value}
    with pytest.raises(TraceError, match=message):
        SamplingSettings.from_json(obj)


# --- the cuda backend (run with -m gpu on a CUDA machine) ---------------------------------------
@pytest.mark.gpu
def test_cuda_draws_are_row_invariant_and_the_stream_bytes_match_the_definition():
    lp, temps, tops, seeds, pos = batch(t=96, v=32003)
    on = lambda x: x.cuda()  # noqa: E731
    ref = draw(on(lp), on(temps), on(tops), on(seeds), on(pos))
    assert ref.is_cuda
    sl = slice(40, 43)
    sub = draw(on(lp[sl]), on(temps[sl]), on(tops[sl]), on(seeds[sl]), on(pos[sl]))
    assert torch.equal(sub, ref[sl])
    assert not torch.equal(draw(on(lp), on(temps), on(tops), on(seeds + 1), on(pos)), ref)
    # The stream is integer arithmetic: its words are the definition's on any device.
    words = S.stream_words(on(seeds), on(pos), 4096)
    assert torch.equal(words.cpu(), S.stream_words(seeds, pos, 4096))
