"""The fla bypass: megatron-core's GatedDeltaNet refuses to build without ``fla`` although
building it uses none of fla; the lane's classes pass that check for their own construction
only, and their forward runs inside the lane composition (neither fla's kernels nor
causal-conv1d are imported or called)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def _fla_check_passed(module):
    """GatedDeltaNet.__init__ raises unless fla imported; nothing it builds uses fla. For the
    construction only, its module reads as if it had (fla itself is never imported)."""
    saved = module.HAVE_FLA
    module.HAVE_FLA = True
    try:
        yield
    finally:
        module.HAVE_FLA = saved


def _composition_only(self, *args, **kwargs):
    raise RuntimeError(
        f"{type(self).__name__} runs inside the lane composition (ExactNextLayer), not alone"
    )
