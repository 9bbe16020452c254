"""Stand-in for ``torchvision`` in SGLang's CPU environment (Lockstep exact lane).

transformers refuses SGLang's image-processor registrations (run when SGLang is imported)
unless a module named ``torchvision`` can be found; the PyPI torchvision wheels are built
against CUDA torch and fail to import beside the CPU torch. The lane serves text models only:
every attribute of these modules is an inert placeholder class, and constructing or calling
one raises, naming the attribute.
"""

from __future__ import annotations

from torchvision._placeholder import module_getattr as __getattr__  # noqa: F401

__version__ = "0.0.0+lockstep.standin"
