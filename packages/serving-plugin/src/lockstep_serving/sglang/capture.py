"""Capture with SGLang: sample with a real SGLang engine on the exact lane, record a Trace.

The backend is the engine's device: ``backend="cpu"`` starts SGLang's CPU engine (0.5.21 on
the CPU machines), ``backend="cuda"`` a CUDA one (0.5.17 on the GPU machine, eager: no CUDA
graphs); the lane model runs that backend's programs and contract (``model``).

The same trace as the vLLM capture (``capture.py``): the prompts' token ids, one seed per
prompt (``seed + i``), exactly ``decisions`` tokens per prompt (EOS ignored), the raw FP32
logprob SGLang reported for every sampled token, the contract the engine's lane actually ran,
and the rule that drew the tokens, so Megatron replays it and checks every token.

Prompts are tokenized here with the model directory's tokenizer (as vLLM does: special tokens
added by the tokenizer's own rule) and handed to SGLang as token ids, so the trace records
exactly what the engine saw. SGLang's scheduler runs in its own process; the lane model there
keeps its invoked contract in a file (``model.REPORT_ENV``) which the capture reads
after the last request.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from lockstep_exact.contract import contract_from_json
from lockstep_exact.lanes.ops import check_invoked, check_kernels
from lockstep_exact.model import ModelDir
from lockstep_exact.trace import SamplingSettings, Trace

from .. import __version__
from ..common.capture import TOKENIZERS, adapter_hash
from ..common.errors import LaneRefused
from . import patches
from .model import CONTRACT_OVERRIDE, REPORT_ENV, architecture_for


def _refuse(msg: str):
    raise LaneRefused(f"Lockstep exact lane refused to start: {msg}")


BACKENDS = ("cpu", "cuda")


def isolate(root: Path, backend: str = "cpu") -> None:
    """Environment for an SGLang engine on ``backend`` whose caches live under ``root`` (set
    before the engine starts: its processes inherit it). SGLang's CPU engine is chosen by
    ``SGLANG_USE_CPU_ENGINE=1``; a cuda engine must not see it."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1" if backend == "cpu" else "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HOME", str(root / "hf"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))


# SGLang's LoRA settings for a lane engine that loads adapters as it goes
# (``SglangLane.load_adapter``). SGLang asks for a rank bound and target modules when no
# adapter is given at start; the lane's LoRA manager replaces the pool they size, so they bound
# nothing: every adapter is checked against the model itself (``adapters.load_adapter``).
LORA_ARGS = {
    "enable_lora": True,
    "max_lora_rank": 64,
    "lora_target_modules": ["all"],
    "max_loras_per_batch": 4,
}


# Per backend: the engine's device and how much of its memory SGLang may hold (on cuda the
# KV pool is bounded by max_total_tokens anyway; 0.3 is what started on the H200).
DEVICE_ARGS = {
    "cpu": {"device": "cpu", "mem_fraction_static": 0.05},
    "cuda": {"device": "cuda", "mem_fraction_static": 0.3},
}


def engine_args(
    model_dir, *, contract: str | None = None, backend: str = "cpu", **overrides
) -> dict:
    """Keyword arguments for ``sglang.Engine`` that serve ``model_dir`` on the exact lane's
    ``backend`` (``**LORA_ARGS`` among the overrides turns SGLang's per-request LoRA on)."""
    if backend not in DEVICE_ARGS:
        _refuse(f"backend {backend!r}: the SGLang lane serves the {BACKENDS} lanes only")
    override = {"architectures": [architecture_for(model_dir)]}
    if contract is not None:
        override[CONTRACT_OVERRIDE] = contract
    args = {
        "model_path": str(model_dir),
        "json_model_override_args": json.dumps(override),
        "attention_backend": "torch_native",  # the lane attends itself (model.py)
        "sampling_backend": "pytorch",  # the lane's sampler is registered under this name
        "disable_cuda_graph": True,  # the lane's forward reads the batch on the host
        "dtype": "bfloat16",
        **DEVICE_ARGS[backend],
        "max_total_tokens": 4096,
        "grammar_backend": "none",
        "skip_server_warmup": True,
        "random_seed": 0,
        "log_level": "error",
    }
    args.update(overrides)
    return args


