"""The lane's Megatron model in your own training script: provider, spec, logprobs, checks.

A thin public layer over what ``lockstep replay`` / ``lockstep train`` already run; nothing
here restates the model, the weight conversion or the scoring:

- ``init_single_process(backend, seed)``: gloo (nccl with a GPU), world size 1, Megatron's
  ``parallel_state.initialize_model_parallel(1, 1)`` and its RNG tracker seeded; without a GPU
  it first applies the CPU patches of ``cpu.py`` (``cpu.init_single_process``). Building a
  model at tp = ep = 1 calls it too (seed 0) when you have not.
- ``lane_model_provider(model_dir, ...)``: a ``model_provider(pre_process, post_process)`` as
  Megatron scripts write it. It returns the lane's model: ``spec.LockstepGPT``, whose ``.gpt``
  is megatron-core's ``GPTModel`` (built from ``lane_layer_spec``) inside ``Float16Module``
  (``.model``), its weights loaded from the HF safetensors (``convert.build``), the backbone
  frozen; optionally a PEFT adapter loaded (``export.load_into``) or fresh LoRA attached
  (``adapters.attach``: B = 0, the bytes do not change).
- ``lane_layer_spec(model_dir)`` / ``lane_transformer_config(model_dir)``: the block spec and
  ``TransformerConfig`` that model is built from (``spec.block_spec``,
  ``spec.transformer_config``).
- ``lane_logprobs(model, tokens, prompt_lens)``: teacher-forced fp32 log-probability of every
  token from ``prompt_len`` on, the bytes a lane sampler reports for those tokens
  (``replay.sampled_logprobs``); differentiable when autograd is on.
- ``read_rollouts`` / ``write_rollouts`` / ``check_rollout``: sampler log-probabilities as
  JSONL (``{"tokens": [...], "prompt_len": int, "logprobs": [...]}`` per line) checked
  against the trainer byte for byte (``k3.compare``): a ``RolloutReport`` with ``equal`` and
  the first differing (sequence, position).
- ``lane_trainable_parameters`` / ``export_lane_adapter``: the LoRA masters an optimizer steps
  (the backbone is frozen, as in ``session.PolicySession``) and their PEFT export for the sampler.

Scope: Qwen3 and Qwen3-MoE model directories (``spec.py``'s ModuleSpecs); backends ``cpu`` and
``cuda`` (one GPU). A Qwen3-Next directory is refused here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "Mismatch",
    "Rollout",
    "RolloutFormatError",
    "RolloutReport",
    "check_rollout",
    "export_lane_adapter",
    "init_single_process",
    "lane_layer_spec",
    "lane_logprobs",
    "lane_model_provider",
    "lane_trainable_parameters",
    "lane_transformer_config",
    "read_rollouts",
    "write_rollouts",
]

BACKENDS = ("cpu", "cuda")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: the Megatron exact lane runs on cpu or cuda")
    if backend == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("backend 'cuda': no CUDA device here")


def _geometry(model_dir: str | os.PathLike[str]):
    """The lane geometry of a Qwen3 / Qwen3-MoE directory (refusing others, by name)."""
    from lockstep_exact.model import ModelDir

    base = ModelDir(model_dir, hybrid=True)
    if base.family not in ("qwen3", "qwen3-moe"):
        raise NotImplementedError(
            f"{model_dir} is a {base.family} model: lockstep_megatron.integration builds "
            "Qwen3 and Qwen3-MoE models only"
        )
    return base.geometry


# --- setup ---------------------------------------------------------------------------------------
def init_single_process(backend: str = "cpu", seed: int = 0) -> None:
    """Set up what Megatron needs in a single process; idempotent.

    ``torch.distributed`` (gloo without a GPU, nccl with one; world size 1, a file store in a
    fresh temp dir), ``parallel_state.initialize_model_parallel(1, 1)`` and Megatron's RNG
    tracker seeded with ``seed`` (which seeds torch's default generator too). Without a GPU,
    the CPU patches of ``lockstep_megatron.cpu`` are applied first (they fail closed on another
    megatron-core than 0.16.1). What is already initialized is left as it is: a script that
    set up its own process group and parallel state keeps them.
    """
    _check_backend(backend)
    from .cpu import init_single_process as init

    init(seed)


# --- the model -----------------------------------------------------------------------------------
def lane_transformer_config(model_dir: str | os.PathLike[str], *, tp: int = 1, ep: int = 1):
    """megatron-core's ``TransformerConfig`` of the lane's model for ``model_dir`` (sizes, RMSNorm
    with q/k norms, SwiGLU, bf16, no dropout, none of Megatron's fused kernels)."""
    from .spec import transformer_config

    return transformer_config(_geometry(model_dir), tp, ep)


def lane_layer_spec(model_dir: str | os.PathLike[str]):
    """The ``TransformerBlockSubmodules`` (one ``ModuleSpec`` of ``TransformerLayer`` per layer,
    the final norm) that the lane's ``GPTModel`` is built from: pass it as
    ``GPTModel(transformer_layer_spec=...)``.

    A ``GPTModel`` you build from it holds the lane's parameters under Megatron's names and
    shapes, but its layers do not run on their own: their forward is the lane composition,
    which ``spec.LockstepGPT`` wires (each layer's pointer to the lane, the embedding hook, the
    exact output layer that replaces ``GPTModel.output_layer``). For a model that runs, use
    ``lane_model_provider``; its ``.gpt`` is the ``GPTModel``."""
    from .spec import block_spec

    return block_spec(_geometry(model_dir))


def lane_model_provider(
    model_dir: str | os.PathLike[str],
    *,
    backend: str = "cpu",
    adapter: str | os.PathLike[str] | None = None,
    lora_rank: int | None = None,
    lora_alpha: float = 16.0,
    seed: int = 0,
    tp: int = 1,
    ep: int = 1,
) -> Callable[..., torch.nn.Module]:
    """A Megatron-style ``model_provider(pre_process=True, post_process=True)`` for the lane.

    Each call builds ``spec.LockstepGPT`` (``convert.build``: megatron-core's ``GPTModel``
    built from ``lane_layer_spec``, inside ``Float16Module``, weights from ``model_dir``'s HF
    safetensors, strict both ways), backbone frozen. ``model(tokens [b, s])`` returns fp32
    log-probabilities [b, s, V] (not Megatron's loss); ``lane_logprobs`` gathers per token.

    - ``adapter``: a PEFT adapter directory (made by ``export_lane_adapter`` or ``peft``),
      loaded as trainable fp32 masters (``export.load_into``; refused if bound to another
      model or lane).
    - ``lora_rank``: without ``adapter``, attach fresh LoRA of this rank (and ``lora_alpha``)
      on q, k, v, o, gate, up, down (``adapters.attach``; B = 0, so the bytes do not change).
    - ``backend``: ``cuda`` moves the model to the GPU after loading; the programs dispatch on
      the tensors' device (the cuda lane's bytes are comparable with a cuda sampler's only).
    - ``tp`` / ``ep`` > 1: this rank's shards (``convert.build``); Megatron's parallel state
      must then be set up with those sizes by the caller. At tp = ep = 1 the provider calls
      ``init_single_process(backend, seed)``.

    Pipeline parallelism is not supported: ``pre_process`` and ``post_process`` must be True.
    """
    _check_backend(backend)
    _geometry(model_dir)  # refuse an unsupported directory before anything is built
    if adapter is not None and lora_rank is not None:
        raise ValueError("pass adapter (load one) or lora_rank (attach a fresh one), not both")

    def model_provider(pre_process: bool = True, post_process: bool = True) -> torch.nn.Module:
        if not (pre_process and post_process):
            raise NotImplementedError(
                "the lane's model is one pipeline stage: pre_process and post_process must "
                "both be True (pipeline parallelism is not supported)"
            )
        from . import adapters as AD
        from . import export
        from .convert import build

        if tp == 1 and ep == 1:
            init_single_process(backend, seed)
        model = build(model_dir, tp, ep)
        if adapter is not None:
            export.load_into(model, adapter, model_dir, backend)
        elif lora_rank is not None:
            AD.attach(model, lora_rank, lora_alpha, seed=seed)
        if backend == "cuda":
            model = model.cuda()
        return model

    return model_provider


def lane_trainable_parameters(model) -> list[torch.nn.Parameter]:
    """The LoRA fp32 masters of ``model`` (``adapters.adapter_parameters``): what an optimizer
    steps. The backbone is frozen (as in ``session.PolicySession``); this raises if any other
    parameter requires grad."""
    from . import adapters as AD

    params = AD.adapter_parameters(model)
    mine = {id(p) for p in params}
    extra = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in mine]
    if extra:
        raise RuntimeError(f"{len(extra)} backbone tensors would train ({extra[0]}, ...)")
    return params


def export_lane_adapter(
    model,
    out_dir: str | os.PathLike[str],
    model_dir: str | os.PathLike[str],
    backend: str = "cpu",
) -> Path:
    """Write ``model``'s LoRA as a PEFT adapter (bf16, as the forward sees it; bound to the base
    model's hash and the lane's contract): what the sampler loads (``export.export_peft``)."""
    from . import export

    return export.export_peft(model, out_dir, model_dir, backend)


# --- log-probabilities ---------------------------------------------------------------------------
def _sequences(tokens, prompt_lens) -> list[tuple[torch.Tensor, int]]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 2:
            raise ValueError(
                f"tokens: a [b, s] tensor or a list of sequences, not {tokens.dim()}-D"
            )
        seqs = [t for t in tokens]
    else:
        seqs = [torch.as_tensor(t) for t in tokens]
    if isinstance(prompt_lens, int):
        prompt_lens = [prompt_lens] * len(seqs)
    if len(prompt_lens) != len(seqs):
        raise ValueError(f"{len(prompt_lens)} prompt lengths for {len(seqs)} sequences")
    out = []
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        s = s.reshape(-1).to(device="cpu", dtype=torch.long)
        if not 1 <= int(p) < len(s):
            raise ValueError(
                f"sequence {i}: prompt length {p} of {len(s)} tokens (needs 1 <= prompt_len < "
                "len(tokens): the first token has no log-probability, and one must be scored)"
            )
        out.append((s, int(p)))
    return out


def lane_logprobs(
    model,
    tokens: torch.Tensor | Sequence[Sequence[int] | torch.Tensor],
    prompt_lens: int | Sequence[int] = 1,
    *,
    micro_batch: int | None = None,
) -> list[torch.Tensor]:
    """Teacher-forced fp32 log-probability of each token from its sequence's ``prompt_len`` on.

    ``tokens``: a list of 1-D token-id sequences (any lengths) or a [b, s] tensor; each is
    scored from position 0. ``prompt_lens``: one for all or one per sequence (default 1: every
    token but the first). Returns, per sequence, a float32 tensor of ``len - prompt_len``
    values on cpu: entry ``j`` is log p(token[prompt_len + j] | tokens before it), the bytes a
    lane sampler reports for that decision (``replay.sampled_logprobs``: sequences right-padded
    into one batch; every program is row-invariant, so padding and batching change no byte).
    ``micro_batch``: at most this many sequences per forward. With autograd on (and LoRA
    attached), the result is differentiable w.r.t. the adapter masters.
    """
    from .replay import sampled_logprobs

    seqs = _sequences(tokens, prompt_lens)
    vocab = model.geom.vocab
    for i, (s, _) in enumerate(seqs):
        if s.numel() and (int(s.min()) < 0 or int(s.max()) >= vocab):
            raise ValueError(f"sequence {i}: token ids must lie in [0, {vocab})")
    size = micro_batch or max(1, len(seqs))
    out: list[torch.Tensor] = []
    for b in range(0, len(seqs), size):
        out.extend(sampled_logprobs(model, seqs[b : b + size]))
    return out


# --- rollouts: the sampler's logprobs checked against the trainer -------------------------------
class RolloutFormatError(ValueError):
    """A rollout file (or record) that is not what ``check_rollout`` reads; names the line."""


@dataclass(frozen=True)
class Rollout:
    """One sampled sequence: its token ids (prompt + completion), the prompt length, and the
    sampler's fp32 log-probability of each completion token (``len(tokens) - prompt_len``)."""

    tokens: tuple[int, ...]
    prompt_len: int
    logprobs: torch.Tensor  # float32 [len(tokens) - prompt_len]


def _rollout(record, where: str) -> Rollout:
    if not isinstance(record, dict):
        raise RolloutFormatError(f"{where}: a JSON object expected, got {type(record).__name__}")
    missing = [k for k in ("tokens", "prompt_len", "logprobs") if k not in record]
    if missing:
        raise RolloutFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    tokens, plen, lps = record["tokens"], record["prompt_len"], record["logprobs"]
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise RolloutFormatError(f"{where}: tokens must be a list of integers")
    if not isinstance(plen, int) or isinstance(plen, bool) or not 1 <= plen < len(tokens):
        raise RolloutFormatError(
            f"{where}: prompt_len {plen!r} must be an integer with 1 <= prompt_len < "
            f"len(tokens) = {len(tokens)}"
        )
    if not isinstance(lps, list) or not all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in lps
    ):
        raise RolloutFormatError(f"{where}: logprobs must be a list of numbers")
    if len(lps) != len(tokens) - plen:
        raise RolloutFormatError(
            f"{where}: {len(lps)} logprobs for {len(tokens) - plen} completion tokens "
            f"(len(tokens) {len(tokens)} - prompt_len {plen}): one logprob per sampled token"
        )
    return Rollout(tuple(tokens), plen, torch.tensor(lps, dtype=torch.float64).to(torch.float32))


