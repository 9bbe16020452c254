"""The ``lockstep`` command line. It drives engine plugins through the pluggy hooks only.

``qualify``, ``capture``, ``replay``, ``bisect``, ``train``, ``verify`` and ``doctor`` are quiet:
while the engines work (or, for ``doctor``, are imported and asked what they serve), their
output (vLLM's warnings, C++ prints, megatron-core's and torch's warnings) goes to a log file
(``quiet.engine_output``) and only the command's progress and results reach the terminal; the
last line names the log. ``--verbose`` streams the engine output to the terminal as well.

Parsing and ``--help`` import no torch: the modules that load it (the models, the ladder, the
trainer's loop) are imported inside the command that uses them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from .. import __version__, plugins
from ..plugins import MissingHalf, require_hook
from ..requests import CaptureRequest, ReplayRequest, ServeRequest, VerifyRequest
from .quiet import engine_output
from .textfile import read_lines

QUIET_COMMANDS = ("qualify", "capture", "replay", "bisect", "train", "doctor", "verify")


def _engine_log(args) -> Path:
    """Where a command's engine output goes: ``--log``, else in or beside its output."""
    if args.log:
        return Path(args.log)
    if args.command == "doctor":  # it writes nothing else: a new file in the temp directory
        fd, name = tempfile.mkstemp(prefix="lockstep-doctor-", suffix=".log")
        os.close(fd)
        return Path(name)
    if args.command in ("qualify", "train"):
        return Path(args.out) / "engine.log"
    if args.command == "capture":  # the trace directory is written whole: the log goes beside
        return _beside(Path(args.out), ".log")
    if args.command == "replay" and args.out:
        return _beside(Path(args.out), ".log")
    if args.command == "verify":
        return _beside(Path(args.rollouts), ".verify.log")
    return _beside(Path(args.trace), f".{args.command}.log")


