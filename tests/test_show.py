"""``show`` and ``diff --out``: the committed plans (dense TP, MoE with EP, CP, pinned) drawn to
PNG and HTML, checked through what the picture draws: one row per run of layers with the
cells of its strategy, colours per strategy value, memory segments summing to the peak."""

import json
import sys

import pytest

from torchtitan_autoparallel.plan.schema import Plan

from tests.support.parity import REPO
from tests.test_artifacts import cli

RESULTS = REPO / "experiments" / "results"
PLANS = {
    "dense_tp": RESULTS / "plans" / "llama3_ws4_b16_s256.fsdp2_tp2.json",
    "moe_ep": RESULTS / "quiet" / "plans" / "deepseek_v3_ws4_b16_s256.fsdp4_ep4.json",
    "cp": RESULTS / "plans" / "llama3_ws4_b16_s256.fsdp2_cp2.json",
    "pinned": RESULTS / "plans" / "llama3_ws4_b16_s256_m0.12_pinned.auto.json",
}
# what each plan's blocks must show, written from the plan files by hand
EXPECTED_CELLS = {
    "dense_tp": {"params": "fsdp", "tp": "tp+sp", "ep": "", "cp": "", "pinned": ""},
    "moe_ep": {"params": "fsdp", "tp": "", "cp": "", "pinned": ""},
    "cp": {"params": "fsdp", "tp": "", "ep": "", "cp": "cp2", "pinned": ""},
    "pinned": {"tp": "", "ep": "", "cp": ""},
}
HEX = {"fsdp": "#4c72b0", "fsdp-keep": "#8fa8d8", "tp+sp": "#dd8452", "ep4": "#c44e52",
       "cp2": "#64b5cd", "pinned": "#222222", "": "#f2f2f2", "ac:none": "#e6e6e6"}


def _hex(rgba) -> str:
    return "#" + "".join(f"{round(c * 255):02x}" for c in rgba[:3])


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    from torchtitan_autoparallel.commands.show import draw, picture

    out = {}
    for name, path in PLANS.items():
        plan = Plan.load(str(path))
        pic = picture(plan)
        out[name] = (plan, pic, draw([pic]))
    return out


@pytest.mark.parametrize("name", list(PLANS))
def test_rows_cover_every_layer_with_its_strategy(drawn, name):
    plan, pic, _ = drawn[name]
    assert sum(row.count for row in pic.rows) == len(plan.layers)
    layers = iter(plan.layers)
    for row in pic.rows:
        run = [next(layers) for _ in range(row.count)]
        assert (run[0].fqn, run[-1].fqn) == (row.first, row.last)
        assert {lp.describe(plan.mesh.unsharded_label) for lp in run} == {row.strategy}
        if run[0].kind == "block":
            assert EXPECTED_CELLS[name].items() <= row.cells.items()
            assert row.cells["ac"] == f"ac:{run[0].ac}"
    if name == "moe_ep":
        moe = [r for r in pic.rows if r.cells["ep"] == "ep4"]
        assert moe and all("ep4" in r.strategy for r in moe)
    if name == "pinned":
        pinned = [r.first for r in pic.rows if r.cells["pinned"] == "pinned"]
        assert pinned == ["layers.0", "layers.5"]
        assert {r.cells["params"] for r in pic.rows if r.first == "layers.1"} == {"fsdp-keep"}


@pytest.mark.parametrize("name", list(PLANS))
def test_drawn_cells_have_the_colour_of_their_strategy(drawn, name):
    _, pic, fig = drawn[name]
    cells = {}
    for ax in fig.axes:
        for patch in ax.patches:
            gid = patch.get_gid() or ""
            if gid.count("|") == 2:
                fqn, aspect, value = gid.split("|")
                cells[(fqn, aspect)] = (value, _hex(patch.get_facecolor()))
    assert len(cells) == 6 * len(pic.rows)
    for row in pic.rows:
        for aspect, value in row.cells.items():
            drawn_value, drawn_colour = cells[(row.first, aspect)]
            assert drawn_value == value
            if value in HEX:
                assert drawn_colour == HEX[value], (row.first, aspect, value)
    # different strategy values never share a colour within an aspect
    by_aspect: dict[str, dict[str, str]] = {}
    for (_, aspect), (value, col) in cells.items():
        by_aspect.setdefault(aspect, {})[value] = col
    for values in by_aspect.values():
        assert len(set(values.values())) == len(values)


