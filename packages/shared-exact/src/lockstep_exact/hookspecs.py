"""The plugin API: what the ``lockstep`` CLI asks of engine plugins.

A plugin is a module (or object) registered under the entry-point group ``lockstep``; it
implements some of the hooks below with ``@lockstep_exact.hookimpl``. A serving plugin
(``role = "sampler"``) answers the sampler hooks, a trainer plugin (``role = "trainer"``)
the trainer hooks. The CLI never imports a plugin by name: it asks these hooks, and a hook no
installed plugin answers is reported as "missing the sampler (or trainer) half".

Requests and results are the plain dataclasses of ``lockstep_exact.requests``.
"""

from __future__ import annotations

import pluggy

PROJECT = "lockstep"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def lockstep_engine_info():
    """Called by ``lockstep doctor`` and before every job.

    Return an ``EngineInfo`` (role, engine name and version, plugin version, backends it can
    run), or None when the plugin's engine is not importable here (say why in ``problem``).
    Every installed plugin answers; the results come back as a list.
    """


@hookspec(firstresult=True)
def lockstep_sampler_contract(model_dir, adapter_dir, backend):
    """The contract the sampler half would run for this model (and adapter) on ``backend``.

    Return a ``Contract``; raise ``UnsupportedModel`` (naming the feature) if the model cannot
    run on an exact lane. Answered by the serving plugin.
    """


@hookspec(firstresult=True)
def lockstep_trainer_contract(model_dir, adapter_dir, backend):
    """The contract the trainer half would run; same rules as the sampler's."""


@hookspec(firstresult=True)
def lockstep_capture(request):
    """Sample with the real serving engine and record what it decided.

    ``request`` is a ``CaptureRequest`` (model, adapter, prompts, decisions per prompt,
    seed, expected contract fingerprint). Return a ``Trace`` whose logprobs are the raw FP32
    bytes the engine reported. Must refuse (raise) when the engine's lane contract differs
    from ``request.contract``. Answered by the serving plugin.
    """


@hookspec(firstresult=True)
def lockstep_replay(request):
    """Recompute every decision of a trace in the trainer (teacher forcing).

    ``request`` is a ``ReplayRequest`` (model, adapter, trace). Admission first: a trace whose
    contract fingerprint, model hash or adapter hash differs from the trainer's is refused
    with an error naming which. Return a ``ReplayResult`` holding the trainer's FP32
    logprob per decision, in the trace's decision order. Answered by the trainer plugin.
    """


@hookspec(firstresult=True)
def lockstep_dump_sites(request):
    """For one decision, return ``{op_site_path: tensor}`` of every op site's output.

    ``request`` is a ``DumpRequest`` (model, adapter, token ids, position). Used by
    ``lockstep bisect`` on both halves. Answered by each plugin for its ``request.role``.
    """


@hookspec(firstresult=True)
def lockstep_train_step(request):
    """Run training steps on a LoRA adapter with the backbone frozen.

    ``request`` is a ``TrainRequest`` (model, adapter in/out, trace to learn from, steps,
    learning rate, checkpoint dir, one advantage per trace sequence). Return a
    ``TrainResult`` (losses, backbone hash before and after, the exported adapter directory).
    Answered by the trainer plugin, through the same trainer session as
    ``lockstep_trainer_session`` (one training stack).
    """


@hookspec(firstresult=True)
def lockstep_sampler_session(request):
    """Start a long-lived sampler on the exact lane (``lockstep train``).

    ``request`` is a ``SamplerSessionRequest``. Return an object with
    ``sample(prompts, decisions, seed, adapter_dir=None) -> Trace`` (every new adapter
    directory is loaded into the running engine under a new adapter id: no restart),
    ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``starts`` (engines started: 1)
    and ``close()``. Answered by the serving plugin.
    """


@hookspec(firstresult=True)
def lockstep_trainer_session(request):
    """Build a long-lived trainer model (``lockstep train``).

    ``request`` is a ``TrainerSessionRequest``. A ``policy`` session holds LoRA adapters and
    their optimizer: ``export(dir) -> (path, hash)``, ``logprobs(trace)`` (admits the trace
    against the last export and the lane, checks its tokens against the sampling rule, returns
    fp32 logprobs per decision), ``update(seqs, old, loss, inner_steps) -> losses`` (refuses
    to run a backward pass unless its forward reproduces ``old`` byte for byte),
    ``state_files()`` / ``load_state_files(files)`` (a checkpoint), ``backbone_hash()``. A
    ``frozen`` session scores traces (``logprobs(trace)``) and reports ``backbone_hash()``.
    Answered by the trainer plugin.
    """


@hookspec(firstresult=True)
def lockstep_reward(completion):
    """The reward of one sampled completion (a float), for ``lockstep train --reward hook``.

    ``completion`` is a ``lockstep_exact.app.rewards.Completion`` (prompt text and ids, sampled
    ids and text, the data row it came from). Return None to leave it to another plugin.
    """


@hookspec(firstresult=True)
def lockstep_load_adapter(adapter_dir, model_dir, role):
    """Validate an adapter directory for ``role`` and return its hash.

    Must refuse (raise ``AdapterError``) a corrupted or edited file, a dtype other than bf16,
    an orphan factor, a rank or target module the lane does not cover, a PEFT feature it does
    not implement, or a contract fingerprint or base model hash other than the lane's. The
    hash covers the factors and the adapter config's numeric fields (``adapters.load_adapter``);
    adapters made by ``peft`` are accepted and hashed on load.
    """


@hookspec(firstresult=True)
def lockstep_serve_command(request):
    """The command line and environment that start the engine's OpenAI-compatible server on
    the lane (``requests.ServeRequest``): ``(argv, env)``. Must refuse (``ValueError``) engine
    flags that would take the lane's place, naming the flag."""


@hookspec(firstresult=True)
def lockstep_verify(request):
    """Recompute a rollout file's sampled log-probabilities in the trainer on the lane
    (``requests.VerifyRequest``) and compare them on their bytes: a dict with ``equal``,
    ``sequences``, ``decisions``, ``byte_equal``, ``first_difference`` (None or a dict with
    ``sequence``, ``position``, ``sampler``, ``trainer``), ``k3_max`` and ``max_ulp``."""
