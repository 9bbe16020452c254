"""The lane's vLLM architectures: the name each lane model class is registered under, and the
lane class serving each HF architecture (``plugin.register`` registers them; ``offline``,
``sampler`` and ``endpoint`` read them). Imports no vLLM.
"""

from __future__ import annotations

from lockstep_exact.lanes.config import supported_architectures

ARCHITECTURES = {
    "LockstepQwen3ForCausalLM": "lockstep_serving.vllm.model:LockstepQwen3ForCausalLM",
    "LockstepQwen3MoeForCausalLM": "lockstep_serving.vllm.model:LockstepQwen3MoeForCausalLM",
    "LockstepQwen3NextForCausalLM": "lockstep_serving.vllm.next:LockstepQwen3NextForCausalLM",
}
# Every architecture lockstep_exact has a lane for (its one table), served as Lockstep<arch>.
LANE_OF_HF = {hf: f"Lockstep{hf}" for hf in supported_architectures()}
assert set(LANE_OF_HF.values()) == set(ARCHITECTURES), "a lane architecture has no vLLM class"
