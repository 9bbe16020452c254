"""The SGLang half's refusals and plumbing, without SGLang (runs in the default environment).

Each refusal the SGLang half adds is asserted here by its message: request parameters the
lane's rule lacks, batch options that change the logits, engine settings the lane model
refuses (with a stand-in for SGLang's server arguments), the capture's pre-flight checks,
the CLI's ``--engine`` choice, and the import-time stand-ins of SGLang's CPU environment.
The real engine runs in ``tests/test_sglang.py`` (SGLang environment).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.plugins import manager as _MANAGER  # the real one, before any patch
from lockstep_exact.requests import CaptureRequest
from lockstep_serving.sglang import capture as sglang_capture
from lockstep_serving.sglang import hooks as sglang_hooks
from lockstep_serving.sglang import model as sglang_model
from lockstep_serving.sglang import sampler as sglang_sampler
from lockstep_serving.vllm.patches import LaneRefused

STANDINS = Path(__file__).resolve().parents[2] / "sglang-cpu-standins" / "src"


def _load(name: str, path: Path):
    """A stand-in module loaded under another name (it must not shadow anything here)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the import-time stand-ins ---------------------------------------------------------------
def test_every_sgl_kernel_standin_name_refuses_naming_itself_and_the_feature():
    kernel = _load("lockstep_test_sgl_kernel", STANDINS / "sgl_kernel" / "__init__.py")
    assert len(kernel.FEATURES) == 9
    for name, feature in kernel.FEATURES.items():
        with pytest.raises(kernel.StandInCalled) as err:
            getattr(kernel, name)(torch.zeros(1))
        assert f"sgl_kernel.{name} was called" in str(err.value)
        assert f"{feature} is not supported on the lane" in str(err.value)
    # SGLang's AMX probe must find nothing else here.
    assert not hasattr(kernel, "convert_weight_packed")


def test_torchvision_standin_placeholders_refuse_when_used():
    ph = _load("lockstep_test_tv", STANDINS / "torchvision" / "_placeholder.py")
    cls = ph.module_getattr("InterpolationMode")
    assert cls.BICUBIC.__name__ == "InterpolationMode.BICUBIC"  # attribute access is inert
    with pytest.raises(RuntimeError, match=r"torchvision\.Resize is a stand-in"):
        ph.module_getattr("Resize")(224)
    with pytest.raises(AttributeError):
        ph.module_getattr("__wrapped__")


# --- the sampling rule -----------------------------------------------------------------------
def _sp(**over):
    base = dict(
        temperature=1.0,
        top_p=1.0,
        top_k=sglang_sampler.TOP_K_ALL,
        min_p=0.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        repetition_penalty=1.0,
        min_new_tokens=0,
        logit_bias=None,
        json_schema=None,
        regex=None,
        ebnf=None,
        structural_tag=None,
        sampling_seed=3,
    )
    base.update(over)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    "name,value,why",
    [
        ("min_p", 0.1, "min-p truncation"),
        ("frequency_penalty", 0.5, "a penalty"),
        ("presence_penalty", 0.5, "a penalty"),
        ("repetition_penalty", 1.1, "a penalty"),
        ("min_new_tokens", 2, "a mask over stop tokens"),
        ("logit_bias", {"3": 1.0}, "a logit bias"),
        ("json_schema", "{}", "a grammar mask"),
        ("regex", "a+", "a grammar mask"),
        ("ebnf", "root ::= 'a'", "a grammar mask"),
        ("structural_tag", "{}", "a grammar mask"),
        ("sampling_seed", 2**63, "a seed outside int64"),
        ("top_k", 5, "top-k truncation"),
    ],
)
def test_request_parameters_the_rule_lacks_are_refused_by_name(name, value, why):
    message = sglang_sampler.refusal(_sp(**{name: value}))
    assert message == (
        f"Lockstep exact lane: {name}={value!r} is not supported: it would change the token "
        f"distribution ({why}), and the lane draws every token with "
        f"{sglang_sampler.RULE.ident} (temperature and top_p only)"
    )


def test_temperature_top_p_seed_and_greedy_are_the_rule():
    assert sglang_sampler.refusal(_sp(temperature=0.7, top_p=0.9)) is None
    assert sglang_sampler.refusal(_sp(top_k=1)) is None  # SGLang's greedy


class _Orchestrator:
    def __init__(self, required: bool):
        self.required = required

    def is_required(self):
        return self.required


def _info(n=2, **over):
    base = dict(
        temperatures=torch.tensor([[0.7], [1.0]][:n]),
        top_ps=torch.tensor([0.9, 1.0][:n]),
        top_ks=torch.tensor([sglang_sampler.TOP_K_ALL, 1][:n], dtype=torch.int32),
        min_ps=torch.zeros(n),
        sampling_seed=torch.tensor([5, 9][:n]),
        has_custom_logit_processor=False,
        logit_bias=None,
        grammars=None,
        penalizer_orchestrator=_Orchestrator(False),
    )
    base.update(over)
    return SimpleNamespace(**base)


def test_rows_give_each_request_its_rule_and_greedy_rows_temperature_zero():
    temps, tops, seeds = sglang_sampler._rows(_info(), 2)
    assert temps == [pytest.approx(0.7), 0.0] and tops == [pytest.approx(0.9), 1.0]
    assert seeds == [5, 0]


@pytest.mark.parametrize(
    "over,message",
    [
        (
            {"has_custom_logit_processor": True},
            "Lockstep exact lane: a custom logit processor changes the logits",
        ),
        ({"logit_bias": torch.zeros(2, 8)}, "Lockstep exact lane: a logit bias changes the logits"),
        ({"grammars": [None, object()]}, "Lockstep exact lane: a grammar masks the logits"),
        (
            {"penalizer_orchestrator": _Orchestrator(True)},
            "Lockstep exact lane: a penalty (or min_new_tokens) changes the logits",
        ),
        (
            {"sampling_seed": None},
            "Lockstep exact lane: the batch carries no seed per request (was the plugin's "
            "SamplingBatchInfo.from_schedule_batch patch bypassed?)",
        ),
        (
            {"top_ks": torch.tensor([5, 1], dtype=torch.int32)},
            "Lockstep exact lane: row 0 asks for top_k=5, min_p=0.0; the lane draws with "
            f"{sglang_sampler.RULE.ident} (temperature and top_p only)",
        ),
    ],
)
def test_batch_options_that_change_the_logits_are_refused(over, message):
    with pytest.raises(LaneRefused) as err:
        sglang_sampler._rows(_info(**over), 2)
    assert str(err.value) == message


