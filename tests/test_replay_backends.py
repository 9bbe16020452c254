"""Replay's backends: cpu at any layout, cuda on one GPU (issue 11); others refused by name."""

from __future__ import annotations

import pytest
import torch

from lockstep_megatron.replay import check_replay_backend


def test_replay_refuses_a_backend_without_programs():
    with pytest.raises(NotImplementedError) as err:
        check_replay_backend("tpu")
    assert str(err.value) == "the Megatron exact lane runs on cpu or cuda, not 'tpu'"
    check_replay_backend("cpu", 4)  # cpu at any layout


def test_replay_on_cuda_runs_on_one_gpu(monkeypatch):
    with pytest.raises(NotImplementedError) as err:
        check_replay_backend("cuda", 2)
    assert str(err.value) == "replay on cuda runs on one GPU here (tp x ep = 1), not 2 ranks"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NotImplementedError) as err:
        check_replay_backend("cuda")
    assert str(err.value) == "replay on cuda: no CUDA device here"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_replay_backend("cuda", 1)
