"""Every Fix the CLI prints is a command line, and that command works.

Each bad invocation below is a kind of mistake a user can make on the command line. Its
error's "Fix:" is read back, run through the same ``main`` and must exit 0. The runs
are kept small (gpt-tiny, two devices, 16 tokens; ``plan`` where nothing needs
compiling) so the whole table runs in-process in well under a minute.
"""

import re
import shlex
import shutil
from pathlib import Path

import pytest

from shardkit.cli import build_parser, main
from shardkit.cli.fixes import edit

#: Spellings only Python has: a module prefix, calls, dicts, lists, quoted strings.
PYTHON_ONLY = re.compile(r"\bsk\.|\bjax\b|[(){}\[\]'\"]|\w+=\w*\(|mesh_shape|recipes\.get")

SMALL = ["--devices", "2", "--seq", "16"]
USER_MODEL = "examples.my_model:build"
LAYOUT = ["--recipe", "fsdp_cp", "--devices", "4"]  # fsdp=2 × sequence=2, ring attention
PIPELINE = ["--recipe", "pp", "--schedule", "1f1b", "--microbatches", "3", "--batch", "3"]

# Several mistakes share their fixed command: it compiles once (``_run`` remembers it).
# fmt: off
CASES = {
    # A layout that does not fit: the model, the batch, the sequence, the mesh.
    "mesh axis does not divide a model dimension": ["plan", "--recipe", "tp", "--devices", "6"],
    "mesh axis does not divide the layers": ["report", "--recipe", "pp", "--devices", "8",
                                             *PIPELINE[2:], "--seq", "16"],
    "mesh axis does not divide the batch": ["report", *LAYOUT, "--batch", "3", "--seq", "128"],
    "mesh axis does not divide the sequence": ["report", *LAYOUT, "--batch", "4", "--seq", "127"],
    "sequence ring attention cannot cut into chunks": ["report", *LAYOUT, "--batch", "4",
                                                        "--seq", "126"],
    "sequence longer than the model's positions": ["report", *LAYOUT, "--batch", "4", "--seq",
                                                   "1000"],
    "device count the recipe's sizes do not factor": ["plan", "--recipe", "fsdp_tp", "--devices",
                                                      "6"],
    "mesh sizes that do not multiply to the devices": ["plan", "--recipe", "dp_tp_sp", "--mesh",
                                                       "data=3"],
    "mesh axis the recipe does not use": ["plan", "--recipe", "fsdp", "--mesh", "tensor=2"],
    "two mesh axes of size -1": ["plan", "--recipe", "dp_tp_sp", "--mesh", "data=-1,tensor=-1"],
    "more devices than there are": ["plan", "--devices", "64"],
    # Names.
    "unknown recipe": ["plan", "--recipe", "ddp"],
    "unknown recipe in a list": ["compare", "--recipes", "dp,ddp", "--plot", "figure.png",
                                 *SMALL],
    "unknown recipe of a layout": ["reshard-plan", "--from", "fsdp@8", "--to", "ttp@4"],
    "unknown model": ["plan", "--model", "gpt-tiyn"],
    # Flags that do not go together.
    "--remat on a model of one's own": ["report", "--model", USER_MODEL, "--remat", "full",
                                        *SMALL],
    "pipeline flags with a recipe that cannot pipeline": ["report", "--recipe", "cp",
                                                          *PIPELINE[2:], *SMALL],
    "--rolled with a recipe that cannot pipeline": ["report", "--recipe", "cp", "--rolled",
                                                    *SMALL],
    "micro-batches that do not divide the batch": ["report", *PIPELINE[:-2], *SMALL],
    "unknown pipeline schedule": ["report", *PIPELINE[:2], "--schedule", "1fb1", *PIPELINE[4:],
                                  *SMALL],
    "a layout spelled without its device count": ["reshard-plan", "--from", "fsdp8", "--to",
                                                  "tp@4"],
    "processes that do not split the devices": ["reshard-plan", "--from", "fsdp@8", "--to",
                                                "tp@4", "--processes", "3"],
    "a layout whose devices do not divide the model": ["reshard-plan", "--from", "fsdp@3",
                                                       "--to", "tp@4"],
    "fewer than one step": ["run", "--steps", "0", "--batch", "2", "--no-report", *SMALL],
    "--resume without a checkpoint directory": ["run", "--steps", "1", "--resume", "--batch",
                                                "2", "--no-report", *SMALL],
    # Two mistakes at once: the fix changes two flags.
    "interleaved stages the layers cannot fill, and the batch": ["report", *PIPELINE[:2],
                                                                 "--schedule", "interleaved",
                                                                 *PIPELINE[4:6], *SMALL],
    "two layouts whose devices do not divide the model": ["reshard-plan", "--from", "fsdp@3",
                                                          "--to", "tp@6"],
    # Output paths, checked before any work.
    "output in a directory that does not exist": ["plan", "--json", "no/such/dir/plan.json"],
    "output path that is a directory": ["plan", "--json", "."],
    "figure with a suffix matplotlib cannot write": ["compare", "--recipes", "dp", "--plot",
                                                     "figure.txt", *SMALL],
}
# fmt: on

