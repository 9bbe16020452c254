"""The placeholder every attribute of the torchvision stand-in resolves to."""

from __future__ import annotations


class _Inert(type):
    """Attribute access on a placeholder class gives another placeholder (type hints, enums)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls.__name__}.{name}")


def placeholder(name: str) -> type:
    def refuse(self, *args, **kwargs):
        raise RuntimeError(
            f"torchvision.{name} is a stand-in: torchvision is not installed in this environment "
            "(the Lockstep exact lane on SGLang serves text models only)"
        )

    return _Inert(name, (), {"__init__": refuse, "__call__": refuse})


def module_getattr(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(name)
