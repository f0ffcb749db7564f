"""The README's code runs, CI runs the README's test command, and the samples the README
moved to the docs (the reference models, the errors) are the real ones."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
HOWTO = ROOT / "docs" / "howto"


def test_readme_is_short_and_its_links_resolve():
    assert len(README.splitlines()) <= 200
    targets = re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", README)
    assert targets, "the README links into the docs"
    for target in targets:
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to a missing {target}"


def test_readme_flow_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert "P('fsdp'," in capsys.readouterr().out
    assert float(namespace["loss"]) > 0


def test_ci_runs_the_readme_test_command():
    marker = README.index("<!-- test-command -->")
    command = README[marker:].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert "pytest" in command
    assert "<!-- test-command -->" in (ROOT / ".ci" / "run").read_text()


def test_quick_start_is_two_commands():
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", quick, flags=re.S)
    assert len(commands) == 2 and all(c.count("\n") == 1 for c in commands)
    assert "shardkit run" in commands[0] and "--devices 8" in commands[0]


def test_readme_own_model_example_runs(capsys):
    """The second example continues the first (its plan, init, step and batch)."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    capsys.readouterr()
    exec(compile(blocks[1], "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert out.startswith("P('fsdp', None)\n") and "memory per device" in out
    assert namespace["report"].to_json()["workload"]["batch"] == 8


def test_reference_models_table_matches_the_models():
    import jax
    import numpy as np

    from shardkit import models

    page = (HOWTO / "recipes.md").read_text()
    table = page.split("<!-- reference-models -->", 1)[1].split("\n\n", 1)[0]
    rows = [
        [c.strip(" `") for c in line.split("|")[1:-1]] for line in table.strip().splitlines()[2:]
    ]
    assert [r[0] for r in rows] == models.names()
    for name, api, params, width, layers, heads, vocab, max_seq in rows:
        model = models.get(name)
        c = model.config
        # Parameters counted from the abstract init (not from the config's own formula).
        shapes = jax.eval_shape(model.init, jax.random.key(0))
        count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
        assert int(params.replace(",", "")) == count
        assert api == ("linen" if c.family == "gpt" else "NNX")
        assert (int(width.replace(",", "")), int(layers)) == (c.d_model, c.n_layers)
        assert heads == f"{c.n_heads} ({c.n_kv_heads})"
        assert (int(vocab.replace(",", "")), int(max_seq.replace(",", ""))) == (c.vocab, c.max_seq)


def test_the_sample_error_is_the_real_one():
    import shardkit as sk

    page = (HOWTO / "annotate.md").read_text()
    block = page.split("Mistakes raise `sk.ShardingError`", 1)[1].split("```", 2)[1]
    try:
        sk.recipes.get("tp").rules.spec(
            ("embed", "heads", "kv"),
            (768, 12, 64),
            {"data": 1, "tensor": 8},
            "params/layers/attn/query/kernel",
        )
    except sk.ShardingError as e:
        assert " ".join(block.split()) == " ".join(str(e).split())
    else:
        raise AssertionError("no error")


def test_the_sample_cli_errors_are_the_real_ones(capsys):
    """Each ``$ shardkit ...`` line of the block and the error it prints, word for word."""
    import shlex

    from shardkit.cli import main

    page = (HOWTO / "costing.md").read_text()
    block = page.split("<!-- cli-errors -->", 1)[1].split("```", 2)[1]
    samples = [s.split("\n", 1) for s in block.split("$ shardkit ")[1:]]
    assert len(samples) == 3
    for command, expected in samples:
        assert main(shlex.split(command)) == 2
        assert " ".join(capsys.readouterr().err.split()) == " ".join(expected.split())
