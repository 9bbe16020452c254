"""The HTML report of a ``lockstep train`` run, and its TensorBoard scalars.

``render``: one plot per quantity over steps (reward, K3 max, loss, KL, reverse KL, step
time; each on its own axis, labelled with its unit), drawn by matplotlib as inline SVG, and
every step's row. Self-contained (no scripts, no fetched assets) and reproducible: the same
rows give the same bytes (no dates, ids from a fixed salt). Rewritten after every step, so the
file open in a browser is the run so far.

``TensorBoard``: each step's numeric fields of ``metrics.jsonl`` as scalars under
``out/tensorboard/`` (global step: the step), when ``tensorboard`` (or ``tensorboardX``) is
installed; a step is written once, whatever resumes follow.
"""

from __future__ import annotations

import html
import io
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

# ----------------------------------------------------------------------------- plots


@dataclass(frozen=True)
class Quantity:
    """One plotted field of the step rows: its own axis, its unit in the y label."""

    key: str
    title: str
    ylabel: str
    zero: bool = False  # 0 means something (a divergence, a time): the axis shows it
    colour: str = "#2364aa"


def quantities(algo: str) -> list[Quantity]:
    reward_title = "reward over steps"
    if algo == "sft":  # measured on the sampled probe; SFT does not optimize it
        reward_title = "reward of the sampled probe over steps (sft does not optimize it)"
    loss = "mean NLL of the completions (nats/token)" if algo == "sft" else "clipped surrogate"
    return [
        Quantity("reward_mean", reward_title, "mean reward (reward fn units)"),
        Quantity(
            "k3_max",
            "K3 max over steps (0: every decision byte-equal)",
            "K3 max (nats)",
            zero=True,
            colour="#2a2",
        ),
        Quantity("loss", "loss over steps", f"loss ({loss})", colour="#555"),
        Quantity(
            "kl", "KL to the reference over steps", "k3 KL (nats/token)", True, colour="#7a3d9a"
        ),
        Quantity(
            "reverse_kl",
            "reverse KL to the teacher over steps",
            "reverse KL (nats/token)",
            zero=True,
            colour="#aa6f23",
        ),
        Quantity("seconds", "time per step", "step time (s)", zero=True, colour="#888"),
    ]


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def plot_svg(q: Quantity, rows: list[dict]) -> str:
    """``q`` over the steps of ``rows`` as one inline ``<svg>`` element ("" if no row has it);
    its title is the page's (a title inside the figure doubles the drawing time).

    Steps on x (integer ticks), ``q`` on y with its unit; a zero-based quantity has 0 on its
    axis (K3: a log scale above a linear stretch at 0, so 0 and 1e-9 are both visible). A
    step that stopped is a red cross. Deterministic: no date, ids from a salt of ``q``."""
    pts = [(r["step"], r[q.key], bool(r.get("stopped"))) for r in rows if _finite(r.get(q.key))]
    if not pts:
        return ""
    import matplotlib
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = [s for s, _, _ in pts]
    values = [v for _, v, _ in pts]
    rc = {
        "svg.hashsalt": f"lockstep-train-{q.key}",  # fixed ids, distinct between plots
        "svg.fonttype": "none",  # text as <text>: searchable, small
        "font.size": 9,
        "axes.spines.top": False,
        "axes.spines.right": False,
    }
    with matplotlib.rc_context(rc):
        fig = Figure(figsize=(9.6, 2.6), dpi=72)  # fixed margins: a layout engine is slow
        fig.subplots_adjust(left=0.1, right=0.98, bottom=0.17, top=0.96)
        FigureCanvasSVG(fig)
        ax = fig.add_subplot()
        ok = [(s, v) for s, v, stop in pts if not stop]
        if ok:
            ax.plot(*zip(*ok, strict=True), "o-", ms=3.5, lw=1.6, color=q.colour, clip_on=False)
        bad = [(s, v) for s, v, stop in pts if stop]
        if bad:
            ax.plot(
                *zip(*bad, strict=True), "x", ms=8, mew=2, c="#c22", label="stopped", clip_on=False
            )
            ax.legend(loc="upper left", frameon=False)
        ax.set_xlabel("step")
        ax.set_ylabel(q.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
        ax.grid(True, color="#e4e4e4", lw=0.6)
        lo, hi = min(values), max(values)
        if q.zero:
            if q.key == "k3_max":  # 0 at the foot, then decades up to at least 1e-6
                ax.set_yscale("symlog", linthresh=1e-12, linscale=0.5)
                top = -6 if hi <= 0 else max(-6, math.ceil(math.log10(hi) + 0.01))
                ax.set_ylim(0.0, 10.0**top)
            elif hi <= 0 and lo >= 0:  # all zero: 0 at the foot of a unit axis
                ax.set_ylim(0.0, 1.0)
            else:
                pad = 0.05 * (max(hi, 0.0) - min(lo, 0.0))
                ax.set_ylim(min(lo, 0.0) - (pad if lo < 0 else 0.0), max(hi, 0.0) + pad)
            ax.axhline(0.0, color="#444", lw=0.9, zorder=1)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :].strip()  # inline: no XML declaration, no DOCTYPE
    # matplotlib numbers its groups from 1 in every figure (axes_1, xtick_1): named by the
    # quantity, ids stay unique on the page (the ids of clip paths and markers are salted)
    return re.sub(r' id="([A-Za-z][\w.]*_\d+)"', rf' id="{q.key}-\1"', text)