def _beside(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _engines(args):
    """The context that sends engine output to the command's log (``--verbose``: and here)."""
    args.engine_log = _engine_log(args)
    return engine_output(args.engine_log, verbose=args.verbose)


def _only_engine(pm, hook_name: str, engine: str, package: str):
    """``hook_name``'s caller restricted to the plugin registered under the entry-point name
    ``engine`` (``vllm``, ``sglang``), or MissingHalf naming the installed ones."""
    impls = getattr(pm.hook, hook_name).get_hookimpls()
    names = sorted({pm.get_name(i.plugin) for i in impls})
    if engine not in names:
        raise MissingHalf(
            f"no installed plugin named {engine!r} answers {hook_name} (installed: "
            f"{', '.join(names) or 'none'}); install {package}"
        )
    others = [i.plugin for i in impls if pm.get_name(i.plugin) != engine]
    return pm.subset_hook_caller(hook_name, remove_plugins=others)


def _drive(args, hook_name: str, half: str, package: str, message: str, request, engine=None):
    """Call one plugin hook with the engine output sent to the command's log. ``engine``:
    only the plugin of that entry-point name answers (None: every installed one)."""
    pm = plugins.manager()
    hook = require_hook(pm, hook_name, half, package)
    if engine is not None:
        hook = _only_engine(pm, hook_name, engine, package)
    with _engines(args) as console:
        console.say(message)
        result = hook(request=request)
    if result is None and engine is not None:
        raise MissingHalf(
            f"the {engine!r} plugin did not answer {hook_name}: {engine} is not installed in "
            f"this environment; install {package}"
        )
    return result


# `lockstep tiny`'s integer options, each make_tiny's argument of the same name (with "_").
TINY_INT_OPTIONS = (
    "seed",
    "hidden",
    "layers",
    "heads",
    "kv-heads",
    "head-dim",
    "intermediate",
    "vocab",
    "experts",
    "topk",
    "moe-intermediate",
    "linear-key-heads",
    "linear-value-heads",
    "full-attention-interval",
)


def _cmd_tiny(args) -> int:
    from ..model import ModelDir
    from .tiny import make_tiny

    kw = {
        k: getattr(args, k)
        for k in (name.replace("-", "_") for name in TINY_INT_OPTIONS)
        if getattr(args, k) is not None
    }
    out = make_tiny(args.out, arch=args.arch, **kw)

    print(f"wrote {args.arch} model to {out}")
    print(f"contract {ModelDir(out, hybrid=True).contract().fingerprint}")
    return 0


def _cmd_contract_show(args) -> int:
    from ..model import ModelDir

    if args.json and (args.adapter or args.model_hash):
        raise ValueError(
            "--json prints the contract's canonical JSON only: drop --adapter and "
            "--model-hash, or --json"
        )
    model = ModelDir(args.model, hybrid=True)
    contract = model.contract(args.backend)
    if args.json:
        print(json.dumps(contract.to_json(), indent=2, sort_keys=True))
        return 0
    print(f"lane         {contract.lane}")
    print(f"fingerprint  {contract.fingerprint}")
    print(f"pins         {', '.join(f'{k}={v}' for k, v in sorted(contract.pins.items()))}")
    geom = ", ".join(f"{k}={v}" for k, v in contract.geometry.items() if v not in (0, ""))
    print(f"geometry     {geom}")
    if args.model_hash or args.adapter:  # reads every weight file
        print(f"model hash   {model.model_hash}")
    if args.adapter:
        _show_adapter(args.adapter, model, contract.fingerprint)
    print("op sites")
    width = max(map(len, contract.sites))
    for site in sorted(contract.sites):
        print(f"  {site:<{width}}  {contract.sites[site].ident}")
    return 0


def _show_adapter(adapter_dir, model, fingerprint: str) -> None:
    """The hashes adapter refusals name: the adapter's own (traces record it), the contract
    and base model a Lockstep export was made for, each beside this model's and lane's."""
    from ..adapters import adapter_record

    rec = adapter_record(adapter_dir)

    def versus(recorded, mine):
        if recorded is None:
            return "none recorded (not a Lockstep export)"
        return f"{recorded} ({'this' if recorded == mine else 'NOT this'} one)"

    print(f"adapter      {adapter_dir}")
    print(f"adapter hash {rec['sha256']}")
    if rec["recorded_sha256"] not in (None, rec["sha256"]):
        print(f"  recorded   {rec['recorded_sha256']} (DIFFERS: the files were edited)")
    print(f"  for lane   {versus(rec['contract'], fingerprint)}")
    print(f"  for model  {versus(rec['model_hash'], model.model_hash)}")


def _cmd_doctor(args) -> int:
    with _engines(args) as console:  # importing the engines warns (megatron-core, torch)
        rc = _doctor(args, console.say)
    print(f"engine log: {args.engine_log}")
    return rc


def _doctor(args, say) -> int:
    import torch

    from ..model import ModelDir
    from .tiny import make_tiny

    say(f"lockstep-exact {__version__}  python {sys.version.split()[0]}  torch {torch.__version__}")
    backends = ["cpu"]
    if torch.cuda.is_available():
        backends.append(f"cuda ({torch.cuda.get_device_name()})")
    say(f"backends      {', '.join(backends)}")
    pm = plugins.manager()
    infos = [i for i in pm.hook.lockstep_engine_info() if i is not None]
    roles = {}
    if not infos:
        say("plugins       none installed (install lockstep-serving and lockstep-megatron)")
    for info in sorted(infos, key=lambda i: i.role):
        roles[info.role] = info
        state = "ok" if info.problem is None else f"UNUSABLE: {info.problem}"
        say(
            f"plugin        {info.plugin} ({info.role}): {info.engine} {info.engine_version}, "
            f"plugin {info.plugin_version}, backends {','.join(info.backends)}: {state}"
        )
    for half in ("sampler", "trainer"):
        if half not in roles:
            say(f"missing       no {half} plugin is installed")
    models = [Path(args.model)] if args.model else None
    with tempfile.TemporaryDirectory() as tmp:
        if models is None:
            models = [make_tiny(Path(tmp) / a, arch=a) for a in ("qwen3", "qwen3-moe")]
        refused = []
        for model in models:
            # A Qwen3-Next model is admitted here; each half's own hook says if it serves it.
            contract = ModelDir(model, hybrid=True).contract()
            line = f"contract      {contract.lane}: {contract.fingerprint}"
            for name, hook in (
                ("sampler", pm.hook.lockstep_sampler_contract),
                ("trainer", pm.hook.lockstep_trainer_contract),
            ):
                if not hook.get_hookimpls():
                    continue
                try:
                    theirs = hook(model_dir=model, adapter_dir=None, backend="cpu")
                except (ValueError, RuntimeError) as err:
                    refused.append(f"refused       the {name} half refuses {model}: {err}")
                    line += f"  {name}=REFUSED"
                    continue
                same = theirs is not None and theirs.fingerprint == contract.fingerprint
                line += f"  {name}={'same' if same else 'DIFFERENT'}"
            say(line)
        for why in refused:
            say(why)
    problems = [i for i in infos if i.problem] or len(roles) < 2 or refused
    return 1 if problems else 0


def _cmd_capture(args) -> int:
    from .tiny import default_prompts

    # Refused before the engine starts (as train refuses the same values).
    if args.decisions < 1:
        raise ValueError(f"--decisions must be an int >= 1, got {args.decisions}")
    prompts = (
        tuple(read_lines(args.prompts, "--prompts")) if args.prompts else tuple(default_prompts(8))
    )
    prompts = tuple(p for p in prompts if p.strip())
    if not prompts:
        raise ValueError(
            f"--prompts {args.prompts} holds no prompts (one prompt per line; blank lines are "
            "skipped)"
        )
    if Path(args.out).exists():
        raise ValueError(
            f"--out {args.out} exists: a capture writes a new trace and never replaces one; "
            "choose another --out (or remove that one first)"
        )
    options = {}
    if args.cuda_graphs:
        if args.backend != "cuda" or args.engine == "sglang":
            raise ValueError(
                "--cuda-graphs captures the vLLM lane's decode steps on a GPU: it needs "
                "--backend cuda and the vLLM sampler"
            )
        options["cuda_graphs"] = True  # offline.engine_args: full graphs for decode steps
    trace = _drive(
        args,
        "lockstep_capture",
        "sampler",
        "lockstep-serving",
        f"capturing {args.decisions} decisions per prompt from {len(prompts)} prompts",
        CaptureRequest(
            model_dir=Path(args.model),
            adapter_dir=Path(args.adapter) if args.adapter else None,
            prompts=prompts,
            decisions=args.decisions,
            out_dir=Path(args.out),
            seed=args.seed,
            tp=args.tp,
            backend=args.backend,
            options=options,
        ),
        engine=args.engine,
    )
    print(f"captured {trace.num_decisions} decisions from {len(prompts)} prompts -> {args.out}")
    print(f"engine log: {args.engine_log}")
    return 0


def _cmd_replay(args) -> int:
    import torch

    from ..k3 import compare
    from ..trace import Trace

    trace = Trace.load(args.trace)
    result = _drive(
        args,
        "lockstep_replay",
        "trainer",
        "lockstep-megatron",
        f"replaying {trace.num_decisions} decisions in the trainer",
        ReplayRequest(
            model_dir=Path(args.model),
            trace_dir=Path(args.trace),
            adapter_dir=Path(args.adapter) if args.adapter else None,
            tp=args.tp,
            ep=args.ep,
            backend=args.backend,
        ),
    )
    cmp = compare(torch.as_tensor(trace.logprobs), result.logprobs)
    report = {
        "trace": str(args.trace),
        "decisions": cmp.n,
        "byte_equal": cmp.byte_equal,
        "first_difference": cmp.first_diff,
        "k3_max": cmp.k3_max,
        "k3_mean": cmp.k3_mean,
        "max_ulp": cmp.max_ulp,
        "trainer": result.engine,
        "seconds": result.seconds,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    verdict = "EXACT" if cmp.byte_equal == cmp.n else "NOT EXACT"
    print(
        f"{verdict}: {cmp.byte_equal}/{cmp.n} decisions byte-equal, K3 max {cmp.k3_max:.3g}"
        + ("" if cmp.first_diff is None else f", first difference at decision {cmp.first_diff}")
    )
    print(f"engine log: {args.engine_log}")
    return 0 if cmp.byte_equal == cmp.n else 1


def _server_url(extra: list[str]) -> str:
    """Where the server will answer, from vLLM's --host / --port flags (its defaults else)."""
    found = {"--host": "127.0.0.1", "--port": "8000"}
    for i, arg in enumerate(extra):
        name, eq, value = arg.partition("=")
        if name in found:
            if eq:
                found[name] = value
            elif i + 1 < len(extra):
                found[name] = extra[i + 1]
    host = found["--host"]
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return f"http://{host}:{found['--port']}"


def _cmd_serve(args) -> int:
    pm = plugins.manager()
    require_hook(pm, "lockstep_serve_command", "sampler", "lockstep-serving[vllm]")
    hook = _only_engine(pm, "lockstep_serve_command", "vllm", "lockstep-serving[vllm]")
    if args.backend:
        backend = args.backend
    else:
        import torch

        backend = "cuda" if torch.cuda.is_available() else "cpu"
    request = ServeRequest(Path(args.model), backend, tuple(args.extra), args.contract)
    argv, env = hook(request=request)
    if args.print:
        print(shlex.join(argv))
        return 0
    url = _server_url(args.extra)
    log = Path(args.log or "lockstep-serve.log")
    print(f"starting vLLM's OpenAI server on the exact lane ({backend}); engine log: {log}")
    with open(log, "w") as f:
        out = None if args.verbose else f
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)

    def _stop(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)  # a supervisor's stop ends the server too
    try:
        while True:
            if proc.poll() is not None:
                print(
                    f"lockstep serve: error: the server exited with code {proc.returncode} "
                    f"before it answered; see {log}",
                    file=sys.stderr,
                )
                return 1
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(1.0)
        print(f"serving {args.model} at {url}/v1 (the lane's contract: {url}/lockstep/contract)")
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        return 0


def _cmd_verify(args) -> int:
    request = VerifyRequest(
        model_dir=Path(args.model),
        rollouts=Path(args.rollouts),
        adapter_dir=Path(args.adapter) if args.adapter else None,
        backend=args.backend,
    )
    report = _drive(
        args,
        "lockstep_verify",
        "trainer",
        "lockstep-megatron",
        f"recomputing the sampled tokens of {args.rollouts} in the trainer",
        request,
    )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    n, equal = report["decisions"], report["byte_equal"]
    verdict = "EXACT" if report["equal"] else "NOT EXACT"
    line = (
        f"{verdict}: {equal}/{n} sampled log-probabilities byte-equal over "
        f"{report['sequences']} sequences, K3 max {report['k3_max']:.3g}"
    )
    first = report["first_difference"]
    if first is not None:
        line += (
            f"; first difference: sequence {first['sequence']}, position {first['position']} "
            f"(sampler {first['sampler']!r}, trainer {first['trainer']!r})"
        )
    print(line)
    print(f"engine log: {args.engine_log}")
    return 0 if report["equal"] else 1


def _cmd_qualify(args) -> int:
    from . import report as report_mod
    from .qualify import Ladder, check_backend
    from .tiny import make_tiny

    # cuda where torch sees no device is refused here, before a model is made or read
    check_backend(args.backend, args.trainer_tp, args.trainer_ep)
    python = _sampler_python(args)
    out = Path(args.out)
    t0 = time.perf_counter()
    with _engines(args) as console, _sampler_process(args, python) as sampler:

        def say(msg: str) -> None:
            console.say(f"[{time.perf_counter() - t0:7.1f}s] {msg}")

        if args.model:
            model = Path(args.model)
        else:
            model = out / f"tiny-{args.tiny}"
            say(f"making tiny {args.tiny} model in {model}")
            make_tiny(model, arch=args.tiny, seed=args.seed)
        pm = plugins.manager()
        engines = [vars(i) for i in pm.hook.lockstep_engine_info() if i is not None]
        if sampler is not None:  # the sampler half is the process's engine, not this one's
            say(f"sampler: {args.sampler} in {python}")
            engines = [sampler.info()] + [e for e in engines if e.get("role") != "sampler"]
        ladder = Ladder(
            pm,
            model,
            out,
            decisions=args.decisions,
            adapter_dir=Path(args.adapter) if args.adapter else None,
            progress=say,
            sampler_model=Path(args.sampler_model) if args.sampler_model else None,
            sampler_tp=args.sampler_tp,
            trainer_tp=args.trainer_tp,
            trainer_ep=args.trainer_ep,
            backend=args.backend,
            sampler=sampler,
        )
        rep = ladder.run(engines)
    jpath, hpath = report_mod.write(rep, out)
    print()
    print(report_mod.table(rep))
    for note in rep.notes:
        print(f"note: {note}")
    print(f"report: {hpath} (and {jpath.name})")
    print(f"engine log: {args.engine_log}")
    return 0 if rep.passed else 1


def _sampler_python(args) -> Path | None:
    """``--sampler sglang``: its environment's python (refused, naming where it looked, when
    there is none) and the settings its lane cannot run, before anything starts. The backend
    is the ladder's: cpu runs SGLang's CPU engine (0.5.21), cuda its GPU engine (0.5.17)."""
    if args.sampler == "vllm":
        if args.sampler_python:
            raise ValueError("--sampler-python is for a sampler in another environment (sglang)")
        return None

    if args.sampler_tp != 1:
        raise ValueError(f"--sampler {args.sampler} runs on one process: --sampler-tp 1")
    from .sampler_process import sampler_python

    return sampler_python(args.sampler, args.sampler_python)


def _sampler_process(args, python):
    """The sampler process of ``--sampler sglang`` (its output goes to the engine log), or a
    context that gives None (the installed sampler plugin, in this process)."""
    if python is None:
        return contextlib.nullcontext()
    from .sampler_process import SamplerProcess

    return SamplerProcess(args.sampler, python)


class _Bar:
    """``lockstep train``'s progress: on a terminal, one bar line redrawn in place (step,
    reward (sft: loss), K3 max, step time); elsewhere (a pipe, a log, CI), one line per
    step."""

    def __init__(self, console, t0: float):
        self.console, self.t0 = console, t0
        stream = console.stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.total, self.done, self.live = 0, 0, False

    def _clear(self) -> None:
        if self.live:
            self.console.stream.write("\r\033[K")
            self.live = False

    def say(self, message: str) -> None:
        self._clear()
        self.console.say(f"[{time.perf_counter() - self.t0:7.1f}s] {message}")

    def start(self, total: int, done: int) -> None:
        self.total, self.done = total, done
        if done:
            self.say(f"resuming after step {done} of {total}")

    def step(self, row: dict, total: int) -> None:
        from .train_loop import step_line

        self.done = row["step"]
        if not self.tty:
            self.say(step_line(row, total))
            return
        width = 24
        filled = round(width * self.done / max(total, 1))
        bar = "#" * filled + "." * (width - filled)
        self.console.stream.write(
            f"\r\033[K[{bar}] step {self.done}/{total}  {_objective(row)}  "
            f"K3 max {row['k3_max']:g}  equal {row['equal']}/{row['decisions']}  "
            f"{row['seconds']:.1f}s/step"
        )
        self.console.stream.flush()
        self.live = True

    def close(self) -> None:
        if self.live:
            self.console.stream.write("\n")
            self.console.stream.flush()
            self.live = False


def _objective(row: dict) -> str:
    """What a step optimized: GRPO and OPD a reward, SFT a loss (the reward of its sampled
    probe is in metrics.jsonl, not shown as if it were trained for)."""
    if row.get("algo") == "sft":
        return f"loss {row['loss']:+.4f}"
    return f"reward {row['reward_mean']:.3f}"


def _trained_line(rows: list[dict], algo: str) -> str:
    if algo == "sft":
        moved = f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}"
    else:
        moved = f"reward {rows[0]['reward_mean']:.3f} -> {rows[-1]['reward_mean']:.3f}"
    exact = all(r["equal"] == r["decisions"] for r in rows)
    return f"trained {len(rows)} steps ({algo}): {moved}; every decision byte-equal: {exact}"