TOKEN_ID_PREFIX = "token_id:"


def _from_response(record: dict, where: str) -> list[Rollout]:
    """The rollouts of one OpenAI-server exchange: ``{"prompt": [ids], "response": {...}}``
    where the response is a ``/v1/completions`` answer to that prompt asked with
    ``logprobs: 0`` and ``return_tokens_as_token_ids: true`` (vLLM then writes each sampled
    token as ``token_id:N``). One rollout per choice."""
    prompt, response = record["prompt"], record["response"]
    if not isinstance(prompt, list) or not prompt:
        raise RolloutFormatError(f"{where}: prompt must be the request's token ids (a list)")
    choices = response.get("choices") if isinstance(response, dict) else None
    if not choices:
        raise RolloutFormatError(f"{where}: the response has no choices")
    out = []
    for c, choice in enumerate(choices):
        lp = choice.get("logprobs") or {}
        names, values = lp.get("tokens"), lp.get("token_logprobs")
        if names is None or values is None:
            raise RolloutFormatError(
                f'{where}: choice {c} has no logprobs; ask the server with "logprobs": 0'
            )
        ids = []
        for name in names:
            if not (isinstance(name, str) and name.startswith(TOKEN_ID_PREFIX)):
                raise RolloutFormatError(
                    f"{where}: choice {c} names token {name!r}, not its id; ask the server "
                    'with "return_tokens_as_token_ids": true'
                )
            ids.append(int(name[len(TOKEN_ID_PREFIX) :]))
        body = {"tokens": [*prompt, *ids], "prompt_len": len(prompt), "logprobs": values}
        out.append(_rollout(body, f"{where} (choice {c})"))
    return out


