"""Op-site dumps for bisect: the trainer records the composition's sites, byte for byte."""

from __future__ import annotations

import torch

from lockstep_exact.app.bisect import first_divergence
from lockstep_exact.lanes import qwen3
from lockstep_exact.plugins import manager
from lockstep_exact.requests import DumpRequest
from lockstep_exact.sites import recording
from lockstep_megatron import plugin
from lockstep_megatron.convert import load_hf_weights

TOKENS = tuple(range(3, 90, 3))


def _trainer_sites(model_dir, position):
    pm = manager(load_entry_points=False)
    pm.register(plugin)
    req = DumpRequest(role="trainer", model_dir=model_dir, tokens=TOKENS, position=position)
    return pm.hook.lockstep_dump_sites(request=req)


def test_trainer_sites_are_the_reference_sites_byte_for_byte(model_dir):
    trainer = _trainer_sites(model_dir, 20)
    weights = load_hf_weights(model_dir)
    geom = qwen3.Geometry.from_model_dir(model_dir)
    with recording() as reference:
        qwen3.forward_logprobs(weights, geom, torch.tensor(TOKENS[:21]))
    divergence, missing = first_divergence(reference, trainer)
    assert divergence is None and missing == []
    assert len(trainer) == len(reference) > 10 * geom.layers


def test_bisect_names_the_first_site_a_one_ulp_change_reaches(dense_dir):
    trainer = _trainer_sites(dense_dir, 20)
    weights = load_hf_weights(dense_dir)
    geom = qwen3.Geometry.from_model_dir(dense_dir)
    w = weights["model.layers.1.mlp.down_proj.weight"]
    w.view(torch.int16)[w.float().abs().argmax() // w.shape[1], :] += 1  # one ulp, one row
    with recording() as reference:
        qwen3.forward_logprobs(weights, geom, torch.tensor(TOKENS[:21]))
    divergence, _ = first_divergence(reference, trainer)
    assert divergence is not None and divergence.site == "layers.1.mlp.down_proj"


def test_dump_sites_answers_only_for_the_trainer_role(dense_dir):
    req = DumpRequest(role="sampler", model_dir=dense_dir, tokens=(1, 2), position=1)
    assert plugin.lockstep_dump_sites(req) is None