# --- the model's reading of a batch ------------------------------------------------------------
def _fb(**over):
    mode = SimpleNamespace(is_decode=lambda: False)
    base = dict(
        forward_mode=mode,
        seq_lens_cpu=torch.tensor([5, 3]),
        extend_seq_lens_cpu=[2, 3],
        extend_logprob_start_lens_cpu=[2, 3],
        return_logprob=True,
        input_ids=torch.zeros(5, dtype=torch.int64),
    )
    base.update(over)
    return SimpleNamespace(**base)


def test_requests_are_rows_and_cache_lengths_prefix_hits_included():
    # request 0 extends a cached 3-token prefix by 2 rows; request 1 is new.
    reqs = sglang_model.LockstepQwen3ForCausalLM._requests(None, _fb())
    assert reqs == [(0, 0, 2, 5), (1, 2, 5, 3)]


def test_prompt_logprobs_are_refused():
    with pytest.raises(LaneRefused) as err:
        sglang_model.LockstepQwen3ForCausalLM._requests(
            None, _fb(extend_logprob_start_lens_cpu=[0, 3])
        )
    assert str(err.value) == (
        "Lockstep exact lane: request 0 asks for prompt logprobs (logprob_start_len); the "
        "SGLang lane reports sampled-token logprobs only"
    )


def test_rows_that_do_not_add_up_are_refused():
    with pytest.raises(LaneRefused) as err:
        sglang_model.LockstepQwen3ForCausalLM._requests(
            None, _fb(input_ids=torch.zeros(6, dtype=torch.int64))
        )
    assert str(err.value) == (
        "Lockstep exact lane: the batch has 6 rows but its requests extend by 5"
    )


# --- the engine settings the lane model refuses -------------------------------------------------
@pytest.fixture()
def fake_sglang(monkeypatch, tmp_path):
    """SGLang's server arguments as the lane model reads them, without SGLang."""
    model = make_tiny(tmp_path / "m", arch="qwen3")
    args = SimpleNamespace(
        model_path=str(model),
        attention_backend="torch_native",
        dtype="bfloat16",
        kv_cache_dtype="auto",
        device="cpu",
        sampling_backend="pytorch",
        quantization=None,
        tp_size=1,
        pp_size=1,
        dp_size=1,
        ep_size=1,
    )
    for name in ("sglang", "sglang.srt", "sglang.srt.runtime_context"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["sglang.srt.runtime_context"].get_server_args = lambda: args
    monkeypatch.setattr("lockstep_serving.sglang.patches.check", lambda: None)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    sampler = object.__new__(type("FakeLaneSampler", (), {}))
    monkeypatch.setattr(sglang_model, "SAMPLERS", [sampler])
    return args, model


def _validate(arch="LockstepQwen3ForCausalLM", quant=None, config=None):
    return sglang_model._validate(config or SimpleNamespace(), quant, arch)


def test_the_lane_model_starts_on_a_fitting_engine(fake_sglang):
    geom, model_dir, backend = _validate()
    assert geom.family == "qwen3" and model_dir == fake_sglang[1] and backend == "cpu"


@pytest.mark.parametrize(
    "name,value,message",
    [
        (
            "attention_backend",
            "triton",
            "attention_backend='triton'; the lane needs 'torch_native'",
        ),
        ("dtype", "float16", "dtype='float16'; the lane needs 'bfloat16'"),
        (
            "kv_cache_dtype",
            "fp8_e5m2",
            "kv_cache_dtype='fp8_e5m2'; the lane needs 'auto' or 'bfloat16' or 'bf16'",
        ),
        ("quantization", "fp8", "quantized weights ('fp8') have no exact lane"),
        (
            "speculative_algorithm",
            "EAGLE",
            "speculative_algorithm='EAGLE': speculative decoding (its draft/verify path is not "
            "exact) is not part of the lane",
        ),
        (
            "enable_lora_overlap_loading",
            True,
            "enable_lora_overlap_loading=True: SGLang's LoRA overlap loading (it fills SGLang's "
            "LoRA memory pool, which the lane's LoRA manager replaces) is not part of the lane",
        ),
        (
            "enable_torch_compile",
            True,
            "enable_torch_compile=True: torch.compile of the model is not part of the lane",
        ),
        (
            "enable_dp_attention",
            True,
            "enable_dp_attention=True: data-parallel attention is not part of the lane",
        ),
        (
            "enable_deterministic_inference",
            True,
            "enable_deterministic_inference=True: SGLang's own deterministic kernels (GPU only) "
            "is not part of the lane",
        ),
        (
            "rl_on_policy_target",
            "fsdp",
            "rl_on_policy_target='fsdp': SGLang's RL on-policy mode (its own logprob path) is "
            "not part of the lane",
        ),
        ("tp_size", 2, "tp_size=2: the SGLang lane runs on one process (no parallelism yet)"),
        ("pp_size", 2, "pp_size=2: the SGLang lane runs on one process (no parallelism yet)"),
        ("dp_size", 2, "dp_size=2: the SGLang lane runs on one process (no parallelism yet)"),
        ("ep_size", 2, "ep_size=2: the SGLang lane runs on one process (no parallelism yet)"),
    ],
)
def test_engine_settings_outside_the_lane_are_refused_by_name(fake_sglang, name, value, message):
    setattr(fake_sglang[0], name, value)
    with pytest.raises(LaneRefused) as err:
        _validate()
    assert str(err.value) == f"Lockstep exact lane refused to start: {message}"


def test_quantized_weights_are_refused(fake_sglang):
    with pytest.raises(LaneRefused, match=r"quantized weights \(None\) have no exact lane"):
        _validate(quant=object())


def test_the_cpu_engine_variable_is_required(fake_sglang, monkeypatch):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    with pytest.raises(LaneRefused) as err:
        _validate()
    assert str(err.value) == (
        "Lockstep exact lane refused to start: SGLANG_USE_CPU_ENGINE=1 is not set: the lane's "
        "cpu backend runs on SGLang's CPU engine only"
    )


# --- the cuda engine: the lane's backend is the engine's device --------------------------------
@pytest.fixture()
def fake_cuda(fake_sglang, monkeypatch):
    """A cuda engine's settings as SGLang resolves them (disable_cuda_graph=True), on a machine
    that claims a CUDA device (nothing runs on it here)."""
    args, model = fake_sglang
    off = SimpleNamespace(backend="disabled")
    args.device = "cuda"
    args.disable_cuda_graph = True
    args.cuda_graph_config = SimpleNamespace(decode=off, prefill=off)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return args, model


def test_a_cuda_engine_gets_the_cuda_lane(fake_cuda, monkeypatch):
    asked = []
    monkeypatch.setattr(sglang_model, "admit_requested", lambda d, b, r: asked.append((b, r)))
    geom, model_dir, backend = _validate(config=SimpleNamespace(lockstep_contract="sha256:c"))
    assert backend == "cuda" and model_dir == fake_cuda[1]
    # the fingerprint asked for is admitted against the cuda lane's contract
    assert asked == [("cuda", "sha256:c")]


@pytest.mark.parametrize(
    "over,env,message",
    [
        ({"device": "npu"}, None, "device='npu'; the lane needs 'cpu' or 'cuda'"),
        (
            {},
            "1",
            "SGLANG_USE_CPU_ENGINE=1 with device='cuda': the engine would not run on cuda",
        ),
        (
            {"sampling_backend": "flashinfer"},
            None,
            "sampling_backend='flashinfer'; on cuda the lane needs 'pytorch' (the lane's "
            "sampler is registered under it)",
        ),
        (
            {
                "cuda_graph_config": SimpleNamespace(
                    decode=SimpleNamespace(backend="full"),
                    prefill=SimpleNamespace(backend="disabled"),
                )
            },
            None,
            "CUDA graphs are on (decode: full): the lane's forward reads the batch on the host "
            "every step; start the engine with disable_cuda_graph=True",
        ),
        (
            {"cuda_graph_config": None, "disable_cuda_graph": False},
            None,
            "CUDA graphs are on (decode, prefill): the lane's forward reads the batch on the "
            "host every step; start the engine with disable_cuda_graph=True",
        ),
    ],
)
def test_cuda_engine_settings_outside_the_lane_are_refused_by_name(
    fake_cuda, monkeypatch, over, env, message
):
    for name, value in over.items():
        setattr(fake_cuda[0], name, value)
    if env is not None:
        monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", env)
    with pytest.raises(LaneRefused) as err:
        _validate()
    assert str(err.value) == f"Lockstep exact lane refused to start: {message}"


def test_a_cuda_engine_without_a_cuda_device_is_refused(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LaneRefused) as err:
        _validate()
    assert str(err.value) == (
        "Lockstep exact lane refused to start: device='cuda' but torch sees no CUDA device in "
        "the engine's process"
    )


def test_cuda_graph_phases_reads_sglangs_resolved_settings():
    on, off = SimpleNamespace(backend="breakable"), SimpleNamespace(backend="disabled")
    cfg = lambda d, p: SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=d, prefill=p))  # noqa: E731
    assert sglang_model.cuda_graph_phases(cfg(off, off)) == []
    assert sglang_model.cuda_graph_phases(cfg(on, off)) == ["decode: breakable"]
    assert sglang_model.cuda_graph_phases(cfg(off, on)) == ["prefill: breakable"]
    bare = SimpleNamespace(disable_cuda_graph=True)
    assert sglang_model.cuda_graph_phases(bare) == []
    assert sglang_model.cuda_graph_phases(SimpleNamespace()) == ["decode", "prefill"]


