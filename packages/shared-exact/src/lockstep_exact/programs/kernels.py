"""Which kernels an op site ran: recorded per site, carried in the invoked contract, gated.

A program's bytes are fixed by its definition, but a backend may run it through more than one
kernel: the cuda gemm through a pointer-fed or a TMA-fed persistent kernel (by row count), the
prefill attention through the Hopper kernel, the split kernel and its merge, or the one-pass
kernel, or for many sequences in one launch, the sampler in one Triton kernel or as the
definition's torch operations. Each form gives the bytes of the others, and a GPU test shows it.
Which one ran is recorded, so replay can refuse a form no test gates.

A *kernel* is named ``backend.function`` (the backend function the dispatch point called:
``cuda.gemm``) or ``backend.function:form`` (the form that function chose: ``cuda.gemm:tma``).
``note`` records one into the innermost ``noting`` block; ``Ops`` opens one around every op
site's call. A site that ran no noted kernel is refused too (``unrecorded``): a program reached
around the dispatch point would otherwise pass unseen.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

_NOTES: ContextVar[set[str] | None] = ContextVar("lockstep_kernel_notes", default=None)


def note(kernel: str) -> None:
    """Record ``kernel`` into the innermost ``noting`` block (none open: nothing to record)."""
    notes = _NOTES.get()
    if notes is not None:
        notes.add(kernel)


@contextmanager
def noting() -> Iterator[set[str]]:
    """A fresh set of the kernels noted inside the block (a nested block keeps its own)."""
    notes: set[str] = set()
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)


# The backend functions each program's sites reach through the dispatch point (``gather`` is
# the embedding's row copy, which needs no backend function). A function a backend lacks is
# never called there, so listing it is harmless.
REACHES: dict[str, frozenset[str]] = {
    name: frozenset(fns)
    for name, fns in {
        "embedding.gather": ("gather",),
        "gemm.kblock": ("gemm", "gemm_grouped"),
        "gemm.kpart": ("gemm", "kpart_partial", "gemm_grouped", "round_bf16"),
        "rmsnorm.qwen3": ("rmsnorm",),
        "residual.add": ("residual_add",),
        "swiglu": ("swiglu",),
        "rope.neox": ("rope",),
        "attention.blocked": ("attention", "attention_decode_paged", "attention_varlen"),
        "softmax.tree": ("softmax",),
        "log_softmax.tree": ("log_softmax", "shard_tree_nodes"),
        "router.softmax_topk": ("router_topk",),
        "moe.fold": ("moe_fold", "moe_fold_fp32"),
        "lora.shrink": ("lora_shrink",),
        "lora.expand": ("lora_expand",),
        "sample.gumbel_topp": ("sample",),
        "gdn.chunked": ("gdn_chunked", "gdn_paged"),
        "gdn.gating": ("gdn_gating",),
        "gdn.l2norm": ("l2norm",),
        "conv1d.causal": ("conv1d_causal", "conv1d_paged"),
        "rmsnorm.zero_centered": ("rmsnorm_zero_centered",),
        "rmsnorm.gated": ("rmsnorm_gated",),
        "gate.sigmoid": ("sigmoid_gate",),
        "moe.shared_gate": ("shared_expert_gate",),
        "rope.partial": ("rope_partial",),
    }.items()
}

# Functions whose cuda forms a program reaches through another function: lora's gemm, the
# router's softmax.
_CALLS: dict[str, tuple[str, ...]] = {
    "lora_shrink": ("gemm",),
    "lora_expand": ("gemm",),
    "router_topk": ("softmax",),
}

# The forms of the cuda functions that choose one, and the GPU test (test_programs_gpu.py)
# that shows each gives the bytes of the others. A form noted in the cuda backend must be here
# (a CPU test reads every ``note`` of programs/cuda), and every test named must exist.
FORMS: dict[str, dict[str, str]] = {
    "gemm": {
        "pointer": "test_gemm_every_tiling_gives_the_same_bytes",
        "tma": "test_gemm_persistent_tilings_load_by_tma_and_a_misaligned_x_gives_the_same_bytes",
    },
    "attention": {
        "one-pass": "test_attention_prefill_chunked_and_decode_give_the_same_row_bytes",
        "split": "test_attention_prefill_chunked_and_decode_give_the_same_row_bytes",
        "hopper": "test_the_hopper_prefill_gives_the_triton_kernel_bytes",
    },
    "softmax": {
        "one-program": "test_softmax_split_gives_the_same_bytes",
        "split": "test_softmax_split_gives_the_same_bytes",
    },
    "log_softmax": {
        "one-program": "test_softmax_split_gives_the_same_bytes",
        "split": "test_softmax_split_gives_the_same_bytes",
    },
    "kpart_partial": {
        "one-launch": "test_kpart_in_one_launch_gives_the_bytes_of_its_partitions",
        "folded": "test_kpart_folded_above_the_one_launch_rows_gives_the_bytes_of_its_partitions",
    },
    "sample": {
        "one-kernel": "test_sample_in_one_kernel_draws_the_definitions_tokens",
        "definition": "test_sample_in_one_kernel_draws_the_definitions_tokens",
    },
}

# Whole backend functions that are themselves a second form of a program (one launch for what
# the definition runs as several), with the GPU test that gates them against it.
ONE_LAUNCH: dict[str, str] = {
    "kpart_partial": "test_kpart_in_one_launch_gives_the_bytes_of_its_partitions",
    "gemm_grouped": "test_grouped_experts_give_each_pair_the_bytes_of_its_experts_plain_gemm",
    "attention_varlen": "test_attention_of_many_sequences_in_one_launch_gives_each_row_its_bytes",
    "gdn_paged": "test_gdn_paged_gives_each_sequence_the_bytes_and_state_of_its_own_call",
    "conv1d_paged": "test_conv1d_paged_gives_each_sequence_the_bytes_and_window_of_its_own_call",
}


def allowed(program: str, backend: str) -> frozenset[str]:
    """Every kernel a site of ``program`` may run on ``backend``."""
    fns = set(REACHES.get(program, ()))
    for fn in list(fns):
        fns.update(_CALLS.get(fn, ()))
    out = {"gather"} if "gather" in fns else set()
    out.update(f"{backend}.{fn}" for fn in fns if fn != "gather")
    if backend == "cuda":
        out.update(f"cuda.{fn}:{form}" for fn in fns for form in FORMS.get(fn, {}))
    return frozenset(out)


def gate_of(kernel: str) -> str | None:
    """The GPU test that gates a cuda form or one-launch function (None: not a second form)."""
    backend, _, rest = kernel.partition(".")
    fn, _, form = rest.partition(":")
    if backend != "cuda":
        return None
    if form:
        return FORMS.get(fn, {}).get(form)
    return ONE_LAUNCH.get(fn)


def ungated(
    sites: Mapping[str, str], kernels: Mapping[str, Iterable[str]], backend: str
) -> str | None:
    """A sentence naming the first site (sorted) whose record is missing, empty, or names a
    kernel its program may not run on ``backend``; None when every site is covered.

    ``sites``: site key -> program name (the invoked contract's sites); ``kernels``: site key
    -> the kernels it ran."""
    for key in sorted(sites):
        ran = sorted(kernels.get(key, ()))
        if not ran:
            return f"op site {key!r} ({sites[key]}) ran no recorded kernel"
        ok = allowed(sites[key], backend)
        for k in ran:
            if k not in ok:
                return (
                    f"op site {key!r} ({sites[key]}) ran kernel {k!r}, which no test gates for "
                    f"{sites[key]} on {backend} (gated: {', '.join(sorted(ok))})"
                )
    extra = sorted(set(kernels) - set(sites))
    if extra:
        return f"kernels are recorded for op site {extra[0]!r}, which the contract does not name"
    return None
