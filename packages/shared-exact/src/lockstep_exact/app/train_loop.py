"""``lockstep train``: SFT, GRPO and on-policy distillation on one LoRA adapter, exact at every
step.

One sampling engine (the serving plugin's ``lockstep_sampler_session``) and one trainer model
(the trainer plugin's ``lockstep_trainer_session``) live for the whole run. Every step:

1. the engine samples ``group`` completions per prompt with the adapter the trainer exported
   last (hot-loaded under a new adapter id, no restart); one seed per sequence, every seed of
   the run distinct;
2. the trainer recomputes every sampled token's log-probability, after admitting the trace
   (contract, model and adapter hashes, the sampling rule's draws); the bytes must equal the
   sampler's, or the run stops here: bisect names the first op site that parted, the last
   checkpoint is left as it was, no update is made. Nothing reweights a mismatch away;
3. rewards (the built-in toy task, ``--reward MODULE:FUNCTION`` or the ``lockstep_reward``
   hook) and the update: GRPO (group-normalized advantages, PPO clip against the sampler's
   log-probabilities, optionally a k3 KL to the frozen base model), on-policy distillation
   (a frozen teacher of the same tokenizer scores the student's samples; the per-token
   advantage is the teacher's log-probability minus the student's, i.e. minus the per-token
   reverse KL, whitened over the step's tokens), or SFT
   (prompt/completion pairs of ``--data``; the sampled probe still checks the bytes and
   measures the reward). The trainer refuses the backward pass unless the forward it is about
   to differentiate reproduces the sampler's log-probabilities byte for byte;
4. the adapter is exported (PEFT, bf16) for the next step; the reference and the teacher are
   hash-checked (in memory and on disk); a checkpoint is written every ``checkpoint_every``
   steps (atomic: trainer state, the step, the adapter it continues from).

``--resume`` continues the run in ``out`` up to ``--steps``: same settings or a refusal naming
the one that differs; the adapters and log-probabilities are byte-identical to an
uninterrupted run's (every seed and data position is a function of the step).

Before anything is written, ``prepare_train`` refuses what it can know (settings, model, data,
what ``out`` holds: a new run takes only an empty or new folder); a run or a resume then holds
a lock on ``out`` until it ends, and a second one on the same ``out`` is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint as container
from ..hashing import dir_sha256, sha256_file
from ..k3 import compare
from ..model import ModelDir, model_hash, tokenizer_hash
from ..plugins import require_hook
from ..requests import SamplerSessionRequest, TrainerSessionRequest
from ..trace import Trace
from . import rl
from .bisect import bisect
from .rewards import Completion, RewardError, ToyTask, hook_reward, load_function, score
from .textfile import read_lines
from .tiny import default_prompts
from .train_report import TensorBoard, render

RUN_FORMAT = "lockstep.train.run/2"  # 2: the backend is a setting
ALGOS = ("grpo", "opd", "sft")

__all__ = [
    "ALGOS",
    "TrainConfig",
    "TrainPlan",
    "TrainStopped",
    "ToyTask",
    "group_advantages",
    "prepare_train",
    "run_train",
]

group_advantages = rl.group_advantages


class TrainStopped(RuntimeError):
    """The run stopped before an update: bytes parted, a reward failed, a frozen model
    changed. The checkpoints and adapters of the steps before are left as they were."""


class TrainSetupError(ValueError):
    """A setting, a data file, a teacher or an output directory the run cannot start with."""


@dataclass
class TrainConfig:
    algo: str = "grpo"
    steps: int = 10
    group: int = 8  # completions per prompt
    prompts: int = 4  # prompts (sft: examples) per step
    decisions: int = 8  # sampled tokens per completion
    lr: float | None = None  # None: grpo 2e-2, opd and sft 5e-3
    inner_steps: int | None = None  # optimizer steps per training step; None: sft 1, else 4
    micro_batch: int = 4
    rank: int | None = None  # a fresh adapter's; None: 8, raised to a multiple of top-k
    alpha: float = 16.0
    seed: int = 0
    clip: float = 0.2  # PPO clip (grpo, opd)
    reference: bool = False  # k3 KL to the frozen base model (grpo, opd)
    kl_coef: float = 0.05
    teacher: str | None = None  # opd: the teacher's model directory
    data: str | None = None  # JSONL: {"prompt": ...} rows (sft: and "completion")
    task: str = "toy"  # the built-in reward when no --reward is given
    reward: str | None = None  # MODULE:FUNCTION, or "hook"
    adapter: str | None = None  # start from this adapter (e.g. an SFT run's last)
    checkpoint_every: int = 1
    temperature: float = 1.0
    # Where the sampler and the trainer run: cpu, or cuda (one GPU, shared: vLLM takes
    # ``sampler_memory`` of its memory, Megatron the rest).
    backend: str = "cpu"
    sampler_memory: float = 0.5

    def check(self) -> None:
        """Refuse, naming it, a setting the run cannot start with; fill the defaults that
        depend on the algorithm (``lr``, ``inner_steps``)."""
        if self.algo not in ALGOS:
            raise TrainSetupError(f"train: --algo {self.algo!r}: choose one of {ALGOS}")
        if self.lr is None:
            self.lr = 2e-2 if self.algo == "grpo" else 5e-3
        if self.inner_steps is None:
            self.inner_steps = 1 if self.algo == "sft" else 4
        for name in ("steps", "decisions", "inner_steps", "prompts", "micro_batch"):
            _positive_int(name, getattr(self, name))
        if self.rank is not None:
            _positive_int("rank", self.rank)
        _positive_int("checkpoint_every", self.checkpoint_every)
        _positive_int("group", self.group)
        if self.algo == "grpo" and self.group < 2:
            raise TrainSetupError(
                f"train: --group must be an int >= 2 for grpo (advantages are normalized "
                f"within a group), got {self.group!r}"
            )
        if self.data is None and not 1 <= self.prompts <= 8:
            raise TrainSetupError(
                f"train: --prompts must be in [1, 8] with the built-in prompts (give --data "
                f"for more), got {self.prompts}"
            )
        for name in ("lr", "alpha", "kl_coef"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0):
                raise TrainSetupError(f"train: --{_flag(name)} must be > 0, got {value!r}")
        if not (isinstance(self.temperature, int | float) and self.temperature > 0):
            raise TrainSetupError(
                f"train: --temperature must be > 0 (on-policy sampling), got {self.temperature!r}"
            )
        rl.check_clip(self.clip)
        if self.backend not in ("cpu", "cuda"):
            raise TrainSetupError(f"train: --backend {self.backend!r}: choose cpu or cuda")
        if not (isinstance(self.sampler_memory, int | float) and 0 < self.sampler_memory < 1):
            raise TrainSetupError(
                "train: --sampler-memory is the fraction of the GPU's memory vLLM takes, in "
                f"(0, 1), got {self.sampler_memory!r}"
            )
        if self.backend == "cuda" and not torch.cuda.is_available():
            raise TrainSetupError(
                "train: --backend cuda: no CUDA device here (torch sees none); use --backend "
                "cpu, or run on a machine with a GPU and the GPU build of torch and vLLM"
            )
        if self.algo == "opd" and not self.teacher:
            raise TrainSetupError("train: --algo opd needs --teacher DIR (the teacher's model)")
        if self.algo != "opd" and self.teacher:
            raise TrainSetupError(f"train: --teacher is for --algo opd, not {self.algo}")
        if self.algo == "sft" and not self.data:
            raise TrainSetupError(
                'train: --algo sft needs --data FILE (JSONL lines {"prompt": ..., '
                '"completion": ...})'
            )
        if self.algo == "sft" and self.reference:
            raise TrainSetupError("train: --reference (a KL penalty) is for grpo and opd, not sft")
        if self.task != "toy":
            raise TrainSetupError(
                f"train: --task {self.task!r}: the built-in task is 'toy'; name your own with "
                "--reward MODULE:FUNCTION"
            )

    @property
    def reward_name(self) -> str:
        return self.reward or f"task:{self.task}"


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TrainSetupError(f"train: --{_flag(name)} must be an int >= 1, got {value!r}")


# ----------------------------------------------------------------------------- data


def read_data(path: str | Path, need_completion: bool) -> list[dict]:
    """The rows of a JSONL data file, each checked (the line is named when one is bad)."""
    p = Path(path)
    if not p.is_file():
        raise TrainSetupError(f"train: --data {p}: no such file")
    rows = []
    for n, line in enumerate(read_lines(p, "train: --data", TrainSetupError), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise TrainSetupError(f"train: --data {p}, line {n}: not JSON ({err})") from err
        keys = ("prompt", "completion") if need_completion else ("prompt",)
        if not isinstance(row, dict):
            raise TrainSetupError(f"train: --data {p}, line {n}: expected an object")
        for key in keys:
            if not isinstance(row.get(key), str) or not row[key]:
                raise TrainSetupError(
                    f"train: --data {p}, line {n}: {key!r} must be a non-empty string"
                )
        rows.append(row)
    if not rows:
        raise TrainSetupError(f"train: --data {p} holds no rows")
    return rows


def step_rows(n_rows: int, per_step: int, step: int, seed: int) -> list[int]:
    """The data rows of ``step`` (1-based): epochs of a seeded permutation, read in order; a
    function of the step only, so a resumed run reads what an uninterrupted one would."""
    out = []
    for j in range(per_step):
        position = (step - 1) * per_step + j
        epoch, k = divmod(position, n_rows)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        out.append(int(torch.randperm(n_rows, generator=g)[k]))
    return out


# ----------------------------------------------------------------------------- progress


class Progress:
    """What the loop reports: a message, each finished step. The default prints lines."""

    def __init__(self, say: Callable[[str], None] = print):
        self._say = say

    def say(self, message: str) -> None:
        self._say(message)

    def start(self, total: int, done: int) -> None:
        pass

    def step(self, row: dict, total: int) -> None:
        self._say(step_line(row, total))

    def close(self) -> None:
        pass


def step_line(row: dict, total: int) -> str:
    """One step's progress line. SFT optimizes no reward: its line leads with the loss and
    leaves out the reward of the sampled probe (it is in metrics.jsonl)."""
    if row.get("algo") == "sft":
        return (
            f"step {row['step']}/{total}  loss {row['loss']:+.4f}  "
            f"equal {row['equal']}/{row['decisions']}  k3_max {row['k3_max']:g}  "
            f"{row['seconds']:.1f}s"
        )
    extra = ""
    if row.get("reverse_kl") is not None:
        extra += f"  rkl {row['reverse_kl']:.4f}"
    if row.get("kl") is not None:
        extra += f"  kl {row['kl']:.4f}"
    return (
        f"step {row['step']}/{total}  reward {row['reward_mean']:.3f}  "
        f"equal {row['equal']}/{row['decisions']}  k3_max {row['k3_max']:g}  "
        f"loss {row.get('loss', float('nan')):+.4f}{extra}  {row['seconds']:.1f}s"
    )


# ----------------------------------------------------------------------------- the run


class _Frozen:
    """A frozen model the loop checks every step: in memory and on disk."""

    def __init__(self, name: str, session, model_dir: Path):
        self.name, self.session, self.dir = name, session, model_dir
        self.memory = session.backbone_hash()
        self.disk = model_hash(model_dir)

    def check(self, step: int) -> None:
        if self.session.backbone_hash() != self.memory:
            raise TrainStopped(
                f"step {step}: the {self.name}'s weights changed in memory; no update was made"
            )
        now = model_hash(self.dir)
        if now != self.disk:
            raise TrainStopped(
                f"step {step}: the {self.name}'s model directory {self.dir} changed on disk "
                f"(hash {self.disk[:16]} -> {now[:16]}); no update was made"
            )


def _identity(config: TrainConfig, model: ModelDir, extra: dict) -> dict:
    settings = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "steps"}
    return {
        "format": RUN_FORMAT,
        "model_hash": model.model_hash,
        "contract": model.contract(config.backend).fingerprint,
        **{f"setting.{k}": v for k, v in settings.items()},
        **extra,
    }


# The file and folder settings whose content the run records: a resume compares the content
# (the same file under another path, ./data.jsonl for data.jsonl, is the same run).
_CONTENT = {
    "setting.data": "data_sha256",
    "setting.adapter": "adapter_in_sha256",
    "setting.teacher": "teacher_hash",
}


def _check_resume(recorded: dict, current: dict, where: Path) -> None:
    for key in [*current, *(k for k in recorded if k not in current)]:
        a, b = recorded.get(key, "<absent>"), current.get(key, "<absent>")
        if key in _CONTENT and isinstance(a, str) and isinstance(b, str):
            digest = _CONTENT[key]
            old, new = recorded.get(digest), current.get(digest)
            if old != new:
                flag = _flag(key.removeprefix("setting."))
                raise TrainSetupError(
                    f"train --resume: {where} was run with --{flag} {a} ({digest} {old}), this "
                    f"run's --{flag} {b} holds other content ({digest} {new}); refusing to "
                    f"resume (give the same --{flag}, or another --out)"
                )
            continue
        if json.loads(json.dumps(a)) != json.loads(json.dumps(b)):
            name = key.removeprefix("setting.")
            raise TrainSetupError(
                f"train --resume: {where} was run with {name} = {a!r}, this run has {b!r}; "
                "refusing to resume (use the same settings, or another --out)"
            )


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def _checkpoints(out: Path) -> list[Path]:
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith("step-") and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(out: Path, step: int, trainer_files: dict[str, bytes], loop: dict) -> Path:
    """The trainer's state and the loop's record, in the one training checkpoint container
    (``lockstep_exact.checkpoint``, kind ``train``)."""
    path = out / "checkpoints" / f"step-{step:04d}"
    return container.save_checkpoint(path, trainer_files, "train", loop)


def load_checkpoint(path: Path) -> tuple[dict[str, bytes], dict]:
    """(trainer files, loop state), or ``TrainSetupError`` naming what is damaged."""
    try:
        return container.load_checkpoint(path, "train", TrainSetupError)
    except TrainSetupError as err:
        raise TrainSetupError(f"train --resume: {err}") from err


@dataclass
class _Run:
    pm: Any
    model: ModelDir
    out: Path
    config: TrainConfig
    progress: Progress
    reward: Callable[[Completion], float]
    rows: list[dict] | None = None  # data rows
    sampler: Any = None
    policy: Any = None
    reference: _Frozen | None = None
    teacher: _Frozen | None = None

    # -- one step's inputs ---------------------------------------------------------------
    def examples(self, step: int) -> list[dict]:
        c = self.config
        if self.rows is None:
            return [{"prompt": p} for p in default_prompts(c.prompts)]
        return [self.rows[i] for i in step_rows(len(self.rows), c.prompts, step, c.seed)]

    def seed(self, step: int) -> int:
        """The first sampling seed of ``step``: each of its sequences takes the next one."""
        return self.config.seed + (step - 1) * self.config.prompts * self.config.group

    def completions(self, trace: Trace, examples: list[dict]) -> list[Completion]:
        g = self.config.group
        out = []
        for i in range(trace.num_sequences):
            ids = tuple(int(t) for t in trace.sampled(i))
            out.append(
                Completion(
                    index=i,
                    group=i // g,
                    prompt=examples[i // g]["prompt"],
                    prompt_ids=tuple(int(t) for t in trace.prompt(i)),
                    token_ids=ids,
                    text=self.sampler.decode(ids),
                    example=examples[i // g],
                )
            )
        return out

    # -- one step -----------------------------------------------------------------------------
    def step(self, step: int, adapter: Path) -> dict:
        c = self.config
        t0 = time.perf_counter()
        examples = self.examples(step)
        prompts = [e["prompt"] for e in examples for _ in range(c.group)]
        trace_dir = self.out / "traces" / f"step-{step:04d}"
        trace = self.sampler.sample(
            prompts, c.decisions, self.seed(step), adapter, temperature=c.temperature
        )
        trace.save(trace_dir, overwrite=True)
        # Seconds per phase: sample (the adapter's load into the engine, the draw, the trace
        # written), recompute (the policy's log-probabilities of the trace, compared), frozen
        # (the reference's or teacher's), update (forward, backward and AdamW over the inner
        # steps); export (the adapter written) is added by the loop.
        phases = {"sample": time.perf_counter() - t0}
        row: dict[str, Any] = {
            "step": step,
            "algo": c.algo,
            "trace": str(trace_dir.relative_to(self.out)),
            "adapter_in": str(adapter.relative_to(self.out)),
            "adapter_id": getattr(self.sampler, "adapter_id", None),
            "engine_starts": getattr(self.sampler, "starts", None),
            # Every line has both: null where the step has none (kl: no --reference;
            # reverse_kl: not opd).
            "kl": None,
            "reverse_kl": None,
            "phases": phases,
        }
        try:
            trainer_lps = self.policy.logprobs(trace)
        except (ValueError, RuntimeError) as err:  # admission: contract, adapter, drawn token
            raise TrainStopped(
                f"step {step}: the trainer refused the sampler's trace: {err}; no update was made"
            ) from err
        cmp = compare(trace.logprobs, trainer_lps)
        row.update(k3_max=cmp.k3_max, decisions=cmp.n, equal=cmp.byte_equal)
        phases["recompute"] = time.perf_counter() - t0 - phases["sample"]
        completions = self.completions(trace, examples)
        try:
            rewards = [score(self.reward, x, c.reward_name) for x in completions]
        except RewardError as err:
            raise TrainStopped(f"step {step}: {err}; no update was made") from err
        row["reward_mean"] = sum(rewards) / len(rewards)
        row["rewards"] = rewards
        if not cmp.exact:
            row["seconds"] = time.perf_counter() - t0
            row["stopped"] = True
            self.append(row)
            raise _Mismatch(step, cmp, trace_dir, adapter)
        for frozen in (self.reference, self.teacher):
            if frozen is not None:
                frozen.check(step)
        seqs = [
            (torch.cat([trace.prompt(i), trace.sampled(i)]), len(trace.prompt(i)))
            for i in range(trace.num_sequences)
        ]
        old = [trace.sequence_logprobs(i) for i in range(trace.num_sequences)]
        t_frozen = time.perf_counter()
        ref = None
        if self.reference is not None:
            ref = _split(self.reference.session.logprobs(trace), old)
            kl = torch.cat([rl.k3_kl(o, r) for o, r in zip(old, ref, strict=True)])
            row["kl"] = float(kl.mean())
        if c.algo == "grpo":
            adv = rl.group_advantages(rewards, c.group)
            advantages = [torch.tensor(a, dtype=torch.float32) for a in adv]
        elif c.algo == "opd":
            teacher = _split(self.teacher.session.logprobs(trace), old)
            raw = [t - o for t, o in zip(teacher, old, strict=True)]  # -(per-token reverse KL)
            advantages = rl.whiten(raw)
            row["reverse_kl"] = float(-torch.cat(raw).mean())
        if self.reference is not None or c.algo == "opd":
            phases["frozen"] = time.perf_counter() - t_frozen
        t_update = time.perf_counter()
        if c.algo in ("grpo", "opd"):

            def loss(lps, idx):
                return rl.policy_loss(
                    lps,
                    [old[i] for i in idx],
                    [advantages[i] for i in idx],
                    clip=c.clip,
                    kl_coef=c.kl_coef,
                    reference=[ref[i] for i in idx] if ref is not None else None,
                )

            losses = self._update(step, seqs, old, loss, c.inner_steps)
        else:
            sft = [self._sft_sequence(e) for e in examples]
            losses = self._update(
                step, sft, None, lambda lps, idx: rl.sft_loss(lps), c.inner_steps, len(sft)
            )
        row["loss"] = sum(losses) / len(losses)
        phases["update"] = time.perf_counter() - t_update
        row["seconds"] = time.perf_counter() - t0
        return row

    def _sft_sequence(self, example: dict) -> tuple[torch.Tensor, int]:
        p = self.sampler.encode(example["prompt"], prompt=True)
        comp = self.sampler.encode(example["completion"], prompt=False)
        if not p or not comp:
            raise TrainStopped(f"an SFT row tokenizes to nothing: {example!r}")
        return torch.tensor(p + comp, dtype=torch.long), len(p)

    def _update(self, step, seqs, old, loss, inner, micro=None) -> list[float]:
        try:
            return self.policy.update(seqs, old, loss, inner, micro)
        except (ValueError, RuntimeError) as err:  # BackwardRefused, a backbone that moved
            raise TrainStopped(f"step {step}: {err}") from err

    def append(self, row: dict) -> None:
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")


class _Mismatch(Exception):
    def __init__(self, step, cmp, trace_dir, adapter):
        self.step, self.cmp, self.trace_dir, self.adapter = step, cmp, trace_dir, adapter


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.split(flat.to(torch.float32), [len(x) for x in like]))


def _reward_function(pm, config: TrainConfig, model: ModelDir, reward):
    if reward is not None:
        return reward
    if config.reward == "hook":
        return hook_reward(pm)
    if config.reward:
        return load_function(config.reward)
    return ToyTask(vocab=model.geometry.vocab)


def run_train(
    pm,
    model_dir: str | Path,
    out_dir: str | Path,
    config: TrainConfig,
    *,
    progress: Progress | None = None,
    reward: Callable[[Completion], float] | None = None,
    resume: bool = False,
) -> list[dict]:
    """Run ``config.steps`` steps (from the last checkpoint with ``resume``); returns every
    step's metrics (also in ``out_dir/metrics.jsonl``, with ``report.html`` beside).

    ``reward`` (a callable taking a ``Completion``) overrides ``config.reward``. Raises
    ``TrainStopped`` when a step cannot be trusted (its metrics line is written first).
    ``prepare_train``, ``TrainPlan.claim`` and ``TrainPlan.run`` in one call."""
    plan = prepare_train(pm, model_dir, out_dir, config, reward=reward, resume=resume)
    with plan.claim():
        return plan.run(progress)


def prepare_train(
    pm,
    model_dir: str | Path,
    out_dir: str | Path,
    config: TrainConfig,
    *,
    reward: Callable[[Completion], float] | None = None,
    resume: bool = False,
) -> TrainPlan:
    """Everything a run is refused for that can be known before it writes anything: the
    settings, the model, the reward, the data, the teacher, the plugins, and what ``out_dir``
    holds (a run of these settings to continue with ``resume``; else an empty or new folder).
    Reads only: a refusal here leaves ``out_dir`` (its engine log included) as it was."""
    config.check()
    out = Path(out_dir)
    # refuses, naming it, what the lane cannot run; the hybrid lane (Qwen3-Next) trains on cpu
    model = ModelDir(model_dir, hybrid=True)
    _fit_rank(config, model)
    fn = _reward_function(pm, config, model, reward)
    rows = read_data(config.data, config.algo == "sft") if config.data else None
    extra: dict[str, Any] = {
        "reward_function": getattr(fn, "__qualname__", type(fn).__name__),
        "data_sha256": sha256_file(config.data) if config.data else None,
    }
    if config.adapter:
        extra["adapter_in_sha256"] = _adapter_files_hash(Path(config.adapter))
    if config.teacher:
        extra["teacher_hash"] = _check_teacher(model, Path(config.teacher))
    identity = _identity(config, model, extra)
    sample_hook = require_hook(pm, "lockstep_sampler_session", "sampler", "lockstep-serving")
    trainer_hook = require_hook(pm, "lockstep_trainer_session", "trainer", "lockstep-megatron")
    _check_out(out, identity, resume)
    return TrainPlan(pm, model, out, config, identity, fn, rows, sample_hook, trainer_hook, resume)


def _fit_rank(config: TrainConfig, model: ModelDir) -> None:
    """The rank of a fresh adapter: grouped expert LoRA gives each routed expert of an MoE
    rank r // top-k, so r must be a multiple of top-k. No ``rank``: 8, raised to a multiple
    of top-k (the qualify ladder's rule); a ``rank`` that is not one is refused, naming one
    that is."""
    geom = model.geometry
    topk = geom.topk if geom.is_moe else 1
    if config.rank is None:
        config.rank = 8 + (-8) % topk
    elif config.adapter is None and config.rank % topk:
        raise TrainSetupError(
            f"train: --rank {config.rank} is not a multiple of {model.path}'s top-k {topk} "
            f"(each routed expert's LoRA gets rank // top-k): use --rank "
            f"{config.rank + (-config.rank) % topk}"
        )


def _check_out(out: Path, identity: dict, resume: bool) -> None:
    """Refuse an ``out`` the run cannot use: with ``resume``, one without a run of these
    settings; without, one that holds a run, or files Lockstep did not write there."""
    run_json = out / "run.json"
    if resume:
        if not run_json.is_file():
            raise TrainSetupError(f"train --resume: {out} holds no run (no run.json)")
        _check_resume(json.loads(run_json.read_text()), identity, out)
        return
    if run_json.exists():
        raise TrainSetupError(
            f"train: {out} already holds a run (run.json); continue it with --resume or "
            "choose another --out"
        )
    if out.exists() and not out.is_dir():
        raise TrainSetupError(f"train: --out {out} is a file, not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()):
        found = sorted(p.name for p in out.iterdir())
        listed = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise TrainSetupError(
            f"train: --out {out} is not empty ({listed}) and holds no Lockstep run (no "
            "run.json): choose an empty or new --out"
        )


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on the folder ``out`` (``flock`` on the directory itself: no
    lock file, released by the kernel when the process ends however it ends), or refuse at
    once when another run or resume holds it."""
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TrainSetupError(
                f"train: another lockstep train is running in {out} (it holds the folder's "
                "lock); wait for it to finish, or choose another --out"
            ) from None
        yield
    finally:
        os.close(fd)  # releases the lock


@dataclass
class TrainPlan:
    """A run that ``prepare_train`` admitted: ``claim()`` takes ``out`` for it, ``run()``
    runs its steps inside the claim."""

    pm: Any
    model: ModelDir
    out: Path
    config: TrainConfig
    identity: dict
    reward: Callable[[Completion], float]
    rows: list[dict] | None
    sample_hook: Any
    trainer_hook: Any
    resume: bool
    done: int = 0  # steps a resumed run has behind it (its last checkpoint's)
    loop: dict | None = None
    files: dict | None = None

    @property
    def complete(self) -> bool:
        """A resumed run whose last checkpoint is at ``--steps`` or past it: nothing to run."""
        return self.done >= self.config.steps

    @contextlib.contextmanager
    def claim(self) -> Iterator[TrainPlan]:
        """Create ``out`` if need be and lock it for the run (``_locked``: a second run or
        resume on the same ``out`` is refused while this one holds it), check it again under
        the lock, then write the run record (a new run) or read the last checkpoint and forget
        the steps after it (a resume). A refusal here removes the folder if it made it (and it
        is still empty)."""
        out = self.out
        try:
            out.mkdir(parents=True)
            made = True
        except FileExistsError:
            made = False
        with _locked(out):  # refused: another run holds out (and uses it, if this one made it)
            try:
                _check_out(out, self.identity, self.resume)
                if self.resume:
                    found = _checkpoints(out)
                    if found:
                        self.files, self.loop = load_checkpoint(found[-1])
                        self.done = int(self.loop["step"])
                    _truncate(out, self.done)
                else:
                    _write_json(out / "run.json", self.identity)
                    (out / "metrics.jsonl").write_text("")
            except BaseException:
                if made:
                    with contextlib.suppress(OSError):
                        out.rmdir()  # only if still empty
                raise
            yield self

    def run(self, progress: Progress | None = None) -> list[dict]:
        """The run's steps, from the last checkpoint to ``--steps`` (inside ``claim()``)."""
        progress = progress or Progress()
        config, model, out, identity = self.config, self.model, self.out, self.identity
        done, loop, files = self.done, self.loop, self.files
        history = _read_metrics(out)
        board = TensorBoard(out)  # scalars under out/tensorboard, if tensorboard is installed
        if board.hint:
            progress.say(board.hint)
        if self.complete:
            progress.say(
                f"{out}: run already complete at step {done}; nothing to do (--steps "
                f"{config.steps}; give a larger --steps to train on)"
            )
            write_report(out, history, identity, board=board)
            board.close()
            return history

        run = _Run(self.pm, model, out, config, progress, self.reward, self.rows)
        trainer_hook = self.trainer_hook
        progress.say(f"building the trainer (Megatron) for {model.path}")
        max_rank = max(config.rank, _adapter_rank(config.adapter))
        try:
            run.policy = trainer_hook(
                request=TrainerSessionRequest(
                    model_dir=model.path,
                    role="policy",
                    adapter_in=Path(config.adapter) if config.adapter else None,
                    rank=config.rank,
                    alpha=config.alpha,
                    lr=config.lr,
                    seed=config.seed,
                    micro_batch=config.micro_batch,
                    backend=config.backend,
                )
            )
            if config.reference:
                frozen = _frozen(trainer_hook, model.path, config.backend)
                run.reference = _Frozen("reference", frozen, model.path)
            if config.teacher:
                tdir = Path(config.teacher)
                run.teacher = _Frozen("teacher", _frozen(trainer_hook, tdir, config.backend), tdir)
            if loop is None:
                adapter, _ = run.policy.export(out / "adapters" / "step-0000")
            else:
                adapter = out / loop["adapter"]
                run.policy.load_state_files(files, adapter)
            progress.say(
                "trainer ready (policy"
                + (", reference" if config.reference else "")
                + (", teacher" if config.teacher else "")
                + "); starting the sampler"
            )
            # On cuda the sampler and the trainer share one GPU: vLLM is held to a fixed
            # fraction of its memory (--sampler-memory), the trainer's model, adapter and
            # AdamW state live in the rest; nothing is moved between steps.
            gpu = {"gpu_memory_utilization": config.sampler_memory}
            run.sampler = self.sample_hook(
                request=SamplerSessionRequest(
                    model_dir=model.path,
                    backend=config.backend,
                    contract=identity["contract"],
                    max_lora_rank=max_rank,
                    options=gpu if config.backend == "cuda" else {},
                )
            )
            progress.say(f"sampler ready: {config.steps - done} steps of {config.algo} to run")
            progress.start(config.steps, done)
            for step in range(done + 1, config.steps + 1):
                try:
                    row = run.step(step, adapter)
                except _Mismatch as m:
                    raise TrainStopped(_mismatch_message(run, m)) from None
                t_export = time.perf_counter()
                adapter, _ = run.policy.export(out / "adapters" / f"step-{step:04d}")
                row["phases"]["export"] = time.perf_counter() - t_export
                row["adapter_out"] = str(adapter.relative_to(out))
                run.append(row)
                history.append(row)
                if step % config.checkpoint_every == 0 or step == config.steps:
                    save_checkpoint(
                        out,
                        step,
                        run.policy.state_files(),
                        {"step": step, "adapter": row["adapter_out"]},
                    )
                progress.step(row, config.steps)
                write_report(out, history, identity, board=board)
        except TrainStopped as err:
            history = _read_metrics(out)
            write_report(out, history, identity, stopped=str(err), board=board)
            raise
        finally:
            board.close()
            progress.close()
            for session in (run.sampler, run.policy):
                if session is not None:
                    session.close()
        return history


def _frozen(hook, model_dir: Path, backend: str):
    return hook(request=TrainerSessionRequest(model_dir=model_dir, role="frozen", backend=backend))


def _adapter_rank(adapter: str | None) -> int:
    if not adapter:
        return 1
    cfg = Path(adapter) / "adapter_config.json"
    try:
        return int(json.loads(cfg.read_text()).get("r", 1))
    except (OSError, ValueError, TypeError):
        return 1  # the trainer's loader names what is wrong with it


def _adapter_files_hash(path: Path) -> str:
    if not path.is_dir():
        raise TrainSetupError(f"train: --adapter {path}: not a directory")
    return dir_sha256(path, ("*.safetensors", "adapter_config.json"))


def _check_teacher(student: ModelDir, teacher_dir: Path) -> str:
    """Refuse a teacher whose token ids do not mean the student's texts; its model hash."""
    teacher = ModelDir(teacher_dir, hybrid=True)
    mine, theirs = tokenizer_hash(student.path), tokenizer_hash(teacher.path)
    if mine is None or theirs is None:
        raise TrainSetupError(
            f"train: --teacher {teacher_dir}: cannot compare tokenizers (no tokenizer files in "
            f"{student.path if mine is None else teacher_dir})"
        )
    if mine != theirs or teacher.geometry.vocab != student.geometry.vocab:
        raise TrainSetupError(
            f"train: --teacher {teacher_dir} has another tokenizer than {student.path} "
            f"(vocabulary {teacher.geometry.vocab} vs {student.geometry.vocab} ids; tokenizer "
            f"files {theirs[:12]} vs {mine[:12]}): its log-probabilities would score other "
            "texts; distill from a teacher with the student's tokenizer"
        )
    return teacher.model_hash


def _mismatch_message(run: _Run, m: _Mismatch) -> str:
    """Close the engine, bisect the first differing decision, name what parted."""
    run.sampler.close()
    text = (
        f"step {m.step}: the trainer's log-probability of decision {m.cmp.first_diff} is not "
        f"byte-equal to the sampler's ({m.cmp.byte_equal} of {m.cmp.n} equal, K3 max "
        f"{m.cmp.k3_max:.3g}); no update was made; last checkpoint "
        f"{_last_checkpoint_name(run.out)}; trace {m.trace_dir}"
    )
    try:
        div, missing = bisect(run.pm, m.trace_dir, m.cmp.first_diff, run.model.path, m.adapter)
        found = (
            str(div)
            if div is not None
            else (
                "every op site is byte-equal on both halves (the difference is past the last "
                "op site: in the log-probabilities as returned)"
            )
        )
        if missing:
            found += f"; sites on one side only: {missing}"
    except Exception as err:  # noqa: BLE001 (the stop is reported whatever bisect does)
        found = f"bisect could not run: {type(err).__name__}: {err}"
    _write_json(
        run.out / "bisect.json", {"step": m.step, "decision": m.cmp.first_diff, "result": found}
    )
    return f"{text}; bisect: {found}"


def _last_checkpoint_name(out: Path) -> str:
    found = _checkpoints(out)
    return str(found[-1].relative_to(out)) if found else "none"


def _read_metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _truncate(out: Path, done: int) -> None:
    """Forget what steps after the checkpoint wrote (they run again, to the same bytes)."""
    rows = [r for r in _read_metrics(out) if r["step"] <= done and not r.get("stopped")]
    tmp = out / "metrics.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    tmp.replace(out / "metrics.jsonl")
    for sub in ("traces", "adapters", "checkpoints"):
        for p in (out / sub).glob("step-*"):
            if int(p.name.split("-")[1]) > done or (sub == "adapters" and done == 0):
                shutil.rmtree(p)
    (out / "bisect.json").unlink(missing_ok=True)


def write_report(
    out: Path,
    rows: list[dict],
    identity: dict,
    stopped: str | None = None,
    board: TensorBoard | None = None,
) -> Path:
    """``report.html`` (rewritten whole), and the steps ``board`` has not written yet."""
    if board is not None:
        board.write(rows)
    path = out / "report.html"
    tmp = out / "report.html.tmp"
    tmp.write_text(render(rows, identity, stopped), encoding="utf-8")
    tmp.replace(path)
    return path