def test_a_model_without_the_lane_sampler_is_refused(fake_sglang, monkeypatch):
    monkeypatch.setattr(sglang_model, "SAMPLERS", [])
    with pytest.raises(LaneRefused) as err:
        _validate()
    assert str(err.value) == (
        "Lockstep exact lane refused to start: SGLang did not build the lane's sampler in this "
        "process (sampling_backend 'pytorch'); the lockstep SGLang plugin registers it under "
        "'pytorch': is the plugin loaded (entry point sglang.srt.plugins, SGLANG_PLUGINS)?"
    )


def test_the_wrong_family_and_a_foreign_contract_are_refused(fake_sglang):
    with pytest.raises(LaneRefused, match="LockstepQwen3MoeForCausalLM serves the qwen3-moe"):
        _validate(arch="LockstepQwen3MoeForCausalLM")
    with pytest.raises(LaneRefused, match="refused to start: .*sha256:0000"):
        _validate(config=SimpleNamespace(lockstep_contract="sha256:" + "0" * 64))


def test_a_model_path_without_config_is_refused(fake_sglang, tmp_path):
    fake_sglang[0].model_path = str(tmp_path)
    with pytest.raises(LaneRefused) as err:
        _validate()
    assert str(err.value) == (
        f"Lockstep exact lane refused to start: {str(tmp_path)!r} is not a local HF model "
        "directory (config.json missing)"
    )


# --- capture: engine arguments and pre-flight refusals ------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("sgl") / "m", arch="qwen3")


def test_engine_args_select_the_lane_architecture_and_contract(tiny):
    args = sglang_capture.engine_args(tiny, contract="sha256:abc")
    override = json.loads(args["json_model_override_args"])
    assert override == {
        "architectures": ["LockstepQwen3ForCausalLM"],
        "lockstep_contract": "sha256:abc",
    }
    assert args["attention_backend"] == "torch_native" and args["device"] == "cpu"
    assert args["sampling_backend"] == "pytorch" and args["grammar_backend"] == "none"
    assert args["mem_fraction_static"] == 0.05 and args["disable_cuda_graph"] is True


def test_engine_args_on_cuda_put_the_engine_on_the_gpu_eagerly(tiny):
    args = sglang_capture.engine_args(tiny, backend="cuda", max_total_tokens=512)
    assert args["device"] == "cuda" and args["attention_backend"] == "torch_native"
    assert args["sampling_backend"] == "pytorch" and args["disable_cuda_graph"] is True
    assert args["mem_fraction_static"] == 0.3 and args["max_total_tokens"] == 512
    with pytest.raises(LaneRefused) as err:
        sglang_capture.engine_args(tiny, backend="tpu")
    assert str(err.value) == (
        "Lockstep exact lane refused to start: backend 'tpu': the SGLang lane serves the "
        "('cpu', 'cuda') lanes only"
    )


def test_isolate_chooses_sglangs_cpu_engine_for_the_cpu_backend_only(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "x")
    sglang_capture.isolate(tmp_path, "cuda")
    assert sglang_capture.os.environ["SGLANG_USE_CPU_ENGINE"] == "0"
    sglang_capture.isolate(tmp_path, "cpu")
    assert sglang_capture.os.environ["SGLANG_USE_CPU_ENGINE"] == "1"


