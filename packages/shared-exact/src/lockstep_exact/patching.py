"""Patch tables: every engine symbol a plugin patches, registers, reads or constructs, in one
checked table that also applies the patches and takes them back.

Both plugins declare their engine surface this way (the serving plugin's vLLM table, the
trainer plugin's megatron-core CPU table). A ``Target`` names a symbol (``module`` plus a
dotted ``symbol`` inside it), why the plugin touches it, and what it relies on: the leading
parameter names of a callable, the fields of a class. A target of kind ``"patch"`` also
carries ``replacement``, a function that builds the new value (called at ``apply`` time, so
the table itself imports nothing heavy; a patch row without one can be checked, not applied).

``PatchTable.problems()`` lists, as sentences, every target that is missing or changed shape
in the installed engine (or an engine version the table was not written for); ``check()``
raises the table's error naming them all (an applied patch is checked on the original it
replaced, so a check after ``apply`` gives the same answer); ``apply()`` checks, then replaces
every patch target, recording the original; ``original()`` gives a recorded original (so a
patch can call through to it); ``restore()`` puts every original back. Nothing here imports an
engine: the engine module is imported only when a table is checked or applied.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

__all__ = ["KINDS", "PatchTable", "PatchTableError", "Target"]

KINDS = ("patch", "register", "read", "construct")
_ABSENT = object()


class PatchTableError(ValueError):
    """A patch table that is itself malformed (unknown kind, a patch without replacement)."""


@dataclass(frozen=True)
class Target:
    module: str
    symbol: str  # dotted inside the module: "Sampler.compute_logprobs"
    kind: str  # "patch" (replaced while applied), "register", "read", "construct"
    why: str
    params: tuple[str, ...] = ()  # leading parameter names the plugin relies on (callables)
    attrs: tuple[str, ...] = ()  # fields / attributes the plugin reads (classes)
    versions: tuple[str, ...] = ()  # engine versions this row was checked on; () = the table's
    replacement: Callable[[], Any] | None = None  # kind "patch": builds the new value
    may_be_absent: bool = False  # the symbol exists only with an optional library

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PatchTableError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.kind != "patch" and self.replacement is not None:
            raise PatchTableError(
                f"{self.name}: only 'patch' targets carry a replacement, this one is {self.kind!r}"
            )
        if not self.why:
            raise PatchTableError(f"{self.name}: say why the plugin touches it")

    @property
    def name(self) -> str:
        return f"{self.module}.{self.symbol}"

    def parent_and_attr(self) -> tuple[Any, str]:
        """The object holding the symbol, and the symbol's last name (imports the module)."""
        obj = importlib.import_module(self.module)
        *path, last = self.symbol.split(".")
        for part in path:
            obj = getattr(obj, part)
        return obj, last

    def resolve(self) -> Any:
        parent, attr = self.parent_and_attr()
        return getattr(parent, attr)