def sampling_params(n: int, decisions: int, seed: int, temperature: float, top_p: float):
    """One SGLang sampling-parameter dict per prompt: seed ``seed + i``, ``decisions`` tokens."""
    return [
        {
            "max_new_tokens": decisions,
            "temperature": float(temperature),
            "top_p": float(top_p),
            "ignore_eos": True,
            "sampling_seed": seed + i,
        }
        for i in range(n)
    ]


def tokenize(model: ModelDir, prompts) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model.path))
    return [list(tok(p)["input_ids"]) for p in prompts]


def sampled(out: dict) -> tuple[list[int], list[float]]:
    """Token ids and their logprobs from one SGLang generate result (return_logprob=True)."""
    ids = list(out["output_ids"])
    pairs = out["meta_info"]["output_token_logprobs"]
    if len(pairs) != len(ids) or any(int(p[1]) != t for p, t in zip(pairs, ids, strict=True)):
        raise RuntimeError("SGLang's output_token_logprobs do not match its output_ids")
    return ids, [float(p[0]) for p in pairs]


def invoked_contract(report: Path):
    """The contract the engine's lane actually ran, checked against the one it was started
    with (a site run with another program, or one the contract lacks, is refused)."""
    if not report.is_file():
        raise LaneRefused(
            "Lockstep exact lane: SGLang served the requests but no lane model reported what it "
            "ran: the engine did not run the lane's model (json_model_override_args?)"
        )
    body = json.loads(report.read_text())
    if body.get("samples", 0) < 1:
        raise LaneRefused("Lockstep exact lane: the lane's sampler never ran in the engine")
    declared = contract_from_json(body["declared"])
    invoked = contract_from_json(body["invoked"])
    check_invoked(declared, invoked, "the SGLang lane")
    check_kernels(invoked, "the SGLang lane")  # each site's kernels recorded and gated
    return invoked


def check_backend(backend: str) -> None:
    """cpu runs on SGLang's CPU engine; cuda needs a CUDA device (SGLang 0.5.17 on the GPU)."""
    if backend not in BACKENDS:
        _refuse(f"backend {backend!r}: the SGLang lane serves the {BACKENDS} lanes only")
    if backend == "cuda" and not torch.cuda.is_available():
        _refuse("backend 'cuda': no CUDA device here (SGLang 0.5.17 on a GPU serves the cuda lane)")


def preflight(request) -> ModelDir:
    """What is refused before any engine starts, naming it."""
    check_backend(request.backend)
    model = ModelDir(request.model_dir)  # refuses, naming it, what the lane cannot run
    if not any((model.path / f).is_file() for f in TOKENIZERS):
        _refuse(
            f"{model.path} has no tokenizer ({', '.join(TOKENIZERS)}): copy the tokenizer "
            "files the model was trained with next to its config.json"
        )
    if getattr(request, "tp", 1) != 1:
        _refuse(f"--tp {request.tp}: the SGLang lane runs on one process (no parallelism yet)")
    if request.adapter_dir is not None:
        # Checked here too, so that a bad adapter is named before an engine starts.
        adapter_hash(request.adapter_dir, model.path, request.backend)
    architecture_for(model.path)
    patches.check()
    return model