def _request(model, **over):
    return CaptureRequest(model_dir=model, prompts=("hi",), decisions=2, **over)


@pytest.mark.parametrize(
    "over,message",
    [
        (
            {"backend": "cuda"},
            "backend 'cuda': no CUDA device here (SGLang 0.5.17 on a GPU serves the cuda lane)",
        ),
        (
            {"backend": "rocm"},
            "backend 'rocm': the SGLang lane serves the ('cpu', 'cuda') lanes only",
        ),
        ({"tp": 2}, "--tp 2: the SGLang lane runs on one process (no parallelism yet)"),
    ],
)
def test_capture_refuses_before_any_engine(tiny, over, message):
    with pytest.raises(LaneRefused) as err:
        sglang_capture.preflight(_request(tiny, **over))
    assert str(err.value) == f"Lockstep exact lane refused to start: {message}"


def test_capture_refuses_an_adapter_the_lane_cannot_run_before_any_engine(tiny, tmp_path):
    from lockstep_exact.adapters import AdapterError, make_adapter

    bad = make_adapter(tiny, tmp_path / "other", rank=8, contract="sha256:" + "3" * 64)
    with pytest.raises(AdapterError, match="adapter was made for contract sha256:3+, this lane"):
        sglang_capture.preflight(_request(tiny, adapter_dir=bad))