def _cmd_train(args) -> int:
    from .train_loop import Progress, TrainConfig, TrainStopped, prepare_train

    config = TrainConfig(
        algo=args.algo,
        steps=args.steps,
        group=args.group,
        prompts=args.prompts,
        decisions=args.decisions,
        lr=args.lr,
        inner_steps=args.inner_steps,
        micro_batch=args.micro_batch,
        rank=args.rank,
        seed=args.seed,
        clip=args.clip,
        reference=args.reference,
        kl_coef=args.kl_coef,
        teacher=args.teacher,
        data=args.data,
        task=args.task,
        reward=args.reward,
        adapter=args.adapter,
        checkpoint_every=args.checkpoint_every,
        backend=args.backend,
        sampler_memory=args.sampler_memory,
    )
    config.check()  # before any engine starts
    out = Path(args.out)
    t0 = time.perf_counter()
    stopped = None
    # Refusals (the settings, the model, what --out holds) come before anything is written:
    # a refused run leaves --out, its engine log included, as it was.
    plan = prepare_train(plugins.manager(), Path(args.model), out, config, resume=args.resume)
    with plan.claim():
        if plan.complete:  # a resume with no step left: no engine starts, the log is kept
            plan.run(progress=Progress())  # says so; the report is rewritten
            print(f"report: {out / 'report.html'} (and metrics.jsonl)")
            return 0
        with _engines(args) as console:
            bar = _Bar(console, t0)
            try:
                rows = plan.run(progress=bar)
            except TrainStopped as err:
                stopped, rows = err, []
    if rows:
        print(_trained_line(rows, config.algo))
        print(f"adapter: {out / rows[-1]['adapter_out']}")
    print(f"report: {out / 'report.html'} (and metrics.jsonl)")
    print(f"engine log: {args.engine_log}")
    if stopped is not None:
        print(f"lockstep train: STOPPED: {stopped}", file=sys.stderr)
        return 1
    return 0


