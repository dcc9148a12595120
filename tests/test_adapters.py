"""The public adapter API: discovery checked against the hand-written registrations of the
four TorchTitan families and against the test model's known layout; one-line errors for
adapters that do not describe the model and for TP degrees the heads do not allow."""

import dataclasses
import os
import subprocess

import pytest
import torch
import torch.nn as nn

from torchtitan_autoparallel import ModelAdapter, register_adapter
from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.graph import adapters
from torchtitan_autoparallel.graph.adapters import INFER_TP, resolve
from torchtitan_autoparallel.graph.discover import discover_adapter
from torchtitan_autoparallel.graph.tp_infer import InferredTP

from tests.support.parity import PARITY_OVERRIDES, REPO

AUTO = "tests/configs/pocket_lm_auto.toml"


@pytest.fixture(autouse=True)
def fresh_adapters(monkeypatch):
    """Each test registers into copies of the registry."""
    monkeypatch.setattr(adapters, "_ADAPTERS", dict(adapters._ADAPTERS))


def _job(*overrides: str, config: str = AUTO):
    from torchtitan_autoparallel.titan.v0_2 import cpu
    from torchtitan_autoparallel.titan.v0_2.registry import import_custom_module, register
    from torchtitan_autoparallel.titan.v0_2.train import parse_config

    cpu.install()
    register()
    job = parse_config(["--job.config_file", config, *PARITY_OVERRIDES, *overrides])
    import_custom_module(job)
    return job


def _plan(world: int, *overrides: str):
    from torchtitan_autoparallel.job.request import plan_job

    return plan_job(_job(*overrides), world)


def _meta_model(family: str, flavor: str) -> nn.Module:
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_autoparallel.titan.v0_2.model import measurable_args

    spec = get_train_spec(family)
    args, _ = measurable_args(spec.model_args[flavor], 64)
    with torch.device("meta"):
        return spec.model_cls(args)


@pytest.mark.parametrize("family,flavor", [("llama3", "debugmodel"), ("qwen3", "debugmodel_moe"),
                                           ("llama4", "debugmodel"),
                                           ("deepseek_v3", "debugmodel")])
def test_discovery_finds_what_the_builtin_registrations_say(family, flavor):
    _job()  # registers TorchTitan's train specs
    builtin = adapters._ADAPTERS[family]
    found = discover_adapter(family, _meta_model(family, flavor), ModelAdapter())
    for name in ("blocks", "embedding", "final_norm", "output", "inner_attention"):
        assert getattr(found, name) == getattr(builtin, name), name
    assert resolve(found.op_sac_save_list) is resolve(builtin.op_sac_save_list)
    # the family's own TP function is found; llama3 / llama4 register the inferred plan
    titan_tp = "apply_tp" if family == "llama3" else "apply_non_moe_tp"
    assert found.tp_fn == f"torchtitan.models.{family}.infra.parallelize.{titan_tp}"
    assert builtin.tp_fn in (found.tp_fn, INFER_TP)
    if family == "llama3":  # dense: nothing MoE is found
        assert (found.moe, found.moe_fn, found.default_pins) == (None, None, ())
        return
    assert (found.moe, found.default_pins) == (builtin.moe, builtin.default_pins)
    assert resolve(found.moe_fn).__name__ == "apply_moe_ep_tp"


def test_discovery_reads_the_test_model():
    from torchtitan_autoparallel.job.inputs import job_inputs

    plan = _plan(2)
    found = job_inputs(_job(), 2).graph.adapter
    assert (found.blocks, found.embedding, found.final_norm, found.output) == (
        "stack", "wte", "ln_out", "head")
    assert isinstance(found.tp_fn, InferredTP)  # no TP function: inferred (test_tp_infer.py)
    assert found.op_sac_save_list is None and found.block_args == 2
    assert [layer.fqn for layer in plan.layers] == ["wte", "stack.0", "stack.1", "stack.2",
                                                    "head"]
    assert not any(note.startswith(("excluded tp", "excluded selective_ac"))
                   for note in plan.notes), plan.notes
    # attention views written with the head counts: TP left out, the op named
    notes = _plan(2, "--model.flavor=fixed_heads").notes
    assert any(note.startswith("excluded tp: no TP plan for this family and none inferred "
                               "(stack.0: mix.view(1, 128, 6, 16) fails on one tp rank's heads")
               for note in notes), notes


