"""The HTML report of a ``lockstep train`` run: reward and K3 over steps, and every step's row.

Self-contained (inline SVG, no scripts, no fetched assets), rewritten after every step, so
the file open in a browser is the run so far.
"""

from __future__ import annotations

import html
import math

WIDTH, HEIGHT, PAD = 720, 200, 40


def _scale(values: list[float], lo: float | None = None, hi: float | None = None):
    lo = min(values) if lo is None else lo
    hi = max(values) if hi is None else hi
    if hi <= lo:
        hi = lo + 1.0
    return lo, hi


def _plot(title: str, steps: list[int], series: list[tuple[str, str, list[float]]], log=False):
    """One SVG line chart: ``series`` is (name, colour, values per step)."""
    if not steps:
        return ""
    values = [v for _, _, vs in series for v in vs if v is not None and math.isfinite(v)]
    if log:
        floor = -12.0
        pos = [math.log10(v) for v in values if v > 0]
        lo, hi = floor, max([-1.0, *pos])

        def tr(v):
            return floor if v <= 0 else max(floor, math.log10(v))
    else:
        lo, hi = _scale(values or [0.0])

        def tr(v):
            return v

    span = max(len(steps) - 1, 1)

    def x(i):
        return PAD + (WIDTH - 2 * PAD) * i / span

    def y(v):
        return HEIGHT - PAD - (HEIGHT - 2 * PAD) * (tr(v) - lo) / (hi - lo)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}">',
        f'<text x="{PAD}" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>',
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" '
        'stroke="#999"/>',
        f'<text x="2" y="{HEIGHT - PAD + 4}" font-size="10">{"0" if log else f"{lo:.3g}"}</text>',
        f'<text x="2" y="{PAD + 4}" font-size="10">{f"1e{hi:.0f}" if log else f"{hi:.3g}"}</text>',
        f'<text x="{WIDTH / 2 - 20}" y="{HEIGHT - 8}" font-size="11">step</text>',
    ]
    for k, (name, colour, vs) in enumerate(series):
        pts = [(x(i), y(v)) for i, v in enumerate(vs) if v is not None and math.isfinite(v)]
        if len(pts) > 1:
            path = " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
            out.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}"/>'
            )
        for (a, b), step, v in zip(pts, steps, vs, strict=False):
            out.append(
                f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{colour}">'
                f"<title>step {step}: {name} = {v:.6g}</title></circle>"
            )
        out.append(
            f'<text x="{WIDTH - PAD - 120}" y="{16 + 14 * k}" font-size="11" '
            f'fill="{colour}">{html.escape(name)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def render(rows: list[dict], identity: dict, stopped: str | None = None) -> str:
    esc = html.escape
    steps = [r["step"] for r in rows]
    exact = all(r.get("equal") == r.get("decisions") for r in rows)
    algo = identity.get("setting.algo", "?")
    if stopped:
        verdict, colour = "STOPPED", "#c22"
    elif rows and exact:
        verdict, colour = "exact at every step", "#2a2"
    else:
        verdict, colour = "no steps yet", "#666"
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>Lockstep train</title>"
        "<style>body{font-family:sans-serif;max-width:980px;margin:2em auto}"
        "td,th{padding:2px 8px;text-align:right}table{border-collapse:collapse}"
        "tr:nth-child(even){background:#f4f4f4}</style></head><body>",
        f"<h1>Lockstep train ({esc(str(algo))}): <span style='color:{colour}'>{verdict}</span>"
        "</h1>",
    ]
    if stopped:
        out.append(f"<p style='color:#c22'>{esc(stopped)}</p>")
    out.append("<p>")
    for key in ("model_hash", "contract", "reward_function", "teacher_hash"):
        if identity.get(key):
            out.append(f"{esc(key)} <code>{esc(str(identity[key]))}</code><br>")
    settings = {k.removeprefix("setting."): v for k, v in identity.items() if "setting." in k}
    out.append(
        "settings <code>"
        + esc(", ".join(f"{k}={v}" for k, v in settings.items() if v is not None))
        + "</code></p>"
    )
    series = [("reward_mean", "#2364aa", [r.get("reward_mean") for r in rows])]
    if any(r.get("reverse_kl") is not None for r in rows):
        series.append(("reverse KL", "#aa6f23", [r.get("reverse_kl") for r in rows]))
    title = "reward over steps"
    if algo == "sft":  # measured on the sampled probe; SFT does not optimize it
        title = "reward of the sampled probe over steps (sft does not optimize it)"
    out.append(_plot(title, steps, series))
    out.append(
        _plot(
            "K3 max over steps (log scale; 0 on the floor line: byte-equal)",
            steps,
            [("k3_max", "#2a2" if exact else "#c22", [r.get("k3_max", 0.0) for r in rows])],
            log=True,
        )
    )
    cols = [
        "step",
        "reward_mean",
        "equal",
        "decisions",
        "k3_max",
        "loss",
        "kl",
        "reverse_kl",
        "seconds",
        "adapter_out",
    ]
    out.append("<table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>")
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)))
        out.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
    out.append("</table></body></html>\n")
    return "".join(out)
