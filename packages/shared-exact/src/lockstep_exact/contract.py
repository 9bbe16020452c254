"""Contracts: a lane's programs, geometry and environment pins, fingerprinted.

Both halves compute the contract of the lane they run. ``admit`` compares two contracts and
fails closed, naming the first op site (or geometry field, or pin) where they differ.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import __version__
from .programs import Program

CONTRACT_FORMAT = "lockstep.contract/1"


class ContractMismatch(RuntimeError):
    """Two halves would not run the same byte programs."""


def environment_pins(backend: str, machine: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the bytes of ``backend`` depend on besides the programs themselves.

    The cpu backend is built from IEEE-exact operations only, so its bytes depend on the
    program definitions (pinned by the lockstep-exact version), not on torch or the CPU.
    The cuda backend depends on the GPU architecture and the kernel compiler as well: this
    machine's (``programs.cuda.environment``), or ``machine``, the same keys recorded
    elsewhere (the contract lock's, so that a machine without the backend can still make
    its contracts).
    """
    pins = {"lockstep_exact": __version__, "backend": backend}
    if machine is not None:
        pins.update(machine)
    elif backend == "cuda":
        # The cuda backend needs triton, which a cpu-only install lacks: an optional backend,
        # imported only when asked for (as the programs' dispatch does).
        from .programs.cuda import environment

        pins.update(environment())
    return pins


@dataclass(frozen=True)
class Contract:
    lane: str
    dtype: str
    backend: str
    layout: Mapping[str, int]
    geometry: Mapping[str, object]
    sites: Mapping[str, Program]
    pins: Mapping[str, str] = field(default_factory=dict)
    # An invoked contract's record of the kernels each site ran (``programs.kernels``): site
    # key -> sorted kernel names. Outside the fingerprint: gated forms give the same bytes, and
    # two halves may run different ones (a 256-row prefill and a one-row decode, say).
    kernels: Mapping[str, tuple[str, ...]] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict:
        """The contract's JSON form, with ``kernels`` where a record was made."""
        out = self._fingerprinted()
        if self.kernels:
            out["kernels"] = {k: list(self.kernels[k]) for k in sorted(self.kernels)}
        return out

    def _fingerprinted(self) -> dict:
        return {
            "format": CONTRACT_FORMAT,
            "lane": self.lane,
            "dtype": self.dtype,
            "backend": self.backend,
            "layout": dict(sorted(self.layout.items())),
            "geometry": dict(sorted(self.geometry.items())),
            "sites": {k: self.sites[k].ident for k in sorted(self.sites)},
            "pins": dict(sorted(self.pins.items())),
        }

    def canonical(self) -> bytes:
        """Sorted keys, no whitespace, ASCII: the bytes that are fingerprinted."""
        return json.dumps(self._fingerprinted(), sort_keys=True, separators=(",", ":")).encode(
            "ascii"
        )

    @property
    def fingerprint(self) -> str:
        return "sha256:" + hashlib.sha256(self.canonical()).hexdigest()

    def with_sites(self, sites: Mapping[str, Program]) -> Contract:
        """The same lane, geometry and pins with other op sites (an invoked contract); the
        kernel record keeps the sites that remain."""
        sites = dict(sites)
        kernels = {k: v for k, v in self.kernels.items() if k in sites}
        return Contract(
            self.lane, self.dtype, self.backend, self.layout, self.geometry, sites, self.pins,
            kernels,
        )  # fmt: skip

    @property
    def short(self) -> str:
        return self.fingerprint[len("sha256:") :][:12]


def first_difference(local: Contract, remote: Contract) -> str | None:
    """A sentence naming the first place two contracts differ, in a fixed order."""
    a, b = local.to_json(), remote.to_json()
    for key in ("format", "lane", "dtype", "backend"):
        if a[key] != b[key]:
            return f"{key}: local {a[key]!r} vs remote {b[key]!r}"
    for section, what in (
        ("sites", "op site"),
        ("geometry", "geometry"),
        ("layout", "layout"),
        ("pins", "environment pin"),
    ):
        for k in sorted(set(a[section]) | set(b[section])):
            va, vb = a[section].get(k, "<absent>"), b[section].get(k, "<absent>")
            if va != vb:
                return f"{what} {k!r}: local {va} vs remote {vb}"
    return None