class SglangLane:
    """One SGLang engine serving a model on the exact lane's ``backend`` (cpu: SGLang's CPU
    engine, cuda: a GPU), for several captures (tests compare captures of one engine: a
    radix-cache hit against a miss, alone against batched).
    """

    def __init__(
        self, model: ModelDir, *, contract: str | None = None, backend: str = "cpu", **options
    ):
        check_backend(backend)
        import sglang

        self.model = model
        self.backend = backend
        self.version = sglang.__version__
        self.work = Path(tempfile.mkdtemp(prefix="lockstep-sglang-"))
        isolate(self.work, backend)
        self.report = self.work / "report.json"
        self.adapters: dict[str, Path] = {}  # loaded adapter name -> directory
        os.environ[REPORT_ENV] = str(self.report)
        try:
            self.engine = sglang.Engine(
                **engine_args(model.path, contract=contract, backend=backend, **options)
            )
        finally:
            os.environ.pop(REPORT_ENV, None)  # the engine's processes have their copy

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def load_adapter(self, adapter_dir, name: str | None = None) -> str:
        """Load a PEFT adapter directory into the engine (started with ``**LORA_ARGS``) through
        the lane's checks; its name for ``capture(adapter=...)``. A refusal names its reason."""
        path = Path(adapter_dir).resolve()
        name = name or f"lockstep-{path.name}"
        out = self.engine.load_lora_adapter(name, str(path))
        if not out.success:
            raise LaneRefused(out.error_message or f"SGLang did not load adapter {name}")
        self.adapters[name] = path
        return name

    def flush_cache(self) -> None:
        """Empty SGLang's radix cache (the next requests miss)."""
        if not self.engine.flush_cache().success:
            raise RuntimeError("SGLang refused to flush its radix cache (requests in flight?)")

    def generate(self, ids, params, *, batch: bool = True, adapters=None) -> list[dict]:
        """``adapters``: one loaded adapter name (or None, the base model) per request."""
        loras = list(adapters) if adapters is not None else [None] * len(ids)
        if batch:
            lora = loras if any(a is not None for a in loras) else None
            return self.engine.generate(
                input_ids=ids, sampling_params=params, return_logprob=True, lora_path=lora
            )
        return [
            self.engine.generate(input_ids=i, sampling_params=sp, return_logprob=True, lora_path=a)
            for i, sp, a in zip(ids, params, loras, strict=True)
        ]

    def capture(
        self,
        prompts,
        decisions: int,
        *,
        seed: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        batch: bool = True,
        adapter: str | None = None,
    ) -> tuple[Trace, list[int]]:
        """The trace of one generate call, and SGLang's cached prompt tokens per sequence.
        ``adapter``: a loaded adapter's name (``load_adapter``), run by every request."""
        prompts = list(prompts)
        ids = tokenize(self.model, prompts)
        params = sampling_params(len(prompts), decisions, seed, temperature, top_p)
        hash_ = None
        if adapter is not None:
            if adapter not in self.adapters:
                raise LaneRefused(f"adapter {adapter!r} was not loaded by this lane (load_adapter)")
            hash_ = adapter_hash(self.adapters[adapter], self.model.path, self.backend)
        outs = self.generate(ids, params, batch=batch, adapters=[adapter] * len(ids))
        invoked = invoked_contract(self.report)
        if invoked.backend != self.backend:
            raise LaneRefused(
                f"the engine ran the {invoked.backend} lane but backend {self.backend!r} was "
                "asked for (the lane's backend is the engine's device)"
            )
        tokens, logprobs = zip(*(sampled(o) for o in outs), strict=True)
        trace = Trace.from_sequences(
            ids,
            [list(t) for t in tokens],
            # Python floats holding the engine's float32 values; the trace refuses any that is
            # not exactly a float32 (nothing is rounded on the way).
            [list(lp) for lp in logprobs],
            contract_fingerprint=invoked.fingerprint,
            contract=invoked.to_json(),
            model_hash=self.model.model_hash,
            adapter_hash=hash_,
            sampling=SamplingSettings(
                # SGLang treats a temperature below 1e-6 as greedy (top_k=1): the rule gets 0.
                temperature=float(temperature),
                top_p=float(top_p),
                seed=seed,
                seeds=tuple(sp["sampling_seed"] for sp in params),
                rule=invoked.sites["sample"].ident,
            ),
            engine={
                "name": "sglang",
                "version": self.version,
                "plugin": f"lockstep-serving {__version__}",
                "logprobs": "raw (lane sampler)",
                "batch": batch,
                "tp": 1,
            },
            prompt_texts=prompts,
        )
        cached = [int(o["meta_info"].get("cached_tokens", 0)) for o in outs]
        return trace, cached


def capture(request) -> Trace:
    model = preflight(request)
    options = dict(request.options)
    if request.adapter_dir is not None:
        options = {**LORA_ARGS, **options}
    with SglangLane(model, contract=request.contract, backend=request.backend, **options) as lane:
        adapter = lane.load_adapter(request.adapter_dir) if request.adapter_dir else None
        trace, _ = lane.capture(
            request.prompts,
            request.decisions,
            seed=request.seed,
            temperature=request.temperature,
            top_p=request.top_p,
            batch=request.batch,
            adapter=adapter,
        )
    if request.out_dir is not None:
        trace.save(request.out_dir)
    return trace