def _cmd_bisect(args) -> int:
    from .bisect import bisect

    with _engines(args) as console:
        console.say(f"bisecting decision {args.decision}: recording every op site on both halves")
        div, missing = bisect(
            plugins.manager(),
            Path(args.trace),
            args.decision,
            Path(args.model),
            Path(args.adapter) if args.adapter else None,
        )
    for site in missing:
        print(f"site present on one side only: {site}")
    if div is None:
        print(f"decision {args.decision}: every op site is byte-equal on both halves")
    else:
        print(f"decision {args.decision}: {div}")
    print(f"engine log: {args.engine_log}")
    return 0 if div is None else 1


class _DefaultsHelp(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one (not None or off) and the
    help does not already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            not action.option_strings
            or "default" in text
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockstep",
        description="Bit-exact trainer/sampler log-probabilities: make, check and replay lanes.",
    )
    parser.add_argument("--version", action="version", version=f"lockstep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser(
        "tiny", help="write a tiny HF-format Qwen3 / Qwen3-MoE / Qwen3-Next model"
    )
    tiny.add_argument("--arch", choices=("qwen3", "qwen3-moe", "qwen3-next"), default="qwen3-moe")
    tiny.add_argument("--out", required=True)
    for name in TINY_INT_OPTIONS:
        tiny.add_argument(f"--{name}", type=int, dest=name.replace("-", "_"))
    tiny.set_defaults(func=_cmd_tiny)

    doctor = sub.add_parser("doctor", help="installed plugins, engines, backends, contracts")
    doctor.add_argument("--model", help="model directory (default: tiny models made on the fly)")
    doctor.set_defaults(func=_cmd_doctor)

    contract = sub.add_parser("contract", help="contract commands")
    csub = contract.add_subparsers(dest="contract_command", required=True)
    show = csub.add_parser("show", help="print a model's lane contract and fingerprint")
    show.add_argument("--model", required=True)
    show.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    show.add_argument("--adapter", help="also print this adapter's hash and what it was made for")
    show.add_argument(
        "--model-hash", action="store_true", help="also print the model hash (reads the weights)"
    )
    show.add_argument("--json", action="store_true", help="print the canonical JSON")
    show.set_defaults(func=_cmd_contract_show)

    cap = sub.add_parser("capture", help="sample with the serving plugin and write a trace")
    cap.add_argument("--model", required=True)
    cap.add_argument("--adapter")
    cap.add_argument("--prompts", help="a file with one prompt per line (default: 8 built in)")
    cap.add_argument("--decisions", type=int, default=8, help="sampled tokens per prompt")
    cap.add_argument("--seed", type=int, default=0)
    cap.add_argument("--out", required=True)
    cap.add_argument(
        "--tp", type=int, default=1, help="the sampler's tensor-parallel size (same bytes)"
    )
    cap.add_argument(
        "--backend", default="cpu", choices=("cpu", "cuda"), help="cuda: a CUDA vLLM (0.26.0)"
    )
    cap.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        help="the serving engine (default: the installed one; sglang needs the sglang "
        "environment, docs/sglang.md)",
    )
    cap.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="--backend cuda, vLLM: replay the lane's one-token decode steps from CUDA graphs "
        "(the eager bytes, faster; LoRA and --tp > 1 are refused with it)",
    )
    cap.set_defaults(func=_cmd_capture)

    rep = sub.add_parser("replay", help="recompute a trace's decisions in the trainer")
    rep.add_argument("--model", required=True)
    rep.add_argument("--adapter")
    rep.add_argument("--trace", required=True)
    rep.add_argument("--out", help="write the report as JSON here")
    rep.add_argument(
        "--tp", type=int, default=1, help="the trainer's tensor-parallel size (same bytes)"
    )
    rep.add_argument(
        "--ep", type=int, default=1, help="the trainer's expert-parallel size (same bytes)"
    )
    rep.add_argument(
        "--backend", default="cpu", choices=("cpu", "cuda"), help="cuda: Megatron on one GPU"
    )
    rep.set_defaults(func=_cmd_replay)

    srv = sub.add_parser(
        "serve",
        help="vLLM's OpenAI-compatible server on the exact lane",
        description="Start vLLM's OpenAI-compatible server on the exact lane. Arguments after "
        "'--' go to vLLM's server (--host, --port, --max-model-len, ...); flags that would "
        "take the lane's place (--dtype, --hf-overrides, compilation) are refused by name.",
    )
    srv.add_argument("--model", required=True, help="HF-format model folder")
    srv.add_argument(
        "--backend",
        choices=("cpu", "cuda"),
        default=None,
        help="the lane's backend (default: cuda when a GPU is visible, else cpu)",
    )
    srv.add_argument("--contract", help="a contract fingerprint the lane must match")
    srv.add_argument("--print", action="store_true", help="print the command, do not start it")
    srv.add_argument("--log", help="the server's output (default: lockstep-serve.log)")
    srv.add_argument("--verbose", action="store_true", help="the server's output on the terminal")
    srv.set_defaults(func=_cmd_serve, extra=[])

    ver = sub.add_parser(
        "verify",
        help="recompute a rollout file's sampled log-probabilities in the trainer",
        description="Recompute, in Megatron on the lane, the log-probability of every sampled "
        "token of a rollout file and compare bytes. Each line is either "
        '{"tokens": [...], "prompt_len": N, "logprobs": [...]} or {"prompt": [token ids], '
        '"response": <a /v1/completions answer asked with "logprobs": 0 and '
        '"return_tokens_as_token_ids": true>}. Exit 0: every value byte-equal; 1: a '
        "difference (the first is named); 2: bad input.",
    )
    ver.add_argument("--model", required=True, help="the model the sampler served")
    ver.add_argument("--rollouts", required=True, help="the JSONL of rollouts or responses")
    ver.add_argument("--adapter", help="the adapter the sampler served, if any")
    ver.add_argument("--out", help="write the report as JSON here")
    ver.add_argument(
        "--backend", default="cpu", choices=("cpu", "cuda"), help="cuda: Megatron on one GPU"
    )
    ver.set_defaults(func=_cmd_verify)

    qual = sub.add_parser("qualify", help="run the qualification ladder (the main job)")
    src = qual.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF model directory (default: a tiny model made now)")
    src.add_argument("--tiny", choices=("qwen3", "qwen3-moe", "qwen3-next"), default="qwen3-moe")
    qual.add_argument("--adapter", help="qualify this adapter (runs the base ruler on it)")
    qual.add_argument("--decisions", type=int, default=64)
    qual.add_argument("--seed", type=int, default=0, help="seed of the tiny model")
    qual.add_argument("--out", default="lockstep-qualify", help="report and traces go here")
    qual.add_argument("--sampler-model", help="debugging: the sampler reads this copy of --model")
    qual.add_argument("--sampler-tp", type=int, default=1, help="sampler's tensor-parallel size")
    qual.add_argument("--trainer-tp", type=int, default=1, help="trainer's tensor-parallel size")
    qual.add_argument("--trainer-ep", type=int, default=1, help="trainer's expert-parallel size")
    qual.add_argument(
        "--backend",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: both halves on the GPU (vLLM 0.26.0, Megatron on one GPU)",
    )
    qual.add_argument(
        "--sampler",
        default="vllm",
        choices=("vllm", "sglang"),
        help="the serving engine of the sampler stages (sglang: run in the SGLang environment's "
        "python, --sampler-python)",
    )
    qual.add_argument(
        "--sampler-python",
        help="--sampler sglang: that environment's python (default $LOCKSTEP_SGLANG_PYTHON, "
        "else .venv-sglang/bin/python)",
    )
    qual.set_defaults(func=_cmd_qualify)

    tr = sub.add_parser(
        "train", help="SFT, GRPO or on-policy distillation on a LoRA adapter, exact every step"
    )
    tr.add_argument("--model", required=True)
    tr.add_argument("--algo", default="grpo", help="grpo, opd or sft")
    tr.add_argument("--task", default="toy", help="the built-in reward when --reward is absent")
    tr.add_argument("--reward", help="MODULE:FUNCTION taking a Completion, or 'hook'")
    tr.add_argument("--data", help='JSONL rows {"prompt": ...} (sft: and "completion")')
    tr.add_argument("--teacher", help="opd: the teacher's model directory (same tokenizer)")
    tr.add_argument("--reference", action="store_true", help="k3 KL to the frozen base model")
    tr.add_argument(
        "--kl-coef", type=float, default=0.05, dest="kl_coef", help="--reference: the KL's weight"
    )
    tr.add_argument("--adapter", help="start from this adapter (e.g. the last of an SFT run)")
    tr.add_argument("--steps", type=int, default=10, help="training steps (--resume: in all)")
    tr.add_argument("--group", type=int, default=8, help="completions per prompt")
    tr.add_argument("--prompts", type=int, default=4, help="prompts (sft: examples) per step")
    tr.add_argument("--decisions", type=int, default=8, help="sampled tokens per completion")
    tr.add_argument(
        "--lr", type=float, help="AdamW learning rate (default: grpo 2e-2, opd and sft 5e-3)"
    )
    tr.add_argument(
        "--inner-steps",
        type=int,
        dest="inner_steps",
        help="optimizer steps per training step (default: sft 1, grpo and opd 4)",
    )
    tr.add_argument(
        "--micro-batch",
        type=int,
        default=4,
        dest="micro_batch",
        help="sequences per trainer micro-batch",
    )
    tr.add_argument(
        "--rank",
        type=int,
        help="LoRA rank of a fresh adapter (default: 8, raised to a multiple of an MoE's top-k)",
    )
    tr.add_argument("--clip", type=float, default=0.2, help="PPO clip")
    tr.add_argument(
        "--checkpoint-every",
        type=int,
        default=1,
        dest="checkpoint_every",
        help="write a checkpoint every this many steps (and at the last)",
    )
    tr.add_argument("--seed", type=int, default=0, help="sampling seeds, data order, adapter init")
    tr.add_argument(
        "--backend",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the sampler and the trainer run (cuda: one GPU, shared)",
    )
    tr.add_argument(
        "--sampler-memory",
        type=float,
        default=0.5,
        dest="sampler_memory",
        help="--backend cuda: the fraction of the GPU's memory vLLM takes (the trainer: the rest)",
    )
    tr.add_argument("--out", default="lockstep-train", help="metrics, traces, adapters, report")
    tr.add_argument("--resume", action="store_true", help="continue the run in --out")
    tr.set_defaults(func=_cmd_train)

    bis = sub.add_parser("bisect", help="name the first op site whose bytes differ")
    bis.add_argument("--model", required=True)
    bis.add_argument("--adapter")
    bis.add_argument("--trace", required=True)
    bis.add_argument("--decision", type=int, required=True)
    bis.set_defaults(func=_cmd_bisect)
    for name, command in sub.choices.items():
        command.formatter_class = _DefaultsHelp
        if name in QUIET_COMMANDS:
            command.add_argument(
                "--verbose",
                action="store_true",
                help="stream the engines' output to the terminal too (it always goes to the log)",
            )
            command.add_argument(
                "--log",
                help="the engine log file (default: engine.log in --out for qualify and train, "
                "<out>.log beside a capture's trace or a replay's --out, "
                "<rollouts>.verify.log for verify, a new lockstep-doctor-*.log in the temp "
                "directory for doctor, else "
                "<trace>.<command>.log)",
            )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if argv[:1] == ["serve"] and "--" in argv:  # vLLM's own flags pass through untouched
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        args.extra = extra
    try:
        return args.func(args)
    except (ValueError, RuntimeError, KeyError, FileNotFoundError) as err:
        print(f"lockstep {args.command}: error: {err}", file=sys.stderr)
        if getattr(args, "engine_log", None) is not None:
            print(f"lockstep {args.command}: engine log: {args.engine_log}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