@pytest.mark.parametrize("name", list(PLANS))
def test_memory_and_time_segments_sum_to_the_prediction(drawn, name):
    from torchtitan_autoparallel.plan.recost import recost

    plan, pic, fig = drawn[name]
    again = recost(plan).predicted  # the cost model's own totals (Candidate.memory / step_time)
    assert sum(v for _, v in pic.memory) == pytest.approx(again["peak_memory_gib"], rel=1e-9)
    assert sum(v for _, v in pic.time) == pytest.approx(again["step_time_s"], rel=1e-9)
    assert all(v >= 0 for _, v in pic.memory + pic.time)
    if plan.inputs is not None:  # planned by this version: equal to the stored prediction
        assert sum(v for _, v in pic.memory) == pytest.approx(
            plan.predicted["peak_memory_gib"], rel=1e-9)
        assert sum(v for _, v in pic.time) == pytest.approx(plan.predicted["step_time_s"],
                                                            rel=1e-9)
    bars = [p for ax in fig.axes for p in ax.patches
            if (p.get_gid() or "").split("|")[0] in dict(pic.memory)]
    assert sum(p.get_width() for p in bars) == pytest.approx(
        sum(v for _, v in pic.memory), rel=1e-9)
    ranks = [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith("rank")]
    assert len(ranks) == plan.mesh.world


def test_cli_show_writes_png_and_html(tmp_path, capsys):
    png, page = tmp_path / "plan.png", tmp_path / "plan.html"
    code, out, err = cli(capsys, "show", str(PLANS["moe_ep"]), "--out", str(png),
                         "--html", str(page))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text()
    assert "data:image/png;base64," in text and "<table>" in text
    assert text.count("ep4") >= 1 and "layers.1" in text


def test_cli_diff_draws_two_plans(tmp_path, capsys):
    png = tmp_path / "diff.png"
    code, out, _ = cli(capsys, "diff", str(PLANS["dense_tp"]), str(PLANS["cp"]), "--out",
                       str(png))
    assert code == 1 and "mesh:" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_show_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    plan = str(PLANS["pinned"])
    code, _, err = cli(capsys, "show", plan)
    assert code == 2 and err.count("\n") == 1 and "--out" in err
    code, _, err = cli(capsys, "show", plan, "--out", str(tmp_path / "plan.txt"))
    assert code == 2 and ".png" in err and not (tmp_path / "plan.txt").exists()
    code, _, err = cli(capsys, "show", plan, "--out", "/proc/no/such/plan.png")
    assert code == 2 and "cannot write" in err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = cli(capsys, "show", plan, "--out", str(tmp_path / "plan.png"))
    assert code == 2 and "[show]" in err and not (tmp_path / "plan.png").exists()
    assert json.loads((PLANS["pinned"]).read_text())["version"] == 2


@pytest.mark.parametrize("modes", [["dp/sp:batch", "sp/sp:batch"], ["sp/sp:a2a", "dp/sp"],
                                   ["sp/tp@dp_shard", "sp"]],
                         ids=["batch_stream", "a2a", "dp_shard_tp"])
def test_sub_block_modes_drawn(modes):
    """Blocks in the sub-block modes below the block (the stream sharded on the batch; the
    output projection on the sequence shard) are drawn, each tp value in a colour of its own,
    the batch-sharded stream named in the tp cell; the embedding the search looks up on its
    embedding dim too."""
    from torchtitan_autoparallel.commands.show import draw, picture
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    plan = plan_job(parse_config([
        "--job.config_file", "train_configs/llama3_debug_auto.toml",
        "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2",
        "--training.global_batch_size=8",
        "--autoparallel.techniques=fsdp,hsdp,ddp,tp,tp_dp,cp,ep,ac,tp_sub_block"]), 4)
    plan.local_batch_size, plan.gradient_accumulation_steps = 2, 2
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    for i, layer in enumerate(blocks):
        layer.tp_mode, layer.fsdp_unit = modes[i % 2], 1
    pic = picture(plan)
    draw([pic])
    tp = {row.cells["tp"] for row in pic.rows if row.first.startswith("layers.")}
    assert len(tp) == 2, tp
    assert plan.embedding_mode in ("dim", "dim:gather")
    assert next(row.cells for row in pic.rows if row.first == "tok_embeddings") \
        ["params"] == "dim-shard"
    if modes[0].endswith(":batch"):
        assert all(value.endswith(" stream:batch") for value in tp), tp
    elif modes[0].endswith(":a2a"):
        assert "attn:tp+a2a/ffn:tp+sp" in tp, tp
    else:
        assert "attn:tp+sp/ffn:tp@dp_shard" in tp, tp