_RAN: dict[str, int] = {}


def _run(argv: list[str]) -> int:
    """``main(argv)``, once per distinct command (the same flags, in any order)."""
    args = vars(build_parser().parse_args(argv))
    key = repr(sorted((k, v) for k, v in args.items() if not callable(v)))
    if key not in _RAN:
        _RAN[key] = main(argv)
    return _RAN[key]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh directory to run in (fixes write their outputs here), with the example model."""
    shutil.copytree(Path(__file__).resolve().parents[2] / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv", CASES.values(), ids=CASES.keys())
def test_the_fix_the_cli_prints_is_a_command_that_works(argv, workdir, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardkit {argv[0]}: error: ") and "\n" not in err
    problem, sep, fix = err.partition(" Fix: ")
    assert sep, f"no Fix in: {err}"
    assert fix.startswith(f"shardkit {argv[0]} "), fix
    assert not PYTHON_ONLY.search(fix), f"a Python spelling in the fix: {fix}"
    assert "Fix:" not in problem  # the library's own fix is replaced, not kept beside it
    fixed = shlex.split(fix)[1:]
    assert fixed != argv
    assert _run(fixed) == 0, f"{fix} failed: {capsys.readouterr().err}"


def test_a_model_without_a_cut_under_a_pipeline_recipe_is_told_how_to_give_one(capsys):
    # No flag fixes this: the model's factory gives its cut, and the message says how.
    argv = ["report", "--recipe", "pp", "--model", USER_MODEL, *SMALL]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardkit report: error: ") and "\n" not in err
    problem, sep, fix = err.partition(" Fix: ")
    assert sep and "'stages'" in fix and "docs/howto/your_own_model.md" in fix, err


def test_when_no_command_can_be_checked_the_fix_still_speaks_flags(capsys, tmp_path, monkeypatch):
    # Whether a layout fits a memory budget is known only by planning: the fix names flags.
    monkeypatch.setenv("SHARDKIT_CACHE_DIR", str(tmp_path))
    assert (
        main(
            [
                "autoplan",
                "--devices",
                "2",
                "--batch",
                "2",
                "--seq",
                "16",
                "--recipes",
                "dp",
                "--remat",
                "none",
                "--memory-gb",
                "0.0001",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    fix = err.split(" Fix: ", 1)[1]
    assert "--memory-gb" in fix and "--devices" in fix and not PYTHON_ONLY.search(fix)


def test_python_users_still_get_python_fixes():
    # The same mistake as the first case, made in Python: the fix names Python arguments.
    import jax

    import shardkit as sk
    from shardkit import models, train

    plan = sk.Plan("tp", devices=jax.devices()[:6])
    with pytest.raises(sk.errors.IndivisibleError, match=r"in the rules"):
        plan.abstract_init(train.init_fn(models.get("gpt-tiny"), train.adamw()), jax.random.key(0))
    with pytest.raises(sk.ShardingError, match=r"sk\.recipes\.register"):
        sk.recipes.get("ddp")


def test_edit_sets_drops_and_appends_flags():
    argv = ["report", "--json", "--microbatches=4", "--recipe", "pp", "--schedule", "gpipe"]
    changed = edit(
        argv, {"--recipe": "dp", "--microbatches": None, "--schedule": None, "--devices": "2"}
    )
    # --json alone takes no value: "--microbatches=4" stays a token of its own.
    assert changed == ["report", "--json", "--recipe", "dp", "--devices", "2"]
    assert edit(["plan", "--json", "out.json"], {"--json": None}) == ["plan"]