def test_capture_refuses_a_model_without_tokenizer(tiny, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((tiny / f).read_bytes())
    with pytest.raises(LaneRefused, match="has no tokenizer"):
        sglang_capture.preflight(_request(bare))


def test_an_architecture_without_lane_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(LaneRefused) as err:
        sglang_model.architecture_for(tmp_path)
    assert str(err.value) == (
        "Lockstep exact lane refused to start: architecture 'LlamaForCausalLM' has no exact "
        "lane; supported: ['Qwen3ForCausalLM', 'Qwen3MoeForCausalLM']"
    )


def test_a_capture_report_that_never_came_is_refused(tmp_path):
    with pytest.raises(LaneRefused, match="no lane model reported what it ran"):
        sglang_capture.invoked_contract(tmp_path / "report.json")
    (tmp_path / "report.json").write_text(json.dumps({"samples": 0}))
    with pytest.raises(LaneRefused, match="the lane's sampler never ran in the engine"):
        sglang_capture.invoked_contract(tmp_path / "report.json")


# --- the lockstep hooks and the CLI's --engine -------------------------------------------------
def test_hooks_stay_silent_where_sglang_is_not_installed(monkeypatch):
    monkeypatch.setattr(sglang_hooks, "sglang_version", lambda: None)
    assert sglang_hooks.lockstep_engine_info() is None
    assert sglang_hooks.lockstep_capture(request=None) is None


def test_an_unsupported_sglang_version_is_named(monkeypatch):
    monkeypatch.setattr(sglang_hooks, "sglang_version", lambda: "0.5.23")
    info = sglang_hooks.lockstep_engine_info()
    assert info.engine == "sglang" and "SGLang 0.5.23 is not among the supported" in info.problem


def _answering(name: str, value):
    """A plugin (a module) whose lockstep_capture answers ``value``."""
    from lockstep_exact import hookimpl

    def lockstep_capture(request):
        return value

    plugin = types.ModuleType(f"fake_{name}")
    plugin.lockstep_capture = hookimpl(lockstep_capture)
    return plugin


def _pm(**plugins):
    pm = _MANAGER(load_entry_points=False)
    for name, value in plugins.items():
        pm.register(_answering(name, value), name=name)
    return pm


def test_cli_engine_picks_the_plugin_by_name(monkeypatch, capsys, tmp_path):
    from lockstep_exact.app import cli

    pm = _pm(vllm="from vllm", sglang="from sglang")
    hook = cli._only_engine(pm, "lockstep_capture", "sglang", "lockstep-serving")
    assert hook(request=None) == "from sglang"
    assert cli._only_engine(pm, "lockstep_capture", "vllm", "x")(request=None) == "from vllm"


def test_cli_engine_refuses_an_engine_not_installed(monkeypatch, capsys, tmp_path):
    from lockstep_exact.app import cli

    monkeypatch.setattr("lockstep_exact.plugins.manager", lambda: _pm(vllm="t"))
    code = cli.main(
        ["capture", "--engine", "sglang", "--model", str(tmp_path), "--out", str(tmp_path / "o")]
    )
    assert code == 2
    assert (
        "error: no installed plugin named 'sglang' answers lockstep_capture (installed: vllm); "
        "install lockstep-serving" in capsys.readouterr().err
    )
    # Installed as a plugin but SGLang itself missing: the hook answers None.
    monkeypatch.setattr("lockstep_exact.plugins.manager", lambda: _pm(vllm="t", sglang=None))
    code = cli.main(
        ["capture", "--engine", "sglang", "--model", str(tmp_path), "--out", str(tmp_path / "o")]
    )
    assert code == 2
    assert (
        "error: the 'sglang' plugin did not answer lockstep_capture: sglang is not installed in "
        "this environment; install lockstep-serving" in capsys.readouterr().err
    )


# --- a step and the KV pool, as the lane model reads them -----------------------------------
def _step(mode="EXTEND", **over):
    base = dict(
        forward_mode=SimpleNamespace(name=mode),
        input_embeds=None,
        lora_ids=None,
        spec_info=None,
    )
    base.update(over)
    return SimpleNamespace(**base)


def _bare_model(unsampled=0):
    model = object.__new__(sglang_model.LockstepQwen3ForCausalLM)
    model._unsampled = unsampled
    model.lora_manager = None
    return model


def test_a_step_the_lane_runs_and_an_idle_one():
    assert _bare_model().check_step(_step("DECODE")) is True
    assert _bare_model().check_step(_step("IDLE")) is False


@pytest.mark.parametrize(
    "step,unsampled,message",
    [
        (
            _step("TARGET_VERIFY"),
            0,
            "Lockstep exact lane: forward mode TARGET_VERIFY is not part of the lane (it runs "
            "EXTEND, MIXED, DECODE, IDLE)",
        ),
        (
            _step(),
            1,
            "Lockstep exact lane: the previous step's logits were not consumed by the lane's "
            "sampler; SGLang is sampling with another sampler (its sampling_backend must resolve "
            "to the lane's 'pytorch' registration)",
        ),
        (
            _step(input_embeds=torch.zeros(1)),
            0,
            "Lockstep exact lane: input embeddings are not part of the lane",
        ),
        (
            _step(lora_ids=[None, "a"]),
            0,
            "Lockstep exact lane: a LoRA request reached the lane model but the engine's LoRA "
            "manager is not the lane's (start the engine with enable_lora)",
        ),
        (
            _step(spec_info=object()),
            0,
            "Lockstep exact lane: speculative decoding is not part of the lane",
        ),
    ],
)
def test_steps_outside_the_lane_are_refused(step, unsampled, message):
    with pytest.raises(LaneRefused) as err:
        _bare_model(unsampled).check_step(step)
    assert str(err.value) == message


class _Pool:
    """A stand-in for SGLang's MHATokenToKVPool: per layer [slots, kv_heads, head_dim]."""

    def __init__(self, slots=16, hkv=2, d=4, dtype=torch.bfloat16):
        self.k = torch.zeros(slots, hkv, d, dtype=dtype)
        self.v = torch.zeros(slots, hkv, d, dtype=dtype)

    def get_key_buffer(self, layer):
        return self.k

    def get_value_buffer(self, layer):
        return self.v


@pytest.fixture()
def fake_pool_module(monkeypatch):
    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = types.ModuleType("sglang.srt.mem_cache.memory_pool")
    module.MHATokenToKVPool = _Pool
    monkeypatch.setitem(sys.modules, module.__name__, module)


def test_pool_attention_writes_rows_and_reads_each_request_through_req_to_token(fake_pool_module):
    torch.manual_seed(0)
    pool = _Pool()
    req_to_token = torch.tensor([[3, 7, 9, 0], [5, 11, 0, 0]])
    # Request 0 has positions 0..1 cached (slots 3, 7) and extends by one (slot 9);
    # request 1 is new, two rows (slots 5, 11).
    k = torch.randn(3, 2, 4).to(torch.bfloat16)
    v = torch.randn(3, 2, 4).to(torch.bfloat16)
    pool.k[3], pool.k[7] = torch.ones(2, 4), 2 * torch.ones(2, 4)
    fb = SimpleNamespace(
        out_cache_loc=torch.tensor([9, 5, 11]), req_pool_indices=torch.tensor([0, 1])
    )
    seen = []

    def core(q, keys, values, pos):
        seen.append((keys.clone(), pos.tolist()))
        return q

    q = torch.randn(3, 4, 4).to(torch.bfloat16)
    out = sglang_model.pool_attention(
        0,
        q,
        k,
        v,
        torch.tensor([2, 0, 1]),
        fb,
        [(0, 0, 1, 3), (1, 1, 3, 2)],
        pool,
        req_to_token,
        core=core,
    )
    assert torch.equal(out, q)
    assert torch.equal(pool.k[9], k[0]) and torch.equal(pool.v[11], v[2])
    assert torch.equal(seen[0][0], torch.stack([pool.k[3], pool.k[7], k[0]])) and seen[0][1] == [2]
    assert torch.equal(seen[1][0], k[1:]) and seen[1][1] == [0, 1]


def test_a_pool_of_another_kind_or_layout_is_refused(fake_pool_module):
    k = torch.zeros(1, 2, 4, dtype=torch.bfloat16)
    with pytest.raises(LaneRefused) as err:
        sglang_model.pool_buffers(SimpleNamespace(), 0, k)
    assert str(err.value) == (
        "Lockstep exact lane: the KV pool is SimpleNamespace, not MHATokenToKVPool (quantized, "
        "hybrid or offloaded KV caches are not part of the lane)"
    )
    with pytest.raises(LaneRefused) as err:
        sglang_model.pool_buffers(_Pool(dtype=torch.float16), 0, k)
    assert str(err.value) == (
        "Lockstep exact lane: the layer's key buffer is (16, 2, 4) torch.float16, not [slots, 2, "
        "4] torch.bfloat16; the pool must hold the lane's K/V bytes"
    )


def test_rows_without_slots_and_misplaced_queries_are_refused(fake_pool_module):
    pool, k = _Pool(), torch.zeros(2, 2, 4, dtype=torch.bfloat16)
    fb = SimpleNamespace(out_cache_loc=torch.tensor([1]), req_pool_indices=torch.tensor([0]))
    args = (torch.zeros(2, 4, 4), k, k, torch.tensor([0, 1]))
    with pytest.raises(LaneRefused) as err:
        sglang_model.pool_attention(0, *args, fb, [(0, 0, 2, 2)], pool, None, core=None)
    assert str(err.value) == "Lockstep exact lane: 2 K/V rows but 1 cache slots"
    fb.out_cache_loc = torch.tensor([1, 2])
    with pytest.raises(LaneRefused) as err:
        sglang_model.pool_attention(
            0, *args, fb, [(0, 0, 2, 5)], pool, torch.zeros(1, 8, dtype=torch.int64), core=None
        )
    assert str(err.value) == (
        "request 0: last query position 1 is not seq_len-1 (4); the lane cannot place its "
        "queries in the cache"
    )


def test_the_position_bound_is_the_request_to_token_width_and_a_longer_request_is_refused(
    monkeypatch,
):
    """Prefill runs under a fixed position bound, the width of SGLang's request-to-token table
    (rope then reads no position on the host); a request longer than the table is refused."""
    for name in ("sglang", "sglang.srt", "sglang.srt.model_executor"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    context = types.ModuleType("sglang.srt.model_executor.forward_context")
    pool = SimpleNamespace(req_to_token=torch.zeros(4, 40, dtype=torch.int32))
    context.get_req_to_token_pool = lambda: pool
    monkeypatch.setitem(sys.modules, context.__name__, context)
    assert sglang_model.position_bound([(0, 0, 3, 40), (1, 3, 4, 7)]) == 40
    assert sglang_model.position_bound([]) == 40
    with pytest.raises(LaneRefused) as err:
        sglang_model.position_bound([(0, 0, 3, 41)])
    assert str(err.value) == (
        "a request of 41 positions is longer than SGLang's request-to-token table (40 slots a "
        "request); the lane cannot place its queries in the cache"
    )


def test_weights_outside_the_lane_are_refused(tiny):
    from safetensors.torch import load_file

    from lockstep_exact.lanes.qwen3 import Geometry

    weights = load_file(str(tiny / "model.safetensors"))
    model = object.__new__(sglang_model.LockstepQwen3ForCausalLM)
    torch.nn.Module.__init__(model)
    model.geom, model.weights = Geometry.from_model_dir(tiny), {}
    model.load_weights(weights.items())  # the whole checkpoint: accepted
    assert set(model.weights) == set(weights)
    cases = [
        (
            {**weights, "model.extra.weight": torch.zeros(1, dtype=torch.bfloat16)},
            "unexpected tensor 'model.extra.weight' in the checkpoint (not part of the lane)",
        ),
        (
            {**weights, "model.norm.weight": weights["model.norm.weight"].float()},
            "tensor 'model.norm.weight' is torch.float32; the exact lane loads bf16 weights only",
        ),
        (
            {k: t for k, t in weights.items() if k != "model.norm.weight"},
            "checkpoint lacks 1 tensor(s), first 'model.norm.weight'",
        ),
    ]
    for given, message in cases:
        model.weights = {}
        with pytest.raises(LaneRefused) as err:
            model.load_weights(given.items())
        assert str(err.value) == f"Lockstep exact lane refused to start: {message}"


def test_the_batch_patch_seeds_random_requests_and_refuses_the_rest(monkeypatch):
    from lockstep_serving.sglang.patches import TABLE

    calls = []

    def original(batch, vocab_size):
        calls.append(batch)
        return SimpleNamespace(temperatures=torch.zeros(len(batch.reqs), 1), sampling_seed=None)

    monkeypatch.setattr(TABLE, "original", lambda name: original)
    req = lambda rid, **over: SimpleNamespace(rid=rid, sampling_params=_sp(**over))  # noqa: E731
    # No lane model in the process: SGLang's own batch, untouched.
    monkeypatch.setattr(sglang_sampler, "_lane_model", lambda: None)
    assert (
        sglang_sampler.from_schedule_batch(None, SimpleNamespace(reqs=[]), 8).sampling_seed is None
    )
    monkeypatch.setattr(sglang_sampler, "_lane_model", lambda: object())
    batch = SimpleNamespace(
        reqs=[req("a", sampling_seed=None), req("b", top_k=1, sampling_seed=None), req("c")]
    )
    info = sglang_sampler.from_schedule_batch(None, batch, 8)
    fresh = batch.reqs[0].sampling_params.sampling_seed
    assert isinstance(fresh, int) and 0 <= fresh < 2**63  # kept for the request's life
    assert batch.reqs[1].sampling_params.sampling_seed is None  # greedy: no seed needed
    assert info.sampling_seed.tolist() == [fresh, 0, 3]
    with pytest.raises(LaneRefused) as err:
        sglang_sampler.from_schedule_batch(None, SimpleNamespace(reqs=[req("d", min_p=0.1)]), 8)
    assert str(err.value) == f"request d: {sglang_sampler.refusal(_sp(min_p=0.1))}"


def test_the_lane_sampler_draws_with_the_rule_and_refuses_foreign_logits(tiny):
    from lockstep_exact.lanes.ops import Ops
    from lockstep_exact.model import lane_contract

    ops = Ops(lane_contract(tiny))
    model = SimpleNamespace(ops=ops, sampled=lambda: None)
    logits = torch.randn(2, 1024, generator=torch.Generator().manual_seed(0))
    out = SimpleNamespace(next_token_logits=logits)
    tokens = sglang_sampler.lane_forward(
        None, model, out, _info(), False, [0, 0], [None, None], torch.tensor([4, 6])
    )
    raw = ops.log_softmax("logprobs", logits)
    want = ops.sample(
        "sample",
        raw,
        temperature=[0.7, 0.0],
        top_p=[0.9, 1.0],
        seeds=[5, 0],
        positions=torch.tensor([5, 7]),
    )
    assert torch.equal(tokens, want.to(torch.int32))
    # control (an input): the lane's draw with row 0's seed + 1000 parts from the rule's draw
    # there; row 1 (top_k 1: greedy) keeps its token
    seeds = _info(sampling_seed=torch.tensor([5 + 1000, 9]))
    other = sglang_sampler.lane_forward(
        None, model, out, seeds, False, [0, 0], [None, None], torch.tensor([4, 6])
    )
    assert int(other[0]) != int(want[0]) and int(other[1]) == int(want[1])
    out = SimpleNamespace(next_token_logits=logits.to(torch.bfloat16))
    with pytest.raises(LaneRefused) as err:
        sglang_sampler.lane_forward(None, model, out, _info(), False, [], [], torch.tensor([4, 6]))
    assert str(err.value) == (
        "Lockstep exact lane: the sampler got torch.bfloat16 logits; the lane's are fp32 (was "
        "the lane model's LogitsProcessorOutput replaced?)"
    )
    out = SimpleNamespace(next_token_logits=logits)
    with pytest.raises(LaneRefused) as err:
        sglang_sampler.lane_forward(None, model, out, _info(), False, [], [], torch.tensor([4]))
    assert str(err.value) == "the lane's sampler got 1 positions for 2 rows"


def test_the_front_end_refuses_a_lane_request_and_passes_others(monkeypatch):
    from lockstep_serving.sglang.patches import TABLE

    made = SimpleNamespace(sampling_params=_sp(top_k=5))
    monkeypatch.setattr(TABLE, "original", lambda name: lambda self, obj, *a, **k: made)
    lane = SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(architectures=["LockstepQwen3ForCausalLM"])
        )
    )
    stock = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=["Qwen3ForCausalLM"]))
    )
    obj = SimpleNamespace(return_logprob=True, logprob_start_len=-1, lora_path=None)
    assert sglang_sampler.create_tokenized_object(stock, obj, "", [1]) is made
    with pytest.raises(ValueError) as err:
        sglang_sampler.create_tokenized_object(lane, obj, "", [1])
    assert str(err.value) == sglang_sampler.refusal(_sp(top_k=5))
    made.sampling_params = _sp()
    assert sglang_sampler.create_tokenized_object(lane, obj, "", [1]) is made
    # A LoRA request passes: SGLang resolves its adapter, the lane's LoRA manager runs it.
    lora = SimpleNamespace(return_logprob=True, logprob_start_len=-1, lora_path="A")
    assert sglang_sampler.create_tokenized_object(lane, lora, "", [1]) is made
    cases = [
        (
            SimpleNamespace(return_logprob=True, logprob_start_len=0, lora_path=None),
            "Lockstep exact lane: logprob_start_len=0 asks for prompt logprobs; the SGLang lane "
            "reports sampled-token logprobs only",
        ),
    ]
    for request, message in cases:
        with pytest.raises(ValueError) as err:
            sglang_sampler.create_tokenized_object(lane, request, "", [1])
        assert str(err.value) == message


