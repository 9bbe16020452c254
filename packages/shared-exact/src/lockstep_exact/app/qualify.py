"""The qualification ladder: gates that prove, or disprove, that a trainer/sampler pair is exact.

Each gate captures with the serving plugin and replays with the trainer plugin through the
hooks, compares the raw FP32 bytes decision by decision, and stops the ladder at the first
failure (after a first-divergence search when both halves can dump their op sites).
"""

from __future__ import annotations

import gc
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import __version__
from ..adapters import load_adapter, make_adapter
from ..contract import admit, check_layout
from ..k3 import compare, k3
from ..model import ModelDir, geometry_contract
from ..parity import same_bytes
from ..plugins import MissingHalf, require_hook
from ..requests import CaptureRequest, ReplayRequest, TrainRequest
from ..testing import perturb_adapter
from ..trace import Trace
from .bisect import bisect
from .tiny import default_prompts


@dataclass
class Check:
    what: str
    passed: bool
    decisions: int = 0
    byte_equal: int = 0
    k3_max: float = 0.0
    first_difference: int | None = None
    max_ulp: int = 0
    k3: list[float] = field(default_factory=list)
    expect_exact: bool = True  # False for negative controls, which must differ
    note: str = ""
    trace: str | None = None  # the trace directory the sampler side came from
    adapter: str | None = None


@dataclass
class Gate:
    name: str
    passed: bool = False
    seconds: float = 0.0
    checks: list[Check] = field(default_factory=list)
    bisect: dict | None = None
    error: str | None = None


@dataclass
class Report:
    model: str
    adapter: str | None
    contract: str
    lane: str
    engines: list[dict]
    backend: str = "cpu"  # where both halves ran the lane (its name ends in it too)
    device: str | None = None  # the GPU's name on cuda, the processor on cpu
    # Each half's parallel layout, e.g. {"sampler": {"tp": 2}, "trainer": {"tp": 1, "ep": 2}}.
    layouts: dict = field(default_factory=dict)
    lockstep_exact: str = __version__
    sampler: str = "in-process"  # or the sampler process's engine ("sglang": qualify --sampler)
    notes: list[str] = field(default_factory=list)  # what the ladder could not do, and why
    gates: list[Gate] = field(default_factory=list)
    passed: bool = False
    seconds: float = 0.0

    def as_json(self) -> dict:
        return asdict(self)


class GateFailed(Exception):
    pass


class BackendRefused(ValueError):
    """The ladder cannot run on the asked backend here (said before any engine starts)."""


BACKENDS = ("cpu", "cuda")


def check_backend(backend: str, trainer_tp: int = 1, trainer_ep: int = 1) -> None:
    """cpu anywhere; cuda where torch sees a CUDA device, with the trainer on one GPU."""
    if backend not in BACKENDS:
        raise BackendRefused(f"backend {backend!r}: the ladder runs on {' or '.join(BACKENDS)}")
    if backend != "cuda":
        return
    if not torch.cuda.is_available():
        raise BackendRefused(
            f"--backend cuda: torch {torch.__version__} sees no CUDA device on this machine; "
            "qualify there on the GPU machine (vLLM 0.26.0 or SGLang 0.5.17 sampling), or here "
            "with --backend cpu"
        )
    if trainer_tp * trainer_ep != 1:
        raise BackendRefused(
            f"--backend cuda runs the trainer on one GPU (tp x ep = 1), not tp {trainer_tp} "
            f"x ep {trainer_ep}"
        )


def device_name(backend: str) -> str:
    """What the report names as the device: the GPU on cuda, the processor on cpu."""
    if backend == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine() or 'unknown'})"