def read_rollouts(path: str | os.PathLike[str]) -> list[Rollout]:
    """Read a JSONL of rollouts (blank lines skipped), each line either
    ``{"tokens": [...], "prompt_len": int, "logprobs": [...]}`` or an OpenAI-server exchange
    ``{"prompt": [ids], "response": {...}}`` (``_from_response``: every choice of a
    ``/v1/completions`` answer). Each logprob is read as a JSON number and rounded to float32
    (a float32 written as a Python float comes back with the same bytes). Raises
    ``RolloutFormatError`` naming the file and line of the first bad record."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise RolloutFormatError(f"{where}: not JSON ({err})") from err
            if isinstance(record, dict) and "response" in record and "prompt" in record:
                out.extend(_from_response(record, where))
            else:
                out.append(_rollout(record, where))
    if not out:
        raise RolloutFormatError(f"{path}: no rollouts")
    return out


def write_rollouts(path: str | os.PathLike[str], rollouts: Iterable[Rollout]) -> Path:
    """Write rollouts as ``read_rollouts`` reads them (float32 values as exact JSON floats)."""
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for r in rollouts:
            lps = r.logprobs.detach().to(device="cpu", dtype=torch.float32)
            record = {
                "tokens": [int(t) for t in r.tokens],
                "prompt_len": int(r.prompt_len),
                "logprobs": [float(x) for x in lps.tolist()],
            }
            f.write(json.dumps(record) + "\n")
    return path


@dataclass(frozen=True)
class Mismatch:
    """The first decision whose bytes differ: rollout ``sequence``, token ``position`` in it
    (``prompt_len + step``), its ``index`` among all decisions, and both values."""

    sequence: int
    position: int
    index: int
    sampler: float
    trainer: float


@dataclass(frozen=True)
class RolloutReport:
    """Sampler vs trainer log-probabilities, byte for byte (float32 bits; -0.0 != +0.0)."""

    equal: bool
    sequences: int
    decisions: int
    byte_equal: int
    first_difference: Mismatch | None
    k3_max: float
    max_ulp: int

    def __str__(self) -> str:
        head = f"{self.byte_equal}/{self.decisions} decisions byte-equal"
        if self.first_difference is None:
            return f"equal: {head} ({self.sequences} sequences)"
        m = self.first_difference
        return (
            f"DIFFERENT: {head}; first difference at sequence {m.sequence}, position "
            f"{m.position} (decision {m.index}): sampler {m.sampler!r}, trainer {m.trainer!r}; "
            f"max ulp {self.max_ulp}, K3 max {self.k3_max:.3e}"
        )


def check_rollout(
    model,
    rollouts: str | os.PathLike[str] | Sequence[Rollout],
    *,
    micro_batch: int = 4,
) -> RolloutReport:
    """Recompute every rollout's completion log-probabilities with ``model``
    (``lane_logprobs``, no autograd) and compare them with the sampler's on their raw float32
    bytes (``k3.compare``). ``rollouts``: a JSONL path (``read_rollouts``) or ``Rollout``s.

    This compares values only: unlike ``lockstep replay`` of a trace, there is no admission
    (contract fingerprint, model hash, adapter hash) because the JSONL records none; build the
    model with the model directory and adapter the sampler served."""
    from lockstep_exact.k3 import compare

    if isinstance(rollouts, str | os.PathLike):
        rollouts = read_rollouts(rollouts)
    vocab = model.geom.vocab
    for i, r in enumerate(rollouts):
        bad = [t for t in r.tokens if not 0 <= t < vocab]
        if bad:
            raise RolloutFormatError(
                f"rollout {i}: token id {bad[0]} is outside the model's vocabulary [0, {vocab})"
            )
    with torch.no_grad():
        mine = lane_logprobs(
            model,
            [torch.tensor(r.tokens) for r in rollouts],
            [r.prompt_len for r in rollouts],
            micro_batch=micro_batch,
        )
    sampler = torch.cat([r.logprobs.reshape(-1) for r in rollouts])
    trainer = torch.cat(mine)
    cmp = compare(sampler, trainer)
    first = None
    if cmp.first_diff is not None:
        k = cmp.first_diff
        starts = [0]
        for r in rollouts:
            starts.append(starts[-1] + len(r.tokens) - r.prompt_len)
        seq = max(i for i in range(len(rollouts)) if starts[i] <= k)
        first = Mismatch(
            sequence=seq,
            position=rollouts[seq].prompt_len + (k - starts[seq]),
            index=k,
            sampler=float(sampler[k]),
            trainer=float(trainer[k]),
        )
    return RolloutReport(
        equal=cmp.exact,
        sequences=len(rollouts),
        decisions=cmp.n,
        byte_equal=cmp.byte_equal,
        first_difference=first,
        k3_max=cmp.k3_max,
        max_ulp=cmp.max_ulp,
    )