def test_sglang_outputs_are_read_exactly_or_refused():
    out = {
        "output_ids": [7, 9],
        "meta_info": {"output_token_logprobs": [(-0.5, 7, None), (-1.25, 9, None)]},
    }
    assert sglang_capture.sampled(out) == ([7, 9], [-0.5, -1.25])
    out["meta_info"]["output_token_logprobs"][1] = (-1.25, 8, None)
    with pytest.raises(
        RuntimeError, match="SGLang's output_token_logprobs do not match its output_ids"
    ):
        sglang_capture.sampled(out)


# --- LoRA: the lane's manager in SGLang's place -----------------------------------------------
@pytest.fixture()
def fake_lora_sglang(monkeypatch):
    """The SGLang names the lane's LoRA manager uses: its update answer and its LoRA settings."""
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    io_struct.LoRAUpdateOutput = lambda **kw: SimpleNamespace(**kw)
    runtime = types.ModuleType("sglang.srt.runtime_context")
    settings = SimpleNamespace(max_loras_per_batch=3, lora_paths=[])
    runtime.get_lora = lambda: settings
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, io_struct.__name__, io_struct)
    monkeypatch.setitem(sys.modules, runtime.__name__, runtime)
    return settings


def _lane_model(model_dir):
    from lockstep_exact.lanes.qwen3 import Geometry
    from lockstep_exact.model import lane_contract

    model = object.__new__(sglang_model.LockstepQwen3ForCausalLM)
    torch.nn.Module.__init__(model)
    model.geom = Geometry.from_model_dir(model_dir)
    model.model_dir = Path(model_dir)
    model.contract = lane_contract(model_dir)
    model.lora_manager = None
    return model


