"""What the vLLM and SGLang rooms of lockstep_serving both use; imports no engine.

``errors``: the package's exception. ``lane``: the lane model's side shared by both engines'
model classes (the family each lane class serves, the contract asked for, the checkpoint's
tensors). ``capture``: what a capture checks before an engine starts (tokenizer, adapter).
``sampling``: the refusal of a sampling setting the lane's rule does not implement.
"""