def test_adapter_without_a_model_is_the_registered_one():
    """No state carries over from a layer graph built earlier: without the model, a family
    without a registration has no adapter, and a registered one is returned as registered."""
    from torchtitan_autoparallel.graph.discover import get_adapter

    _plan(2)  # discovers pocket_lm's adapter from its model
    with pytest.raises(UserError, match="no adapter registered for model 'pocket_lm'"):
        get_adapter("pocket_lm")
    assert get_adapter("llama3") is adapters._ADAPTERS["llama3"]


@pytest.mark.parametrize("field,value", [("blocks", "cells"), ("embedding", "tokens"),
                                         ("output", "lm_head"), ("final_norm", "norm")])
def test_adapter_naming_missing_module(field, value):
    _job()
    register_adapter("pocket_lm", ModelAdapter(**{field: value}), replace=True)
    with pytest.raises(UserError, match=rf"ModelAdapter.{field} = '{value}' for model "
                                        r"'pocket_lm' names no module: name one of"):
        _plan(2)


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(96, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _odd_model_cls():
    """pocket_lm whose second cell takes other inputs than the others."""
    from tests.support import pocket_lm

    class OddPocket(pocket_lm.PocketLM):
        def __init__(self, args) -> None:
            super().__init__(args)
            self.stack[1] = _Plain()

    return OddPocket, pocket_lm.PocketArgs()


def test_blocks_with_differing_signatures():
    from torchtitan_autoparallel.titan.v0_2.model import build_layer_graph

    model_cls, args = _odd_model_cls()
    with pytest.raises(UserError, match=r"no repeated blocks found .*\(ModelAdapter.blocks\)"):
        build_layer_graph("odd_pocket", "tiny", args, model_cls, 64)
    register_adapter("odd_pocket", ModelAdapter(blocks="stack"))
    with pytest.raises(UserError, match=r"ModelAdapter.blocks = 'stack' for model 'odd_pocket' "
                                        r"holds blocks with differing forward signatures"):
        build_layer_graph("odd_pocket", "tiny", args, model_cls, 64)


def test_tp_degree_not_dividing_the_heads():
    with pytest.raises(UserError, match=r"parallelism.tensor_parallel_degree = 4 does not divide "
                                        r"the attention heads of model 'pocket_lm' \(6 query / "
                                        r"2 kv heads, from ModelAdapter.heads"):
        _plan(4, "--experimental.custom_import=tests.support.pocket_lm_tp",
              "--parallelism.tensor_parallel_degree=4")


def test_tp_degree_without_tp_plan():
    with pytest.raises(UserError, match=r"parallelism.tensor_parallel_degree = 2 needs tp, which "
                                        r"model 'pocket_lm' cannot use: no TP plan"):
        _plan(2, "--parallelism.tensor_parallel_degree=2", "--model.flavor=fixed_heads")


def test_registered_heads_used():
    register_adapter("pocket_lm", ModelAdapter(
        heads=lambda args: (3, 3, 32), tp_fn="tests.support.pocket_lm_tp.pocket_tensor_parallel"))
    with pytest.raises(UserError, match=r"\(3 query / 3 kv heads"):
        _plan(2, "--parallelism.tensor_parallel_degree=2")


def test_bad_adapter_is_one_line_at_launch(tmp_path):
    """Through the launcher: exit 2, one line on stderr, no traceback."""
    result = subprocess.run(
        [str(REPO / "run_train.sh"), f"--job.dump_folder={tmp_path}",
         "--experimental.custom_import=tests.support.pocket_lm_tp",
         "--parallelism.tensor_parallel_degree=4"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NGPU": "4", "CONFIG_FILE": AUTO,
             "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: parallelism.tensor_parallel_degree")
    assert "Traceback" not in result.stderr


def test_register_adapter_refuses_silent_override():
    register_adapter("pocket_lm", ModelAdapter(blocks="stack"))
    register_adapter("pocket_lm", ModelAdapter(blocks="stack"))  # equal: no-op
    with pytest.raises(UserError, match="already registered: pass replace=True"):
        register_adapter("pocket_lm", dataclasses.replace(ModelAdapter(), blocks="cells"))


def test_selective_ac_without_an_op_list():
    """No save list anywhere: selective AC is offered with TorchTitan's llama3 list (the
    applier hands that very set to TorchTitan's ``apply_ac``); ``activation_checkpoint.mode``
    makes it every block's mode; an adapter opts out through ``excluded``."""
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    from torchtitan_autoparallel.job.inputs import job_inputs

    job = _job("--activation_checkpoint.mode=selective",
               "--activation_checkpoint.selective_ac_option=op")
    assert job_inputs(job, 2).graph.adapter.sac_save_list() is _op_sac_save_list
    plan = _plan(2, "--activation_checkpoint.mode=selective",
                 "--activation_checkpoint.selective_ac_option=op")
    assert {layer.ac for layer in plan.layers if layer.kind == "block"} == {"selective"}
    register_adapter("pocket_lm", ModelAdapter(excluded={"selective_ac": "not for this model"}))
    notes = _plan(2).notes
    assert "excluded selective_ac: not for this model" in notes, notes
    with pytest.raises(UserError, match="can run \\['none', 'full'\\]"):
        _plan(2, "--activation_checkpoint.mode=selective",
              "--activation_checkpoint.selective_ac_option=op")


class _Attn(nn.Module):
    """One attention written inline, in the variant ``how`` names."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.qkv = nn.Linear(32, 96, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.how == "arange":
            q = q * torch.arange(s, device=x.device)[:, None]
        else:
            q = q * rope[:s, None, :].transpose(0, 1)
        if self.how == "written_out":
            scores = (q @ k.transpose(-2, -1)).softmax(-1)
            return (scores @ v).transpose(1, 2).reshape(b, s, 32)
        if self.how == "mask":
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, s, 32)


class _Block(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.attn = _Attn(how)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x, rope)


class _Model(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(how)])
        self.register_buffer("rope", torch.ones(16, 8))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.layers[0](tokens, self.rope)


@pytest.mark.parametrize("how,expected", [
    ("ring", None),
    ("mask", "SDPA with an explicit attn_mask"),
    ("written_out", "no F.scaled_dot_product_attention call in the block"),
    ("arange", "positions computed inside the block (torch.arange"),
])
def test_context_parallel_found_from_the_block_graph(how, expected):
    """Causal SDPA called inline, the rotary table a model buffer: ring attention on the
    module that calls it, the buffer cut to each rank's positions; anything else named."""
    from torchtitan_autoparallel.graph.cp_find import RingSDPA, find_ring_sdpa

    with torch.device("meta"):
        model = _Model(how)
    inputs = ((torch.empty(1, 16, 32, device="meta"), model.rope), {})
    found = find_ring_sdpa(model, model.layers[0], inputs, 16, 32)
    if expected is None:
        assert found == RingSDPA("attn", ("rope",))
    else:
        assert isinstance(found, str) and found.startswith(expected), found
    # a rotary table computed in the model's forward is no buffer CP can cut
    computed = ((inputs[0][0], torch.ones(16, 8, device="meta")), {})
    if expected is None:
        assert "block input argument 1 of shape (16, 8) spans the sequence" in \
            find_ring_sdpa(model, model.layers[0], computed, 16, 32)


def test_context_parallel_needs_positions_and_sdpa():
    """A forward without ``positions`` (TorchTitan's CP passes them), flex attention."""
    from torchtitan_autoparallel.graph.cp_find import find_ring_sdpa

    class NoPositions(_Model):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.layers[0](tokens, self.rope)

    class FlexAttention(nn.Module):
        pass

    with torch.device("meta"):
        model = NoPositions("ring")
    inputs = ((torch.empty(1, 16, 32, device="meta"), model.rope), {})
    assert find_ring_sdpa(model, model.layers[0], inputs, 16, 32).startswith(
        "the model's forward takes no positions")
    model.layers[0].attn.kernel = FlexAttention()
    assert find_ring_sdpa(model, model.layers[0], inputs, 16, 32).startswith(
        "flex attention (attn.kernel: FlexAttention")


def test_plan_offers_found_context_parallel():
    """pocket_lm names no attention module: CP is found, offered and planned."""
    plan = _plan(2, "--parallelism.context_parallel_degree=2")
    assert plan.mesh.cp == 2
    assert not any(note.startswith("excluded cp") for note in plan.notes), plan.notes


def test_layer_graph_read_without_meta_init_is_the_same(monkeypatch):
    """The planning model is built on meta without running ``torch.nn.init`` (there are no
    values to fill): every layer it reads (parameters, FLOPs, bytes, shapes) equals what the
    model built with its initialisers gives, dense (llama3) and MoE (DeepSeek-V3) alike."""
    from torch.overrides import TorchFunctionMode

    from torchtitan_autoparallel.graph import layer_graph
    from torchtitan_autoparallel.job.inputs import model_layer_graph
    from torchtitan_autoparallel.titan.v0_2.registry import register

    class Initialising(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    register()
    for family in ("llama3", "deepseek_v3"):
        skipped = model_layer_graph(family, "debugmodel", 256)
        with monkeypatch.context() as patched:
            patched.setattr(layer_graph, "_NoMetaInit", Initialising)
            initialised = model_layer_graph(family, "debugmodel", 256)
        assert skipped.layers == initialised.layers, family
