"""``lockstep train``'s report plots (matplotlib, inline SVG) and its TensorBoard scalars.

The report: one labelled axis per quantity, integer steps, 0 on the axis of K3, the same
bytes for the same rows, nothing fetched or run. TensorBoard: every step's numeric fields
read back at their steps; a resume writes no step twice; without tensorboard a run still
writes its metrics and says how to turn it on. The loop runs on fake engine hooks here (no
vLLM, no Megatron).
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET

import pytest
from train_support import FakePolicy, FakeSampler

from lockstep_exact import hookimpl
from lockstep_exact.app import train_report
from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.app.train_loop import TrainConfig, prepare_train
from lockstep_exact.app.train_report import TensorBoard, quantities, render
from lockstep_exact.plugins import manager

SVG = "{http://www.w3.org/2000/svg}"


def _rows(n: int, algo: str = "grpo", k3: float = 0.0, **extra) -> list[dict]:
    return [
        {
            "step": i,
            "algo": algo,
            "reward_mean": 0.25 + 0.05 * i,
            "rewards": [0.25, 0.5],
            "k3_max": k3,
            "equal": 8,
            "decisions": 8,
            "loss": 1.0 / i,
            "kl": None,
            "reverse_kl": None,
            "seconds": 2.0 + 0.1 * i,
            "adapter_id": i,
            "adapter_out": f"adapters/step-{i:04d}",
            **extra,
        }
        for i in range(1, n + 1)
    ]


def _plots(page: str) -> dict[str, str]:
    """The page's plots: quantity -> its inline <svg>."""
    found = re.findall(r"<figure id='plot-([\w]+)'>.*?(<svg.*?</svg>)</figure>", page, re.S)
    return dict(found)


def _texts(svg: str, group: str | None = None) -> list[str]:
    """The text of every <text> in ``svg`` (in the groups whose id contains ``group``)."""
    root = ET.fromstring(svg)
    groups = (
        [root] if group is None else [g for g in root.iter(f"{SVG}g") if group in g.get("id", "")]
    )
    return [
        "".join(t.itertext()).replace("\n", "").replace(" ", "")
        for g in groups
        for t in g.iter(f"{SVG}text")
    ]


def test_the_report_draws_one_labelled_axis_per_quantity_inline_and_reproducibly():
    rows = _rows(5, kl=None)
    for r in rows:
        r["kl"] = 0.01 * r["step"]
    page = render(rows, {"setting.algo": "grpo"})
    plots = _plots(page)
    assert list(plots) == ["reward_mean", "k3_max", "loss", "kl", "seconds"]  # no reverse KL
    labels = {q.key: q.ylabel for q in quantities("grpo")}
    for key, svg in plots.items():
        root = ET.fromstring(svg)  # well-formed
        axes = [g for g in root.iter(f"{SVG}g") if re.fullmatch(r"[\w]+-axes_\d+", g.get("id", ""))]
        assert len(axes) == 1, key  # one axis per quantity: reward and K3 never share one
        texts = _texts(svg)
        assert "step" in texts and labels[key].replace(" ", "") in texts, (key, texts)
        assert _texts(svg, "xtick") == ["1", "2", "3", "4", "5"], key  # integer steps
    assert "K3" not in "".join(_texts(plots["reward_mean"]))
    assert "mean reward" in labels["reward_mean"] and "(nats)" in labels["k3_max"]
    # self-contained: nothing to run, nothing to fetch, no date
    for bad in ("<script", "<image", 'href="http', "<dc:date", "src="):
        assert bad not in page, bad
    ids = re.findall(r' id="([^"]+)"', page)
    assert len(ids) == len(set(ids))  # unique across the page's plots
    assert render(rows, {"setting.algo": "grpo"}) == page  # the same rows, the same bytes


def test_an_all_zero_k3_is_drawn_on_an_axis_that_shows_zero():
    page = render(_rows(3), {"setting.algo": "grpo"})
    k3 = _plots(page)["k3_max"]
    yticks = _texts(k3, "ytick")
    assert yticks[0] == "0", yticks  # the foot of the axis is 0
    assert len(yticks) > 1  # and the scale above it (decades up to at least 1e-6)
    assert "K3max(nats)" in _texts(k3)
    assert ">exact at every step<" in page


