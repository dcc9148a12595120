"""A plan carries its resolved planning inputs: explain, diff and recost need nothing else (no
config, no profile file); version-1 plans are still read, with a warning."""

import json

import pytest

from torchtitan_autoparallel.commands.cli import main
from torchtitan_autoparallel.plan.schema import SCHEMA_VERSION, Plan

from tests.support.parity import REPO
from tests.test_artifacts import cli

DEBUG_AUTO = str(REPO / "train_configs" / "llama3_debug_auto.toml")
V1_PLAN = REPO / "experiments/results/quiet/plans/llama3_ws2_b16_s512_m0.18.auto.json"


@pytest.fixture(scope="module")
def own_profile_plan(tmp_path_factory):
    """A plan made with a profile file that no longer exists (the CPU profile, slower links)."""
    folder = tmp_path_factory.mktemp("own")
    profile = folder / "my_profile.toml"
    text = (REPO / "torchtitan_autoparallel/profiles/cpu.toml").read_text()
    lines = [("name = \"my_profile\"" if line.startswith("name") else
              "intra_node_gbps = 0.05" if line.startswith("intra_node_gbps = 0") else line)
             for line in text.splitlines()]
    profile.write_text("\n".join(lines) + "\n")
    out = folder / "plan.json"
    assert main(["plan", "--config", DEBUG_AUTO, "--ngpu", "4", "--memory-gib", "0.2",
                 "--hardware", str(profile), "--out", str(out)]) == 0
    profile.unlink()
    return out


def test_plan_stores_resolved_inputs(own_profile_plan):
    data = json.loads(own_profile_plan.read_text())
    assert data["version"] == SCHEMA_VERSION == 2
    inputs = data["inputs"]
    assert inputs["hardware"]["name"] == "my_profile"
    assert inputs["hardware"]["intra_node_gbps"] == 0.05
    assert inputs["budget_bytes"] == 0.2 * 2**30
    assert inputs["precision"] == {"param_bytes": 4, "reduce_bytes": 4}
    assert (inputs["model"], inputs["flavor"], inputs["seq_len"]) == ("llama3", "debugmodel", 256)
    assert inputs["world_size"] == 4 and inputs["constraints"]["techniques"]
    assert inputs["features"]["compile"] is False


def test_explain_and_diff_after_the_profile_file_is_deleted(own_profile_plan, tmp_path,
                                                             capsys):
    code, out, err = cli(capsys, "explain", str(own_profile_plan))
    assert code == 0, err
    assert "runner-up" in out and "layers.0" in out
    code, out, err = cli(capsys, "diff", str(own_profile_plan), str(own_profile_plan))
    assert (code, out.strip()) == (0, "plans are identical")
    other = tmp_path / "cpu.json"
    assert main(["plan", "--config", DEBUG_AUTO, "--ngpu", "4", "--memory-gib", "0.2",
                 "--out", str(other)]) == 0
    capsys.readouterr()
    code, out, err = cli(capsys, "diff", str(own_profile_plan), str(other), "--out",
                         str(tmp_path / "diff.png"))
    assert code == 1 and "job hardware: 'my_profile' -> 'cpu'" in out, err
    assert (tmp_path / "diff.png").stat().st_size > 0


def test_recost_from_the_plan_alone_reproduces_its_prediction(own_profile_plan):
    from torchtitan_autoparallel.plan.assembly import inputs_record
    from torchtitan_autoparallel.plan.recost import inputs_from_plan, recost

    plan = Plan.load(str(own_profile_plan))
    assert inputs_record(inputs_from_plan(plan)) == plan.inputs
    again = recost(plan)
    assert again.predicted == pytest.approx(plan.predicted, rel=1e-12)
    assert again.to_dict()["layers"] == plan.to_dict()["layers"]


def test_version_1_plans_round_trip_and_are_read_with_a_warning(tmp_path, capsys):
    from torchtitan_autoparallel.plan.recost import recost

    plan = Plan.load(str(V1_PLAN))
    assert plan.version == 1 and plan.inputs is None
    copy = tmp_path / "v1.json"
    plan.save(str(copy))
    # written back as read, less the planning-time bucket version-1 files carried (wall-clock:
    # no longer stored)
    expected = json.loads(V1_PLAN.read_text())
    expected["solver"].pop("planning_time_within_s", None)
    assert json.loads(copy.read_text()) == expected
    again = recost(plan)  # inputs rebuilt from the fingerprint and the named profile
    code, out, err = cli(capsys, "explain", str(V1_PLAN))
    assert code == 0 and "runner-up" in out
    assert err.startswith("warning: ") and "schema version 1" in err and "re-plan" in err
    assert again.inputs["hardware"]["name"] == "cpu"
    assert [layer.ac for layer in again.layers] == [layer.ac for layer in plan.layers]


def test_version_1_plan_with_an_unknown_profile_is_one_line(tmp_path, capsys):
    data = json.loads(V1_PLAN.read_text())
    data["fingerprint"]["hardware"] = "gone_profile"
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    code, _, err = cli(capsys, "explain", str(path))
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "gone_profile" in lines[0]
    assert "Traceback" not in err


def test_same_inputs_give_byte_identical_plans_with_inputs(tmp_path):
    """Planning twice gives the same bytes, inputs included; the digest (the decisions) does
    not depend on the stored inputs."""
    outs = [tmp_path / f"{i}.json" for i in range(2)]
    for out in outs:
        assert main(["plan", "--config", DEBUG_AUTO, "--ngpu", "2", "--out", str(out)]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()
    plan = Plan.load(str(outs[0]))
    stripped = Plan.from_dict({**plan.to_dict(), "inputs": None})
    assert stripped.digest() == plan.digest()


def test_optional_fields_take_their_value_or_none():
    """``X | None`` fields of the stored inputs (float8's filter_fqns) accept an X or None,
    nothing else (a plan with a filter was refused as "not a finite number")."""
    import typing

    from torchtitan_autoparallel.errors import rule_for_type
    from torchtitan_autoparallel.job.features import Features

    rule = rule_for_type(typing.get_type_hints(Features)["float8_filter"])
    assert rule.accepts(("output",)) and rule.accepts(None) and not rule.accepts(3)
