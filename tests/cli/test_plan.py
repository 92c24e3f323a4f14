"""``annot plan FILE:CLASS``: the table, --json, memory errors, --init's guard.

The command runs in-process (``annot.cli.main.main``) on a model file written to
a temporary directory.
"""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from annot.cli.main import main

NET = textwrap.dedent(
    '''
    """A small model file, as a user would write it."""
    from os import system  # imported, not defined here: --init may not call it

    import torch
    import torch.nn as nn

    from annot import stage


    class Config:
        def __init__(self, width=16, depth=4):
            self.width, self.depth = width, depth


    @stage(auto=True)  # the segments of forward: annot.plan.segments
    class Net(nn.Module):
        def __init__(self, cfg=None):
            super().__init__()
            cfg = cfg or Config()
            self.inp = nn.Linear(16, cfg.width)
            self.blocks = nn.ModuleList(nn.Linear(cfg.width, cfg.width) for _ in range(cfg.depth))
            self.out = nn.Linear(cfg.width, 1)

        def forward(self, x, scale=1.0):
            h = self.inp(x)
            for block in self.blocks:
                h = torch.tanh(block(h))
            return self.out(h) * scale


    @stage(auto=True)
    class Tokens(nn.Module):
        def __init__(self, vocab=50, width=8):
            super().__init__()
            self.emb = nn.Embedding(vocab, width)
            self.proj = nn.Linear(width, width)

        def forward(self, idx):
            h = self.emb(idx)
            return self.proj(h)
    '''
)