class PatchTable:
    """The targets of one plugin on one engine; checks, applies and restores them."""

    def __init__(
        self,
        engine: str,
        version_module: str,
        versions: tuple[str, ...],
        targets: tuple[Target, ...],
        *,
        error: type[Exception] = RuntimeError,
        refusal: str = "",
        source: str = "",
    ) -> None:
        names = [t.name for t in targets]
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise PatchTableError(f"the {engine} patch table lists {doubled} more than once")
        self.engine = engine
        self.version_module = version_module  # its __version__ is the engine version
        self.versions = versions
        self.targets = tuple(targets)
        self.error = error
        self.refusal = refusal or f"this {engine} does not fit the plugin's patch table"
        self.source = source
        self._originals: dict[str, tuple[Any, str, Any, Any]] = {}

    # -- a table reads like the tuple of its targets -----------------------------------------
    def __iter__(self) -> Iterator[Target]:
        return iter(self.targets)

    def __len__(self) -> int:
        return len(self.targets)

    def __add__(self, more: tuple[Target, ...]) -> PatchTable:
        return self.with_targets(self.targets + tuple(more))

    def with_targets(self, targets: tuple[Target, ...]) -> PatchTable:
        """A table like this one (engine, versions, error) over other targets. Patches this
        table has applied stay recorded in the new one for the targets they share (so it
        checks them on their originals, and can restore them)."""
        table = PatchTable(
            self.engine,
            self.version_module,
            self.versions,
            targets,
            error=self.error,
            refusal=self.refusal,
            source=self.source,
        )
        names = {t.name for t in table.targets}
        table._originals = {k: v for k, v in self._originals.items() if k in names}
        return table

    # -- check ---------------------------------------------------------------------------------
    def installed_version(self) -> str:
        return getattr(importlib.import_module(self.version_module), "__version__", "?")

    def problems(self) -> list[str]:
        """Every target that is missing or changed shape in the installed engine, as sentences."""
        version = self.installed_version()
        out = []
        for t in self.targets:
            where = f"{t.name} ({t.kind}: {t.why})"
            versions = t.versions or self.versions
            if version not in versions:
                out.append(
                    f"{where}: {self.engine} {version} is not among the supported {versions}"
                )
                continue
            try:
                # An applied patch is checked on what it replaced: the engine's own symbol.
                applied = self._originals.get(t.name)
                obj = applied[3] if applied is not None else t.resolve()
            except (ImportError, AttributeError) as err:
                if not t.may_be_absent:
                    out.append(f"{where}: missing ({err})")
                continue
            if t.params:
                try:
                    names = tuple(inspect.signature(obj).parameters)
                except (TypeError, ValueError) as err:
                    out.append(f"{where}: no signature ({err})")
                    continue
                if names[: len(t.params)] != t.params:
                    out.append(f"{where}: parameters {names} do not start with {t.params}")
            if t.attrs:
                have = (
                    {f.name for f in fields(obj)} if is_dataclass(obj) else set(dir(obj))
                ) | set(getattr(obj, "__annotations__", {}))
                missing = [a for a in t.attrs if a not in have]
                if missing:
                    out.append(f"{where}: lacks field(s) {missing}")
        return out

    def check(self) -> None:
        """Raise the table's error naming every target the installed engine lacks."""
        found = self.problems()
        if found:
            see = f" (see {self.source})" if self.source else ""
            raise self.error(f"{self.refusal}: " + "; ".join(found) + see)

    # -- apply / restore -----------------------------------------------------------------------
    @property
    def applied(self) -> bool:
        return bool(self._originals)

    def apply(self) -> None:
        """Check, then replace every ``patch`` target, recording its original. Idempotent."""
        if self.applied:
            return
        bare = [t.name for t in self.targets if t.kind == "patch" and t.replacement is None]
        if bare:
            raise PatchTableError(f"patch target(s) {bare} have no replacement to apply")
        self.check()
        done: dict[str, tuple[Any, str, Any, Any]] = {}
        try:
            for t in self.targets:
                if t.kind != "patch":
                    continue
                parent, attr = t.parent_and_attr()
                own = vars(parent) if hasattr(parent, "__dict__") else {}
                raw = own.get(attr, _ABSENT)  # inherited or absent: deleted on restore
                done[t.name] = (parent, attr, raw, getattr(parent, attr, None))
                setattr(parent, attr, t.replacement())
        except BaseException:
            self._put_back(done)
            raise
        self._originals = done

    def original(self, name: str) -> Any:
        """The value a patch replaced, by the target's ``module.symbol`` or its ``symbol``.

        It is what attribute access gave before the patch (a staticmethod's function, an
        inherited method); None for a symbol that was absent."""
        for key, (_, _, _, value) in self._originals.items():
            if key == name or key.endswith("." + name):
                return value
        raise KeyError(f"{name} is not a patch of the applied {self.engine} table")

    def restore(self) -> None:
        """Put back every original, in reverse order of application."""
        done, self._originals = self._originals, {}
        self._put_back(done)

    @staticmethod
    def _put_back(done: dict[str, tuple[Any, str, Any, Any]]) -> None:
        for parent, attr, raw, _ in reversed(list(done.values())):
            if raw is _ABSENT:
                if attr in getattr(parent, "__dict__", {}):
                    delattr(parent, attr)
            else:
                setattr(parent, attr, raw)


def installed_table(module_globals: dict, choose: Callable[[], PatchTable]):
    """``(__getattr__, table)`` for a plugin module whose ``TABLE`` is the installed engine's,
    chosen on first use by ``choose()``: importing the module imports no engine (an engine's
    environment must be set before the engine is first imported). Assign the first to the
    module's ``__getattr__``; ``table()`` returns ``TABLE`` (a test may have replaced it)."""

    def __getattr__(name: str):
        if name == "TABLE":
            module_globals["TABLE"] = chosen = choose()
            return chosen
        raise AttributeError(f"module {module_globals['__name__']!r} has no attribute {name!r}")

    def table() -> PatchTable:
        current = module_globals.get("TABLE")
        return current if current is not None else __getattr__("TABLE")

    return __getattr__, table
