"""The qualification report: report.json, report.html (a plot per check), a terminal table."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from .qualify import Report


def write(report: Report, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = report.as_json()
    jpath = out_dir / "report.json"
    jpath.write_text(json.dumps(data, indent=2) + "\n")
    hpath = out_dir / "report.html"
    hpath.write_text(render_html(data))
    return jpath, hpath


def layout_line(layouts: dict) -> str:
    """The halves' layouts on one line: "sampler tp 2; trainer tp 1 ep 2"."""
    return "; ".join(
        f"{half} " + " ".join(f"{k} {v}" for k, v in sizes.items())
        for half, sizes in layouts.items()
    )


def engines_line(engines: list[dict]) -> str:
    """Each engine with its version and torch's: "sampler vllm 0.26.0 (torch 2.11.0); ..."."""
    parts = []
    for e in engines:
        torch_v = e.get("torch_version")
        parts.append(
            f"{e.get('role')} {e.get('engine')} {e.get('engine_version') or '(not importable)'}"
            + (f" (torch {torch_v})" if torch_v else "")
        )
    return "; ".join(parts)


def table(report: Report) -> str:
    rows = [("gate", "check", "decisions", "byte-equal", "K3 max", "result")]
    for g in report.gates:
        for c in g.checks:
            result = ("pass" if c.passed else "FAIL") + ("" if c.expect_exact else " (control)")
            rows.append(
                (
                    g.name,
                    c.what,
                    str(c.decisions or "-"),
                    str(c.byte_equal) if c.decisions else "-",
                    f"{c.k3_max:.3g}" if c.k3 else "-",
                    result,
                )
            )
        if g.error:
            rows.append((g.name, g.error[:70], "-", "-", "-", "FAIL"))
        if g.bisect:
            div = g.bisect.get("divergence") or {}
            where = div.get("site") or g.bisect.get("error", "no op site differs")
            rows.append((g.name, f"bisect: {where}", "-", "-", "-", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    verdict = "QUALIFIED" if report.passed else "NOT QUALIFIED"
    lines.append(f"{verdict}: {report.lane} {report.contract[:19]}... in {report.seconds:.0f} s")
    lines.append(f"backend: {report.backend}" + (f" on {report.device}" if report.device else ""))
    if report.layouts:
        lines.append(f"layouts: {layout_line(report.layouts)}")
    if report.engines:
        lines.append(f"engines: {engines_line(report.engines)}")
    return "\n".join(lines)


def _svg(k3: list[float], width: int = 640, height: int = 160) -> str:
    """K3 per decision on a log scale; exact zeros drawn as green marks on the floor line."""
    if not k3:
        return ""
    floor, top = -12.0, max([-1.0] + [math.log10(v) for v in k3 if v > 0])
    pad = 30
    span = max(len(k3) - 1, 1)

    def x(i):
        return pad + (width - 2 * pad) * i / span

    def y(v):
        return height - pad - (height - 2 * pad) * (v - floor) / (top - floor)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
        f'<line x1="{pad}" y1="{y(floor)}" x2="{width - pad}" y2="{y(floor)}" stroke="#999"/>',
        f'<text x="2" y="{y(floor) + 4}" font-size="10">0</text>',
        f'<text x="2" y="{y(top) + 4}" font-size="10">1e{top:.0f}</text>',
    ]
    for i, v in enumerate(k3):
        if v == 0.0:
            parts.append(
                f'<rect x="{x(i) - 1.5}" y="{y(floor) - 6}" width="3" height="6" '
                'fill="#2a2"><title>decision %d: K3 = 0 (exact)</title></rect>' % i
            )
        else:
            lv = max(floor, math.log10(v))
            parts.append(
                f'<circle cx="{x(i)}" cy="{y(lv)}" r="3" fill="#c22">'
                f"<title>decision {i}: K3 = {v:.3e}</title></circle>"
            )
    parts.append(
        f'<text x="{width / 2 - 60}" y="{height - 6}" font-size="11">decision '
        "(green: exact, red: K3 &gt; 0, log scale)</text></svg>"
    )
    return "".join(parts)


def render_html(data: dict) -> str:
    esc = html.escape
    verdict = "QUALIFIED" if data["passed"] else "NOT QUALIFIED"
    color = "#2a2" if data["passed"] else "#c22"
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>Lockstep qualification"
        "</title><style>body{font-family:sans-serif;max-width:900px;margin:2em auto}"
        "td,th{padding:2px 8px;text-align:left}table{border-collapse:collapse}"
        "tr:nth-child(even){background:#f4f4f4}.pass{color:#2a2}.fail{color:#c22}"
        "</style></head><body>",
        f"<h1>Lockstep qualification: <span style='color:{color}'>{verdict}</span></h1>",
        f"<p>lane <b>{esc(data['lane'])}</b><br>contract <code>{esc(data['contract'])}"
        f"</code><br>model <code>{esc(data['model'])}</code><br>"
        + f"backend <b>{esc(str(data.get('backend', 'cpu')))}</b>"
        + (f" on {esc(str(data['device']))}" if data.get("device") else "")
        + "<br>"
        + (f"layouts {esc(layout_line(data['layouts']))}<br>" if data.get("layouts") else "")
        + "lockstep-exact "
        f"{esc(data['lockstep_exact'])}, {data['seconds']:.1f} s</p><h2>Engines</h2><ul>",
    ]
    for e in data["engines"]:
        out.append(
            f"<li>{esc(str(e.get('role')))}: {esc(str(e.get('engine')))} "
            f"{esc(str(e.get('engine_version')))} (plugin {esc(str(e.get('plugin')))} "
            f"{esc(str(e.get('plugin_version')))}"
            + (f", torch {esc(str(e['torch_version']))}" if e.get("torch_version") else "")
            + f", backends {esc(','.join(e.get('backends') or ()))})</li>"
        )
    out.append("</ul>")
    for g in data["gates"]:
        cls = "pass" if g["passed"] else "fail"
        out.append(
            f"<h2 class='{cls}'>{esc(g['name'])}: {'passed' if g['passed'] else 'FAILED'}"
            f" ({g['seconds']:.1f} s)</h2>"
        )
        if g.get("error"):
            out.append(f"<p class='fail'>{esc(g['error'])}</p>")
        out.append(
            "<table><tr><th>check</th><th>decisions</th><th>byte-equal</th>"
            "<th>K3 max</th><th>first difference</th><th>result</th></tr>"
        )
        for c in g["checks"]:
            res = ("pass" if c["passed"] else "FAIL") + (
                "" if c["expect_exact"] else " (control: must differ)"
            )
            fd = "-" if c["first_difference"] is None else c["first_difference"]
            out.append(
                f"<tr><td>{esc(c['what'])}<br><small>{esc(c['note'])}</small></td>"
                f"<td>{c['decisions']}</td><td>{c['byte_equal']}</td>"
                f"<td>{c['k3_max']:.3g}</td><td>{fd}</td>"
                f"<td class='{'pass' if c['passed'] else 'fail'}'>{res}</td></tr>"
            )
        out.append("</table>")
        for c in g["checks"]:
            if c["k3"]:
                out.append(f"<p><small>{esc(c['what'])}</small><br>{_svg(c['k3'])}</p>")
        if g.get("bisect"):
            out.append(
                f"<h3>First divergence</h3><pre>{esc(json.dumps(g['bisect'], indent=2))}</pre>"
            )
    out.append("</body></html>\n")
    return "".join(out)