def _ref(name, path, lora_id=None, pinned=False):
    return SimpleNamespace(
        lora_id=lora_id or f"id-{name}", lora_name=name, lora_path=str(path), pinned=pinned
    )


def test_the_lane_lora_manager_loads_adapters_through_the_lanes_checks(
    fake_lora_sglang, tiny, tmp_path
):
    from lockstep_exact.adapters import load_adapter, make_adapter
    from lockstep_serving.sglang.lora import SglangLaneLoRAManager

    model = _lane_model(tiny)
    manager = SglangLaneLoRAManager(model, 3)
    assert model.lora_manager is manager
    a = make_adapter(tiny, tmp_path / "A", rank=8, seed=2)
    out = manager.load_lora_adapter(_ref("A", a))
    assert out.success and out.error_message == "" and out.loaded_adapters == {"A": str(a)}
    want = load_adapter(a, model.geom).modules
    got = manager.adapter("id-A")
    assert set(got) == set(want)
    assert all(torch.equal(got[k][i], want[k][i]) for k in want for i in (0, 1))
    assert manager.adapter(None) is None
    assert manager.validate_lora_batch({None, "id-A", "x"})
    assert not manager.validate_lora_batch({None, "id-A", "x", "y"})  # max_loras_per_batch 3
    again = manager.load_lora_adapter(_ref("A", a, lora_id="id-A2"))
    assert not again.success
    assert again.error_message == "Lockstep exact lane: an adapter named A is already loaded"
    assert manager.unload_lora_adapter(_ref("A", a)).loaded_adapters == {}
    with pytest.raises(LaneRefused) as err:
        manager.adapter("id-A")
    assert str(err.value) == (
        "Lockstep exact lane: the batch names adapter id(s) id-A the lane never loaded (nothing "
        "runs them on the base model)"
    )


def test_the_lane_lora_manager_refuses_adapters_by_name(fake_lora_sglang, tiny, tmp_path):
    from lockstep_exact.adapters import make_adapter
    from lockstep_exact.app.tiny import make_tiny
    from lockstep_serving.sglang.lora import SglangLaneLoRAManager

    manager = SglangLaneLoRAManager(_lane_model(tiny), 2)
    other = make_tiny(tmp_path / "other", arch="qwen3", seed=9)  # same shapes, other bytes
    cases = {
        "contract": make_adapter(tiny, tmp_path / "c", rank=8, contract="sha256:" + "3" * 64),
        "base": make_adapter(other, tmp_path / "b", rank=8),
        "missing": tmp_path / "nowhere",
    }
    for name, path in cases.items():
        out = manager.load_lora_adapter(_ref(name, path))
        assert not out.success, name
        assert out.error_message.startswith(f"Lockstep exact lane refused adapter {name}: ")
    assert (
        "made for contract sha256:3"
        in manager.load_lora_adapter(_ref("c", cases["contract"])).error_message
    )
    assert (
        "made for base model" in manager.load_lora_adapter(_ref("b", cases["base"])).error_message
    )
    assert manager.adapters == {} and manager.lora_refs == {}
    tensors = manager.load_lora_adapter_from_tensors(_ref("t", "-"), {}, {})
    assert not tensors.success and tensors.error_message == (
        "Lockstep exact lane refused adapter t: adapters from tensors carry no adapter file to "
        "check (hash, contract, base model); load it from a directory"
    )
    # An adapter given at start that the lane refuses: the engine does not start.
    with pytest.raises(
        LaneRefused, match="Lockstep exact lane refused adapter c: adapter was made"
    ):
        SglangLaneLoRAManager(_lane_model(tiny), 2, [_ref("c", cases["contract"])])
    with pytest.raises(LaneRefused, match=r"adapter id\(s\) id-x the lane never loaded"):
        manager.prepare_lora_batch(SimpleNamespace(lora_ids=[None, "id-x"]))
    manager.prepare_lora_batch(SimpleNamespace(lora_ids=[None, None]))


def test_the_runner_gets_the_lane_manager_for_a_lane_model_only(
    fake_lora_sglang, tiny, tmp_path, monkeypatch
):
    from lockstep_exact.adapters import make_adapter
    from lockstep_serving.sglang import lora as sglang_lora
    from lockstep_serving.sglang.patches import TABLE

    stock = []
    originals = {"ModelRunner.init_lora_manager": stock.append}
    monkeypatch.setattr(TABLE, "original", originals.__getitem__)
    runner = SimpleNamespace(model=torch.nn.Linear(1, 1), lora_manager=None)
    sglang_lora.init_lora_manager(runner)
    assert stock == [runner] and runner.lora_manager is None
    a = make_adapter(tiny, tmp_path / "A", rank=8)
    fake_lora_sglang.lora_paths = [_ref("A", a)]
    runner = SimpleNamespace(model=_lane_model(tiny), lora_manager=None)
    sglang_lora.init_lora_manager(runner)
    manager = runner.lora_manager
    assert isinstance(manager, sglang_lora.SglangLaneLoRAManager)
    assert manager.max_loras_per_batch == 3 and set(manager.adapters) == {"id-A"}