def test_a_stopped_step_is_marked_and_the_step_time_axis_starts_at_zero():
    rows = _rows(3)
    rows[-1].update(k3_max=3e-8, equal=7, stopped=True)
    page = render(rows, {"setting.algo": "grpo"}, stopped="step 3: not byte-equal")
    plots = _plots(page)
    assert "stopped" in _texts(plots["k3_max"])
    assert _texts(plots["seconds"], "ytick")[0] == "0.0"
    assert "STOPPED" in page


def test_sft_labels_its_loss_as_nll_and_the_reward_as_the_probe():
    page = render(_rows(2, algo="sft"), {"setting.algo": "sft"})
    assert "reward of the sampled probe over steps (sft does not optimize it)" in page
    assert any("nats/token" in t for t in _texts(_plots(page)["loss"]))


def test_tensorboard_scalars_read_back_at_their_steps_each_step_once(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = _rows(3)
    board = TensorBoard(tmp_path)
    assert board.hint is None
    assert board.write(rows[:2]) == [1, 2]
    assert board.write(rows[:2]) == []
    board.close()
    again = TensorBoard(tmp_path)  # a resume: another writer, the steps it has already
    changed = [dict(r) for r in rows]
    changed[1]["seconds"] = 99.0  # a step run again after its checkpoint
    assert again.write(changed) == [3]
    again.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward_mean", "k3_max", "loss", "seconds", "equal", "adapter_id"} <= tags
    assert not tags & {"step", "kl", "rewards", "adapter_out", "algo"}
    seconds = acc.Scalars("seconds")
    assert [e.step for e in seconds] == [1, 2, 3]
    assert [e.value for e in seconds] == pytest.approx([2.1, 2.2, 2.3])
    assert [e.value for e in acc.Scalars("reward_mean")] == pytest.approx([0.3, 0.35, 0.4])


# ----------------------------------------------------------------------------- the loop


class _FakeEngines:
    @hookimpl
    def lockstep_sampler_session(self, request):
        return FakeSampler()

    @hookimpl
    def lockstep_trainer_session(self, request):
        return FakePolicy()


def _train(model, out, steps, resume=False):
    pm = manager(load_entry_points=False)
    pm.register(_FakeEngines())
    config = TrainConfig(steps=steps, group=2, prompts=1, decisions=2, checkpoint_every=2)
    lines = []
    plan = prepare_train(pm, model, out, config, reward=lambda c: 0.25, resume=resume)
    with plan.claim():
        from lockstep_exact.app.train_loop import Progress

        rows = plan.run(Progress(lines.append))
    return rows, lines


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "m")


def test_a_resumed_run_continues_its_tensorboard_without_writing_a_step_twice(tiny, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    rows, lines = _train(tiny, out, 3)  # checkpoints at steps 2 and 3
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert not any("tensorboard" in x.lower() for x in lines)
    assert "<svg" in (out / "report.html").read_text()
    # a crash after step 3's metrics, before its checkpoint: the resume runs step 3 again
    import shutil

    shutil.rmtree(out / "checkpoints" / "step-0003")
    rows, _ = _train(tiny, out, 4, resume=True)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    for tag in ("reward_mean", "k3_max", "loss", "seconds"):
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3, 4], tag
    assert json.loads((out / "tensorboard" / "written.json").read_text()) == {"last_step": 4}


def test_without_tensorboard_the_run_writes_its_metrics_and_says_how_to_enable_it(
    tiny, tmp_path, monkeypatch
):
    for name in ("tensorboard", "tensorboardX", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    assert train_report.summary_writer_class() is None
    out = tmp_path / "run"
    rows, lines = _train(tiny, out, 2)
    hints = [x for x in lines if "pip install tensorboard" in x]
    assert len(hints) == 1 and "uv sync --extra tensorboard" in hints[0], lines
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]
    assert "<svg" in (out / "report.html").read_text()
    assert not (out / "tensorboard").exists()