def admit(local: Contract, remote: Contract | Mapping | str) -> None:
    """Pass only if ``remote`` is the same contract; otherwise raise, naming the difference.

    ``remote`` may be a Contract, its JSON form, or only a fingerprint string (then the
    difference cannot be located, only detected).
    """
    if isinstance(remote, str):
        if remote != local.fingerprint:
            raise ContractMismatch(
                f"contract fingerprint {remote} does not match this lane's {local.fingerprint} "
                f"({local.lane}); run `lockstep contract show` on both halves to see where"
            )
        return
    if isinstance(remote, Mapping):
        remote = contract_from_json(remote)
    where = first_difference(local, remote)
    if where is not None:
        raise ContractMismatch(f"contracts differ at {where}; the halves would not be exact")


def contract_from_json(data: Mapping) -> Contract:
    if data.get("format") != CONTRACT_FORMAT:
        raise ContractMismatch(f"unknown contract format {data.get('format')!r}")
    sites = {k: _parse_ident(v) for k, v in data["sites"].items()}
    kernels = data.get("kernels", {})
    if not isinstance(kernels, Mapping) or not all(
        isinstance(v, list) and all(isinstance(x, str) for x in v) for v in kernels.values()
    ):
        raise ContractMismatch("the contract's kernels must map op sites to lists of names")
    return Contract(
        lane=data["lane"],
        dtype=data["dtype"],
        backend=data["backend"],
        layout=dict(data["layout"]),
        geometry=dict(data["geometry"]),
        sites=sites,
        pins=dict(data["pins"]),
        kernels={k: tuple(v) for k, v in kernels.items()},
    )


def _parse_ident(ident: str) -> Program:
    name, rest = ident.split("@", 1)
    version, inner = rest.split("{", 1)
    params = []
    for item in filter(None, inner.rstrip("}").split(",")):
        k, v = item.split("=", 1)
        params.append((k, _parse_value(v)))
    return Program(name, int(version), tuple(params))


def _parse_value(text: str):
    if text in ("True", "False"):
        return text == "True"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def make_contract(
    geom,
    sites: Mapping[str, Program],
    *,
    k_parts: int,
    backend: str,
    tp: int,
    ep: int,
    machine: Mapping[str, str] | None = None,
) -> Contract:
    """A lane's contract: the lane of ``geom``'s family in bf16 on ``backend``, its op
    ``sites``, ``k_parts`` canonical K partitions and the environment pins; the layout
    (``tp``, ``ep``) is checked. Each lane (``lanes.qwen3``, ``lanes.qwen3_next``) states its
    own sites through it; ``model.geometry_contract`` picks the lane of a geometry. ``machine``:
    recorded pins in place of this machine's (``environment_pins``)."""
    contract = Contract(
        lane=f"{geom.family}/bf16/{backend}",
        dtype="bf16",
        backend=backend,
        layout={"k_parts": k_parts},
        geometry=geom.as_dict(),
        sites=sites,
        pins=environment_pins(backend, machine),
    )
    check_layout(contract, tp=tp, ep=ep)
    return contract


class LayoutRefused(ContractMismatch):
    """A tensor- or expert-parallel size the lane's contract cannot run with one device's
    bytes."""


def check_layout(contract: Contract, *, tp: int = 1, ep: int = 1) -> None:
    """Refuse, naming both numbers, a layout that does not divide what it splits: every
    row-parallel site's K partitions, the heads, the kv heads, the MLP width (tp); the experts
    (ep). The layout is not part of the contract: one contract admits every layout that
    divides it."""
    g = contract.geometry
    for name, value in (("tp", tp), ("ep", ep)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LayoutRefused(f"layout: {name} must be an int >= 1, got {value!r}")
    if tp > 1:
        for key, prog in sorted(contract.sites.items()):
            if prog.name == "gemm.kpart" and prog.param("parts") % tp:
                raise LayoutRefused(
                    f"layout: tp {tp} does not divide the {prog.param('parts')} K partitions of "
                    f"op site {key!r} ({prog.ident})"
                )
        width = "moe_intermediate" if g.get("experts") else "intermediate"
        for what in ("heads", "kv_heads", width):
            if int(g[what]) % tp:
                raise LayoutRefused(
                    f"layout: tp {tp} does not divide the model's {what} ({g[what]})"
                )
    if ep > 1:
        if not g.get("experts"):
            raise LayoutRefused(f"layout: ep {ep} needs a MoE model; this one has no experts")
        if int(g["experts"]) % ep:
            raise LayoutRefused(
                f"layout: ep {ep} does not divide the model's {g['experts']} experts"
            )