# ----------------------------------------------------------------------------- the page


def render(rows: list[dict], identity: dict, stopped: str | None = None) -> str:
    esc = html.escape
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
        "tr:nth-child(even){background:#f4f4f4}figure{margin:0 0 0.5em 0}</style></head><body>",
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
    for q in quantities(str(algo)):
        svg = plot_svg(q, rows)
        if svg:
            out.append(
                f"<figure id='plot-{q.key}'><figcaption><b>{esc(q.title)}</b></figcaption>"
                f"{svg}</figure>"
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


# ----------------------------------------------------------------------------- TensorBoard

TENSORBOARD_HINT = (
    "TensorBoard event files are off (no tensorboard installed): `pip install tensorboard` "
    "(in the Lockstep workspace: `uv sync --extra tensorboard`) writes every step's metrics "
    "under {dir} as well"
)


def summary_writer_class():
    """torch's ``SummaryWriter`` (needs the ``tensorboard`` package), else tensorboardX's,
    else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter
    except ImportError:
        pass
    try:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    except ImportError:
        return None


def scalars(row: dict) -> dict[str, float]:
    """A step row's numeric fields (not the step, not flags such as ``stopped``)."""
    return {k: float(v) for k, v in sorted(row.items()) if k != "step" and _finite(v)}


class TensorBoard:
    """Step rows as TensorBoard scalars under ``out/tensorboard``: one writer (one event
    file) for the run's life, each step written once. ``tensorboard/written.json`` keeps the
    last step written: a resume that runs again the steps after its checkpoint (the same
    values, byte for byte) writes only steps past it. A step that stopped is not written: a
    resume runs it again, and the report and metrics.jsonl keep its K3."""

    STATE = "written.json"

    def __init__(self, out: Path):
        self.dir = Path(out) / "tensorboard"
        self._cls = summary_writer_class()
        self._writer = None

    @property
    def hint(self) -> str | None:
        """How to turn it on (one line), or None where it is on."""
        return None if self._cls else TENSORBOARD_HINT.format(dir=self.dir)

    def last_step(self) -> int:
        try:
            return int(json.loads((self.dir / self.STATE).read_text())["last_step"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def write(self, rows: list[dict]) -> list[int]:
        """Write the rows past the last step written; the steps written."""
        if self._cls is None:
            return []
        last = self.last_step()
        new = sorted(
            (r for r in rows if r.get("step", 0) > last and not r.get("stopped")),
            key=lambda r: r["step"],
        )
        if not new:
            return []
        if self._writer is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._writer = self._cls(log_dir=str(self.dir))
        for r in new:
            for tag, value in scalars(r).items():
                self._writer.add_scalar(tag, value, global_step=int(r["step"]))
        self._writer.flush()
        tmp = self.dir / (self.STATE + ".tmp")
        tmp.write_text(json.dumps({"last_step": int(new[-1]["step"])}) + "\n")
        os.replace(tmp, self.dir / self.STATE)
        return [int(r["step"]) for r in new]

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