@pytest.fixture
def net(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(NET)
    return path


def plan(capsys, *argv):
    rc = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _parallelize_plans(path: str) -> tuple:
    """What parallelize chose for Plain at pp=2 on two ranks: (boundaries, the
    units of its plan table)."""
    import importlib.util
    import sys

    import annot

    spec = importlib.util.spec_from_file_location("plain_net", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["plain_net"] = module  # imported as annot plan imports it: its source is found
    spec.loader.exec_module(module)
    model = annot.parallelize(module.Plain, mesh=annot.Mesh(pp=2), seed=0)
    return model.report.boundaries, model.report.plan_table


def test_a_class_without_stage_is_planned_as_parallelize_plans_it(tmp_path, capsys):
    """One rule for the units (annot.plan.unit_source.plans_over_modules) and one
    default cost: for a class without @stage, annot plan and parallelize cut
    at the same boundaries over the same units (module calls at any depth)."""
    from annot.testing import run_ranks

    path = tmp_path / "plain.py"
    path.write_text(NET.replace("@stage(auto=True)", "").replace("class Net(", "class Plain("))
    rc, out, err = plan(capsys, f"{path}:Plain", "--pp", 2, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["cost"] == "params"
    boundaries, table = run_ranks(_parallelize_plans, 2, str(path))[0]
    assert list(boundaries) == doc["boundaries"]
    assert "over 6 units" in table  # module calls: inp, blocks.0-3, out
    assert len(doc["units"]) == 6


def test_table_with_two_stages_and_the_imbalance(net, capsys):
    rc, out, err = plan(
        capsys, f"{net}:Net", "--pp", 2, "--input", "x=float32[4,16]", "--cost", "time"
    )
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("assuming: microbatch x=[4, 16]; 8 microbatches, schedule 1f1b")
    assert lines[1].startswith("annot plan: Net in 2 stages over 6 segments; balanced cost: ")
    assert "measured time" in lines[1]
    header = next(i for i, line in enumerate(lines) if line.startswith("stage"))
    assert lines[header].split() == [
        "stage", "first", "last", "params", "FLOPs", "time", "memory", "sends"
    ]  # fmt: skip
    rows = [line.split()[0] for line in lines[header + 2 :] if line[:1].isdigit()]
    assert rows == ["0", "1"]
    assert re.search(r"^imbalance \(max/mean stage cost\): \d+\.\d\d$", out, re.M)
    assert re.search(r"^boundaries: (blocks\.[0-3]|out)$", out, re.M)


def test_json_has_the_boundaries(net, capsys):
    rc, out, err = plan(
        capsys, f"{net}:Net", "--pp", 3, "--input", "x=float32[4,16]", "--cost", "flops", "--json"
    )
    assert rc == 0, err
    data = json.loads(out)
    assert data["n_stages"] == 3
    assert data["cost"] == "flops"
    assert len(data["boundaries"]) == 2
    names = [s["name"] for s in data["segments"]]
    assert names == ["inp", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "out"]
    assert set(data["boundaries"]) <= set(names[1:])
    assert [s["stage"] for s in data["stages"]] == [0, 1, 2]
    assert data["imbalance"] >= 1.0


def test_without_input_parameters_are_balanced(net, capsys):
    rc, out, err = plan(capsys, f"{net}:Net", "--pp", 2)
    assert rc == 0, err
    assert "balanced cost: parameter bytes" in out
    assert "no sample input" in out


def test_infeasible_memory_exits_2_with_the_numbers(net, capsys):
    rc, out, err = plan(
        capsys, f"{net}:Net", "--pp", 2, "--input", "x=float32[4,16]", "--memory", "1KiB"
    )
    assert rc == 2
    assert out == ""
    assert re.search(
        r"annot plan: segment \d+ alone needs \d+ bytes .* > memory budget 1024 bytes", err
    )


def test_fit_finds_the_stage_count(net, capsys):
    rc, out, err = plan(capsys, f"{net}:Net", "--pp", 5, "--memory", "5KiB", "--fit", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert 2 <= data["n_stages"] <= 5
    assert all(s["memory"] <= 5 * 1024 for s in data["stages"])


@pytest.mark.parametrize(
    "expr, refused",
    [
        ("os.system('touch {marker}')", "os.system"),
        ("system('touch {marker}')", "system"),
        ("__import__('os').system('touch {marker}')", "__import__('os').system"),
        ("Net(Config(width=open('{marker}', 'w')))", "open"),
        ("Config(width=(lambda: 8)())", "lambda: 8"),
    ],
)
def test_bad_init_is_refused_never_evaluated(net, capsys, tmp_path, expr, refused):
    marker = tmp_path / "PWNED"
    rc, out, err = plan(capsys, f"{net}:Net", "--pp", 2, "--init", expr.format(marker=marker))
    assert rc == 2
    assert out == ""
    assert f"refused {refused!r}" in err
    assert not marker.exists()


def test_init_calls_classes_of_the_file_with_literals(net, capsys):
    for init in ("Net(Config(width=8, depth=3))", "Config(width=8, depth=3)"):
        rc, out, err = plan(capsys, f"{net}:Net", "--pp", 2, "--init", init, "--json")
        assert rc == 0, err
        data = json.loads(out)
        assert [s["name"] for s in data["segments"]][1:] == [
            "blocks.0",
            "blocks.1",
            "blocks.2",
            "out",
        ]
        assert data["segments"][1]["params"] == 8 * 8 + 8
    rc, out, err = plan(capsys, f"{net}:Net", "--pp", 2, "--init", "Config(width=x)")
    assert rc == 2
    assert "'x' is not a literal" in err


def test_config_json(net, capsys, tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"width": 4, "depth": 2}')
    rc, out, err = plan(
        capsys, f"{net}:Net", "--pp", 2, "--init", "Config", "--config-json", cfg, "--json"
    )
    assert rc == 0, err
    assert json.loads(out)["segments"][1]["params"] == 4 * 4 + 4
    rc, out, err = plan(
        capsys, f"{net}:Tokens", "--pp", 2, "--config-json", '{"vocab": 20}', "--json"
    )
    assert rc == 0, err
    assert json.loads(out)["segments"][0]["params"] == 20 * 8


def test_int_inputs_take_a_range(net, capsys):
    # measured time runs the sample on real weights, where an index past the vocab raises
    args = [f"{net}:Tokens", "--pp", 2, "--cost", "time", "--input", "idx=int64[2,5]:vocab=50"]
    rc, out, err = plan(capsys, *args)
    assert rc == 0, err
    rc, out, err = plan(capsys, *args[:-1], "idx=int64[2,5]")  # ints in [0, 2)
    assert rc == 0, err
    rc, out, err = plan(capsys, *args[:-1], "idx=int64[2,5]:100000")  # past the vocab
    assert rc == 2
    assert "running Tokens on the sample raised IndexError" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--input", "x=float32(4,16)"], "expected NAME=DTYPE[D0,D1,...]"),
        (["--input", "x=complex7[4]"], "unknown dtype 'complex7'"),
        (["--input", "y=float32[4,16]"], "Net.forward has no argument 'y'"),
        (["--input", "x=float32[4,16]:9"], "a range (:9) is for integer inputs"),
        (["--memory", "lots"], "--memory: memory='lots'"),
        (["--fit"], "--fit needs --memory"),
        (["--cost", "time"], "cost='time' is measured on a sample input"),
    ],
)
def test_bad_specs_exit_2(net, capsys, argv, message):
    rc, out, err = plan(capsys, f"{net}:Net", "--pp", 2, *argv)
    assert rc == 2
    assert out == ""
    assert message in err


def test_bad_targets_exit_2(net, capsys, tmp_path):
    assert plan(capsys, f"{net}:Nope", "--pp", 2)[:2] == (2, "")
    assert plan(capsys, str(net), "--pp", 2)[0] == 2
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('top level ran')\n")
    rc, _, err = plan(capsys, f"{broken}:Net", "--pp", 2)
    assert rc == 2
    assert "importing it raised RuntimeError: top level ran" in err
    rc, _, err = plan(capsys, f"{net}:Net", "--pp", 9)
    assert rc == 2
    assert "fewer than the 9 stages" in err


def test_tp_is_noted(net, capsys):
    rc, out, err = plan(capsys, f"{net}:Net", "--pp", 2, "--tp", 2)
    assert rc == 0, err
    assert "tp=2: parameters and FLOPs of @shard-ed layers divided by 2" in out


def test_help_says_the_file_runs(capsys):
    from annot.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--help"])
    out = capsys.readouterr().out
    assert "top-level code runs" in out
    assert "--init is read, not evaluated" in out


# ---- models whose blocks sit below forward: annot.plan.module_units -------------------------


def test_installed_hf_class_planned_over_nested_blocks(capsys):
    cfg = (
        '{"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64}'
    )
    argv = ["plan", "transformers.models.llama.modeling_llama:LlamaForCausalLM"]
    assert main([*argv, "--pp", "2", "--config-json", cfg, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cost"] == "params"
    # whole blocks balance two stages: a boundary the nested source split cuts
    assert doc["boundaries"] == ["model.layers.2"]  # inside LlamaModel.forward
    assert doc["units"][:3] == ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    assert doc["imbalance"] < 1.2
    assert doc["runner"]["name"] == "source"
    # three stages over four blocks: a block's parts balance them more than 5% better
    assert main([*argv, "--pp", "3", "--config-json", cfg, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["units"][:3] == ["model.embed_tokens", "model.layers.0", "model.layers.0.self_attn"]
    assert any(b.endswith((".mlp", ".self_attn")) for b in doc["boundaries"]), doc["boundaries"]
    assert doc["runner"]["name"] == "replay"


def test_installed_hf_class_module_plan_takes_flops_memory_fit_and_tp(capsys):
    cfg = (
        '{"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64}'
    )
    argv = ["plan", "transformers.models.llama.modeling_llama:LlamaForCausalLM", "--pp", "4"]
    argv += ["--config-json", cfg, "--json", "--input", "input_ids=int64[2,16]:64"]
    assert main([*argv, "--cost", "flops"]) == 0
    flops = json.loads(capsys.readouterr().out)
    assert flops["cost"] == "flops"
    assert len(flops["boundaries"]) == 3
    assert main([*argv, "--cost", "params", "--tp", "2"]) == 0
    tp2 = json.loads(capsys.readouterr().out)
    # every stage within 300 KiB at tp=2 (the weights split in two), fewer stages
    fit_argv = ["--cost", "params", "--tp", "2", "--memory", "300KiB", "--fit"]
    assert main([*argv, *fit_argv, "--microbatches", "1"]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert len(fit["boundaries"]) < 3
    assert max(fit["stage_memory"]) <= 300 * 1024
    # the same model at tp=2: its linears and embeddings in halves (and what they compute)
    assert sum(tp2["stage_memory"]) < 0.75 * sum(flops["stage_memory"])


def test_file_whose_forward_cannot_be_cut_falls_back_to_its_modules(capsys):
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "nested_models.py")
    assert main(["plan", f"{path}:TimmStyleViT", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "blocks." in out
    assert out.strip().splitlines()[-1].startswith("split=['blocks.")


def test_a_model_that_needs_arguments_is_told_about_init(tmp_path, capsys):
    src = tmp_path / "needs.py"
    src.write_text(
        "import torch.nn as nn\n\n\n"
        "class Needs(nn.Module):\n"
        "    def __init__(self, config):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(config.width, config.width)\n"
    )
    rc, out, err = plan(capsys, f"{src}:Needs", "--pp", 2)
    assert rc == 2
    assert out == ""
    assert "building Needs raised TypeError" in err
    assert "say how to build it with --init, e.g. --init 'Config(n_layer=8)'" in err


def test_world_size_prints_every_pp_tp_dp_fitting_first(capsys):
    cfg = (
        '{"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64}'
    )
    argv = ["plan", "transformers.models.llama.modeling_llama:LlamaForCausalLM"]
    argv += ["--config-json", cfg, "--world-size", "4", "--memory", "1MiB", "--seq-len", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("assuming: microbatch 1 x 16 tokens; 8 microbatches, schedule 1f1b")
    rows = [line.split() for line in out if line[:3].strip().isdigit()]
    assert sorted((int(r[0]), int(r[1]), int(r[2])) for r in rows) == [
        (1, 1, 4),
        (1, 2, 2),
        (1, 4, 1),
        (2, 1, 2),
        (2, 2, 1),
        (4, 1, 1),
    ]
    fits = [r[-1] == "yes" for r in rows if "refused:" not in r]
    assert fits == sorted(fits, reverse=True)  # fitting choices first
    assert rows[-1][:8] == ["1", "4", "1", "refused:", "tp=4", "does", "not", "divide"]
    assert "leaves out communication" in out[-1]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["choices"]) == 6
    assert doc["assuming"] == out[0]
    assert main([*argv, "--pp", "2"]) == 2  # one or the other
    assert "not both" in capsys.readouterr().err


def test_the_default_cost_is_flops_with_a_sample_else_parameters(net, capsys, tmp_path):
    """annot.plan.unit_source.default_cost, the one default parallelize uses
    too: over a forward's segments FLOPs with a sample, else parameters; over
    module calls parameters (a class without @stage)."""
    rc, out, err = plan(capsys, f"{net}:Net", "--pp", 2, "--input", "x=float32[4,16]", "--json")
    assert rc == 0, err
    assert json.loads(out)["cost"] == "flops"
    rc, out, err = plan(capsys, f"{net}:Net", "--pp", 2, "--json")
    assert rc == 0, err
    assert json.loads(out)["cost"] == "params"
    path = tmp_path / "plain.py"
    path.write_text(NET.replace("@stage(auto=True)", "").replace("class Net(", "class Plain("))
    rc, out, err = plan(capsys, f"{path}:Plain", "--pp", 2, "--input", "x=float32[4,16]", "--json")
    assert rc == 0, err
    assert json.loads(out)["cost"] == "params"