class Ladder:
    """Runs the gates in order. ``progress(message)`` is told what is happening."""

    def __init__(
        self,
        pm,
        model_dir: Path,
        out_dir: Path,
        *,
        decisions: int = 64,
        adapter_dir: Path | None = None,
        prompts: tuple[str, ...] | None = None,
        progress: Callable[[str], None] = print,
        rank: int | None = None,
        sampler_model: Path | None = None,
        sampler_tp: int = 1,
        trainer_tp: int = 1,
        trainer_ep: int = 1,
        backend: str = "cpu",
        sampler=None,
    ):
        # The backend first: on a machine without CUDA, cuda is refused before anything is read.
        check_backend(backend, trainer_tp, trainer_ep)
        self.backend = backend
        # A sampler in another environment (sampler_process.SamplerProcess): its capture and
        # contract replace the installed sampler plugin's hooks; the trainer's stay here.
        self.sampler = sampler
        self.pm = pm
        self.model = Path(model_dir)
        # A sampler-side copy of the model (debugging a fleet whose copy may differ).
        self.sampler_model = Path(sampler_model) if sampler_model else self.model
        self.out = Path(out_dir)
        self.decisions = decisions
        self.user_adapter = Path(adapter_dir) if adapter_dir else None
        self.prompts = tuple(prompts or default_prompts(8))
        self.say = progress
        # A Qwen3-Next model is admitted here: both plugins run its lane (vllm_next, gdn.py),
        # and each half's contract hook refuses by name what that lane lacks.
        self.model_dir = ModelDir(self.model, hybrid=True)
        self.geom = self.model_dir.geometry
        # The ladder's adapters: rank 8, raised to a multiple of top-k for an MoE (grouped
        # expert LoRA gives each routed expert rank r // topk).
        topk = self.geom.topk if self.geom.is_moe else 1
        self.rank = rank if rank is not None else 8 + (-8) % topk
        self.contract = self.model_dir.contract(backend)
        # Each half's layout, refused here (naming both numbers) when it does not divide the
        # contract: before any engine starts. The bytes must not depend on either.
        check_layout(self.contract, tp=sampler_tp)
        check_layout(self.contract, tp=trainer_tp, ep=trainer_ep)
        if self.geom.family == "qwen3-next":  # one device so far: LayoutRefused above 1
            geometry_contract(self.geom, backend=backend, tp=sampler_tp)
            geometry_contract(self.geom, backend=backend, tp=trainer_tp, ep=trainer_ep)
        self.layouts = {
            "sampler": {"tp": sampler_tp},
            "trainer": {"tp": trainer_tp, "ep": trainer_ep},
        }
        self._capture = (
            sampler.capture
            if sampler is not None
            else require_hook(pm, "lockstep_capture", "sampler", "lockstep-serving")
        )
        self._replay = require_hook(pm, "lockstep_replay", "trainer", "lockstep-megatron")
        self._traces = 0

    # --- primitives --------------------------------------------------------------------------
    def free_device(self) -> None:
        """On cuda, hand the previous engine's memory back before the next one starts (one
        engine at a time: each vLLM engine sizes its cache from the memory it finds free)."""
        if self.backend == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def _sampler_contract(self, *, model_dir, adapter_dir, backend):
        if self.sampler is not None:
            return self.sampler.contract(model_dir, backend)
        return self.pm.hook.lockstep_sampler_contract(
            model_dir=model_dir, adapter_dir=adapter_dir, backend=backend
        )

    def admit_halves(self) -> None:
        for half, hook in (
            ("sampler", self._sampler_contract),
            ("trainer", self.pm.hook.lockstep_trainer_contract),
        ):
            theirs = hook(model_dir=self.model, adapter_dir=None, backend=self.backend)
            if theirs is None:
                raise MissingHalf(f"no installed plugin states the {half} contract")
            admit(self.contract, theirs)

    def capture(
        self, tag: str, *, adapter: Path | None, n_prompts: int, per_prompt: int, seed: int = 0
    ) -> tuple[Path, Trace]:
        self._traces += 1
        self.free_device()
        out = self.out / "traces" / f"{self._traces:02d}-{tag}"
        self.say(f"capture {tag}: {n_prompts} prompts x {per_prompt} decisions")
        trace = self._capture(
            request=CaptureRequest(
                model_dir=self.sampler_model,
                adapter_dir=adapter,
                prompts=self.prompts[:n_prompts],
                decisions=per_prompt,
                out_dir=out,
                seed=seed,
                contract=self.contract.fingerprint,
                backend=self.backend,
                tp=self.layouts["sampler"]["tp"],
            )
        )
        if not (out / "manifest.json").exists():
            trace.save(out)
        return out, Trace.load(out)

    def replay(self, trace_dir: Path, *, adapter: Path | None, control: bool = False):
        self.say(f"replay {trace_dir.name}" + (" (negative control)" if control else ""))
        self.free_device()
        return self._replay(
            request=ReplayRequest(
                model_dir=self.model,
                trace_dir=trace_dir,
                adapter_dir=adapter,
                control=control,
                backend=self.backend,
                tp=self.layouts["trainer"]["tp"],
                ep=self.layouts["trainer"]["ep"],
            )
        ).logprobs

    @staticmethod
    def check(
        what: str, sampler: torch.Tensor, trainer: torch.Tensor, *, expect_exact: bool = True
    ) -> Check:
        cmp = compare(sampler, trainer)
        exact = cmp.exact
        return Check(
            what=what,
            passed=exact if expect_exact else not exact,
            decisions=cmp.n,
            byte_equal=cmp.byte_equal,
            k3_max=cmp.k3_max,
            first_difference=cmp.first_diff,
            max_ulp=cmp.max_ulp,
            k3=[float(v) for v in k3(sampler, trainer)],
            expect_exact=expect_exact,
        )

    def stable(self, what: str, traces: list[Trace]) -> Check:
        first = traces[0]
        ok = all(
            torch.equal(t.sampled_tokens, first.sampled_tokens)
            and same_bytes(t.logprobs, first.logprobs)
            for t in traces[1:]
        )
        return Check(
            what=what,
            passed=ok,
            decisions=first.num_decisions,
            byte_equal=first.num_decisions if ok else 0,
            note=f"{len(traces)} captures, tokens and logprob bytes "
            + ("identical" if ok else "DIFFER"),
        )

    def replay_check(self, what: str, trace_dir: Path, trace: Trace, adapter: Path | None) -> Check:
        self._last = (trace_dir, adapter)
        c = self.check(what, trace.logprobs, self.replay(trace_dir, adapter=adapter))
        c.trace, c.adapter = str(trace_dir), str(adapter) if adapter else None
        return c

    # --- gates ---------------------------------------------------------------------------------
    def base_ruler(self, gate: Gate) -> None:
        d4, t4 = self.capture("base-4", adapter=self.user_adapter, n_prompts=4, per_prompt=1)
        gate.checks.append(
            self.replay_check("trainer replays 4 decisions", d4, t4, self.user_adapter)
        )
        self._gate_ok(gate)
        per = max(1, self.decisions // len(self.prompts))
        runs = [
            self.capture(
                f"base-{per * len(self.prompts)}-r{i}",
                adapter=self.user_adapter,
                n_prompts=len(self.prompts),
                per_prompt=per,
            )
            for i in range(3)
        ]
        gate.checks.append(
            self.stable("sampler bytes stable over 3 captures", [t for _, t in runs])
        )
        self._gate_ok(gate)
        self.base = runs[0]
        gate.checks.append(
            self.replay_check(
                f"trainer replays {runs[0][1].num_decisions} decisions", *runs[0], self.user_adapter
            )
        )

    def adapter_a(self, gate: Gate) -> None:
        adir = self.out / "adapters"
        # Bound to the ladder's lane (cpu or cuda): each half checks an adapter against the
        # lane it runs.
        lane = self.contract.fingerprint
        zero = make_adapter(
            self.model, adir / "zero", rank=self.rank, zero_b=True, seed=1, contract=lane
        )
        a = make_adapter(self.model, adir / "A", rank=self.rank, seed=2, contract=lane)
        self.adapter_a_dir = a
        per = max(1, self.decisions // len(self.prompts))
        n = len(self.prompts)
        base_dir, base = self.base
        zd, zt = self.capture("zero-adapter", adapter=zero, n_prompts=n, per_prompt=per)
        same = torch.equal(zt.sampled_tokens, base.sampled_tokens)
        c = self.check("sampler: zero adapter gives the base bytes", base.logprobs, zt.logprobs)
        c.passed = c.passed and same
        gate.checks.append(c)
        gate.checks.append(self.replay_check("trainer: zero adapter replays exactly", zd, zt, zero))
        self._gate_ok(gate)
        ad, at = self.capture("adapter-A", adapter=a, n_prompts=n, per_prompt=per)
        gate.checks.append(self.replay_check("trainer replays adapter A", ad, at, a))
        self._gate_ok(gate)
        key = self._control_key()
        pert = perturb_adapter(a, adir / "A-perturbed", key)
        pd, pt = self.capture("adapter-A-perturbed", adapter=pert, n_prompts=n, per_prompt=per)
        gate.checks.append(
            self.check(
                f"control: sampler on A + 2^-9 at {self._short(key)} vs trainer on A",
                pt.logprobs,
                self.replay(pd, adapter=a, control=True),
                expect_exact=False,
            )
        )
        gate.checks.append(
            self.check(
                f"control: sampler on A vs trainer on A + 2^-9 at {self._short(key)}",
                at.logprobs,
                self.replay(ad, adapter=pert, control=True),
                expect_exact=False,
            )
        )
        self.adapter_a_trace = ad

    @staticmethod
    def _short(key: str) -> str:
        """layers.0.mlp.experts.0.down_proj.lora_B from the PEFT key."""
        return key.removeprefix("base_model.model.model.").removesuffix(".weight")

    def _control_key(self) -> str:
        module = (
            "model.layers.0.mlp.experts.0.down_proj"
            if self.geom.is_moe
            else "model.layers.0.mlp.down_proj"
        )
        return f"base_model.model.{module}.lora_B.weight"

    def training(self, gate: Gate) -> None:
        hook = require_hook(self.pm, "lockstep_train_step", "trainer", "lockstep-megatron")
        outs = []
        for i in range(2):
            self.say(f"train step (run {i + 1} of 2)")
            self.free_device()
            outs.append(
                hook(
                    request=TrainRequest(
                        model_dir=self.model,
                        trace_dir=self.adapter_a_trace,
                        adapter_in=self.adapter_a_dir,
                        adapter_out=self.out / "adapters" / f"B-run{i}",
                        steps=1,
                        rank=self.rank,
                        seed=0,
                        backend=self.backend,
                    )
                )
            )
        a = load_adapter(self.adapter_a_dir, self.model_dir)
        b = [load_adapter(o.adapter_dir, self.model_dir) for o in outs]
        moved = sum(
            not same_bytes(b[0].modules[k][i], a.modules[k][i]) for k in a.modules for i in (0, 1)
        )
        total = 2 * len(a.modules)
        note = "a factor moves when any of its bytes changed"
        if self.layouts["trainer"] != {"tp": 1, "ep": 1}:
            note += "; the step ran at tp 1 ep 1 (training at other layouts is not built yet)"
        gate.checks.append(
            Check(f"adapter factors moved ({moved} of {total})", moved > 0, note=note)
        )
        repeat = all(
            same_bytes(b[0].modules[k][i], b[1].modules[k][i]) for k in b[0].modules for i in (0, 1)
        )
        gate.checks.append(
            Check(
                f"trainer is byte-repeatable ({total} factors, 2 runs)",
                repeat,
                note="two runs from the same inputs give the same adapter bytes",
            )
        )
        frozen = all(o.backbone_hash_before == o.backbone_hash_after for o in outs)
        gate.checks.append(
            Check("backbone hash unchanged", frozen, note=outs[0].backbone_hash_before)
        )
        self.adapter_b = outs[0].adapter_dir

    def adapter_b_join(self, gate: Gate) -> None:
        n, per = len(self.prompts), max(1, self.decisions // len(self.prompts))
        runs = [
            self.capture(f"adapter-B-r{i}", adapter=self.adapter_b, n_prompts=n, per_prompt=per)
            for i in range(3)
        ]
        gate.checks.append(
            self.stable("sampler bytes stable over 3 captures (B)", [t for _, t in runs])
        )
        self._gate_ok(gate)
        gate.checks.append(self.replay_check("trainer replays adapter B", *runs[0], self.adapter_b))

    def promotion(self, gate: Gate) -> None:
        n, per = len(self.prompts), max(1, self.decisions // len(self.prompts))
        d, t = self.capture(
            "promotion", adapter=self.adapter_b, n_prompts=n, per_prompt=per, seed=1234
        )
        c = self.replay_check(
            f"promotion: {t.num_decisions} fresh decisions, K3 = 0", d, t, self.adapter_b
        )
        c.passed = c.passed and c.k3_max == 0.0
        gate.checks.append(c)

    @staticmethod
    def _gate_ok(gate: Gate) -> None:
        if not all(c.passed for c in gate.checks):
            raise GateFailed()

    def first_failure(self, gate: Gate) -> Check | None:
        return next((c for c in gate.checks if not c.passed), None)

    def run(self, engines: list[dict]) -> Report:
        t0 = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        report = Report(
            model=str(self.model),
            adapter=str(self.user_adapter or "") or None,
            contract=self.contract.fingerprint,
            lane=self.contract.lane,
            engines=engines,
            backend=self.backend,
            device=device_name(self.backend),
            layouts=self.layouts,
        )
        if self.sampler is not None:
            report.sampler = self.sampler.engine
            report.notes.append(
                f"sampler stages ran in a {self.sampler.engine} process ({self.sampler.python}); "
                "a failed gate's first-divergence search (bisect) is not available there"
            )
        self.admit_halves()
        plan = [("base ruler", self.base_ruler)]
        if self.user_adapter is None:
            plan += [
                ("adapter A join", self.adapter_a),
                ("training gate", self.training),
                ("adapter B join", self.adapter_b_join),
                ("promotion", self.promotion),
            ]
        for name, step in plan:
            gate = Gate(name)
            report.gates.append(gate)
            self.say(f"== gate: {name}")
            g0 = time.perf_counter()
            try:
                step(gate)
                gate.passed = all(c.passed for c in gate.checks)
            except GateFailed:
                gate.passed = False
            except Exception as err:  # a hook's refusal is a failed gate, reported by name
                gate.passed = False
                gate.error = f"{type(err).__name__}: {err}"
            gate.seconds = time.perf_counter() - g0
            if not gate.passed:
                self._bisect(gate)
                break
        report.passed = all(g.passed for g in report.gates) and len(report.gates) == len(plan)
        report.seconds = time.perf_counter() - t0
        return report

    def _bisect(self, gate: Gate) -> None:
        """Name the first differing op site: at the first differing decision of the failed
        check, or at decision 0 of the trace a refused replay was given."""
        failed = self.first_failure(gate)
        if failed is not None and failed.first_difference is not None and failed.trace:
            trace, adapter, index = Path(failed.trace), failed.adapter, failed.first_difference
        elif gate.error and getattr(self, "_last", None):
            trace, adapter, index = self._last[0], self._last[1], 0
        else:
            return
        if self.sampler is not None:
            gate.bisect = {
                "error": f"the first-divergence search needs the sampler's op-site dump, which "
                f"the {self.sampler.engine} sampler process does not give; not run "
                f"(decision {index} of {trace.name})"
            }
            return
        if self.backend != "cpu":  # the halves' op-site dumps are taken on cpu only
            gate.bisect = {
                "error": "the first-divergence search dumps op sites on cpu only; "
                f"not run for this {self.backend} ladder (decision {index} of {trace.name})"
            }
            return

        try:
            self.say(f"bisect decision {index} of {trace.name}")
            div, missing = bisect(
                self.pm,
                trace,
                index,
                self.model,
                Path(adapter) if adapter else None,
                sampler_model=self.sampler_model,
            )
            gate.bisect = {
                "trace": trace.name,
                "decision": index,
                "divergence": div.as_dict() if div else None,
                "one_sided_sites": missing,
            }
        except Exception as err:
            gate.bisect = {"error": f"{type(err).__name__}: {err}"}
