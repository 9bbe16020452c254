"""Part of the torchvision stand-in (see ``torchvision/__init__.py``)."""

from torchvision._placeholder import module_getattr as __getattr__  # noqa: F401
