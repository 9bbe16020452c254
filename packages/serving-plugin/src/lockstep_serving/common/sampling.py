"""The lane's sampling rule, and the refusal of a setting it does not implement (both rooms)."""

from __future__ import annotations

from lockstep_exact import programs as P

RULE = P.Program.of("sample.gumbel_topp")


_INT64 = (-(2**63), 2**63 - 1)


def refusal_text(found: tuple | None) -> str | None:
    """The refusal of a request whose sampling setting (name, value, why) the lane does not
    run, or None; shared by the vLLM and SGLang halves."""
    if found is None:
        return None
    name, value, why = found
    return (
        f"Lockstep exact lane: {name}={value!r} is not supported: it would change the token "
        f"distribution ({why}), and the lane draws every token with {RULE.ident} "
        "(temperature and top_p only)"
    )
