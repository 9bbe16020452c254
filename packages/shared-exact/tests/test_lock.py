"""The contract lock catches a changed rounding without a version bump, naming the program."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lockstep_exact import programs as P
from lockstep_exact.app import lock
from lockstep_exact.golden import golden
from lockstep_exact.parity import bytes_sha256

LOCK_PATH = Path(__file__).resolve().parents[3] / "tools" / "contracts.lock"


def test_committed_lock_matches_the_cpu_programs():
    assert lock.check(lock.read(LOCK_PATH), "cpu") == []


def test_changed_rounding_without_a_version_bump_fails_naming_the_program(monkeypatch):
    from lockstep_exact.programs.cpu.arith import round_bf16, tree_sum

    def truncating_rmsnorm(x, w, eps):  # the last rounding truncates instead of RNE
        xf = x.float()
        inv = 1.0 / torch.sqrt(tree_sum(xf * xf) / float(x.shape[-1]) + torch.tensor(eps))
        prod = round_bf16(xf * inv[..., None]).float() * w.float()
        return (prod.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)

    monkeypatch.setattr(P.cpu, "rmsnorm", truncating_rmsnorm)
    problems = lock.check(lock.read(LOCK_PATH), "cpu")
    assert problems, "the lock check did not notice a changed rounding"
    assert all("rmsnorm.qwen3" in p for p in problems)
    assert "without a version bump" in problems[0]


def test_version_bump_without_a_lock_update_fails_naming_the_program(monkeypatch):
    version, params = P.CATALOG["moe.fold"]
    monkeypatch.setitem(P.CATALOG, "moe.fold", (version + 1, params))
    problems = lock.check(lock.read(LOCK_PATH), "cpu")
    assert any(p.startswith("program moe.fold is moe.fold@2") for p in problems)
    assert any("regenerate the lock" in p for p in problems)


def test_a_lane_contract_change_shows_on_the_cuda_lanes_without_a_gpu(monkeypatch):
    """The lock records the machine its cuda goldens were made on, so a cpu machine remakes
    the cuda lanes' fingerprints: a contract change fails here, naming cuda, and --update's
    merge brings those lanes along (their goldens stay as the GPU made them)."""
    from lockstep_exact.lanes import qwen3

    committed = lock.read(LOCK_PATH)
    assert committed["machines"]["cuda"]["capability"].startswith("sm_")
    monkeypatch.setattr(qwen3, "K_PARTS", qwen3.K_PARTS * 2)
    problems = lock.check(committed, "cpu")
    assert any(p.startswith("lane tiny-qwen3 on cuda") for p in problems), problems
    assert any(p.startswith("lane tiny-qwen3 fingerprint") for p in problems)  # cpu's own
    merged = lock.merge(committed, lock.build("cpu"), "cpu")
    assert lock.check(merged, "cpu") == []
    assert merged["lanes"]["cuda"]["tiny-qwen3"] != committed["lanes"]["cuda"]["tiny-qwen3"]
    for name, entry in committed["programs"].items():
        assert merged["programs"][name]["golden"].get("cuda") == entry["golden"].get("cuda")


def test_the_recorded_cuda_machine_is_what_the_cuda_lanes_are_made_with():
    """The control of the check above: the same lock with another compiler recorded for its
    cuda machine no longer matches its own cuda lanes."""
    moved = lock.read(LOCK_PATH)
    moved["machines"]["cuda"]["triton"] = "3.7.0"
    problems = lock.check(moved, "cpu")
    assert problems and all(" on cuda " in p for p in problems), problems


def test_golden_inputs_do_not_depend_on_the_torch_random_generator():
    torch.manual_seed(12345)
    pinned = "9e1748d691ea51cca3bda60b535c88f571d5fe6c9d8b3aa683d8b81345039d01"
    assert bytes_sha256(golden((4, 8), seed=1)) == pinned
    assert bytes_sha256(golden((4, 8), seed=2)) != pinned


@pytest.mark.gpu
def test_committed_lock_matches_the_cuda_programs():
    assert lock.check(lock.read(LOCK_PATH), "cuda") == []
    # the machine pins name the architecture and compilers, not the card
    assert set(lock.machine_pins("cuda")) == {"backend", "capability", "torch", "triton", "cuda"}