def test_a_batch_runs_in_adapter_groups_in_batch_order():
    reqs = [(0, 0, 3, 3), (1, 3, 4, 9), (2, 4, 6, 2), (3, 6, 7, 7)]
    fb = SimpleNamespace(lora_ids=["a", None, "b", "a"])
    groups = sglang_model.LockstepQwen3ForCausalLM._adapter_groups(fb, reqs)
    assert groups == {"a": [reqs[0], reqs[3]], None: [reqs[1]], "b": [reqs[2]]}
    assert sglang_model.LockstepQwen3ForCausalLM._adapter_groups(
        SimpleNamespace(lora_ids=None), reqs
    ) == {None: reqs}


def test_a_lane_capture_names_an_adapter_it_never_loaded(tiny):
    lane = object.__new__(sglang_capture.SglangLane)
    lane.model, lane.adapters = sglang_capture.ModelDir(tiny), {}
    with pytest.raises(LaneRefused) as err:
        lane.capture(["hi"], 1, adapter="A")
    assert str(err.value) == "adapter 'A' was not loaded by this lane (load_adapter)"
    refused = SimpleNamespace(success=False, error_message="Lockstep exact lane refused adapter A")
    lane.engine = SimpleNamespace(load_lora_adapter=lambda name, path: refused)
    with pytest.raises(LaneRefused, match="^Lockstep exact lane refused adapter A$"):
        lane.load_adapter(tiny, "A")
    assert lane.adapters == {}


# --- lockstep qualify --sampler sglang: the sampler process and its refusals --------------------
def test_qualify_with_sglang_refuses_what_its_sampler_cannot_run_before_anything(
    tmp_path, capsys, monkeypatch
):
    from lockstep_exact.app.cli import main

    monkeypatch.delenv("LOCKSTEP_SGLANG_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)  # no .venv-sglang here
    base = ["qualify", "--out", str(tmp_path / "q")]
    cases = [
        (
            ["--sampler", "sglang"],
            "--sampler sglang: no python of an sglang environment at "
            ".venv-sglang/bin/python (pass --sampler-python, set LOCKSTEP_SGLANG_PYTHON, or "
            "build .venv-sglang: docs/sglang.md)",
        ),
        (
            ["--sampler", "sglang", "--sampler-python", sys.executable, "--sampler-tp", "2"],
            "--sampler sglang runs on one process: --sampler-tp 1",
        ),
        (
            ["--sampler-python", sys.executable],
            "--sampler-python is for a sampler in another environment (sglang)",
        ),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2
        assert capsys.readouterr().err.strip() == f"lockstep qualify: error: {message}"
    assert not (tmp_path / "q").exists()  # nothing was made


@pytest.mark.slow
def test_the_sampler_process_answers_over_its_pipe_and_names_refusals(tiny):
    """The SGLang worker run by the workspace's python (no SGLang here): the contract comes
    back whole, the rest is refused by name, the process serves on, and a dead one is named."""
    from lockstep_exact.app.sampler_process import SamplerProcess, SamplerRefused
    from lockstep_exact.model import ModelDir

    with SamplerProcess("sglang", Path(sys.executable)) as sampler:
        assert sampler.contract(tiny, "cpu").fingerprint == ModelDir(tiny).contract().fingerprint
        with pytest.raises(SamplerRefused) as err:
            sampler.info()
        assert str(err.value) == (
            f"sglang sampler: RuntimeError: SGLang is not installed for {sys.executable}"
        )
        with pytest.raises(SamplerRefused, match="^sglang sampler: ValueError: unknown request"):
            sampler.call("nothing")
        sampler.proc.stdin.close()
        sampler.proc.wait(timeout=60)
        with pytest.raises(SamplerRefused) as err:
            sampler.call("info")
        assert str(err.value) == (
            f"the sglang sampler process ({sys.executable}) exited with status 0; its output is "
            "in the engine log"
        )


def test_a_failed_gate_with_a_sampler_process_says_its_bisect_was_not_run(tiny, tmp_path):
    from lockstep_exact.app.qualify import Check, Gate, Ladder
    from lockstep_exact.plugins import manager

    sampler = SimpleNamespace(engine="sglang", python=Path("/x/python"), capture=None)
    ladder = Ladder(manager(), tiny, tmp_path, sampler=sampler)
    gate = Gate("base ruler", checks=[Check("c", False, first_difference=3, trace="/t/02-base")])
    ladder._bisect(gate)
    assert gate.bisect == {
        "error": "the first-divergence search needs the sampler's op-site dump, which the "
        "sglang sampler process does not give; not run (decision 3 of 02-base)"
    }


def test_pool_attention_of_one_adapter_group_writes_its_own_slots(fake_pool_module):
    """A group's rows are a subset of the batch: ``loc`` gives their cache slots and the
    requests index the subset (request 1 of the batch, its rows 0..1 here)."""
    pool = _Pool()
    req_to_token = torch.tensor([[3, 0, 0], [5, 11, 0]])
    k = torch.randn(2, 2, 4).to(torch.bfloat16)
    fb = SimpleNamespace(
        out_cache_loc=torch.tensor([3, 5, 11]), req_pool_indices=torch.tensor([0, 1])
    )
    seen = []

    def core(q, keys, values, pos):
        seen.append(keys.clone())
        return q

    q = torch.randn(2, 4, 4).to(torch.bfloat16)
    args = (0, q, k, k, torch.tensor([0, 1]), fb, [(1, 0, 2, 2)], pool, req_to_token)
    out = sglang_model.pool_attention(*args, core=core, loc=torch.tensor([5, 11]))
    assert torch.equal(out, q) and torch.equal(pool.k[5], k[0]) and torch.equal(pool.k[11], k[1])
    assert torch.equal(pool.k[3], torch.zeros(2, 4, dtype=torch.bfloat16))  # not this group's
    assert len(seen) == 1 and torch.equal(seen[0], k)
