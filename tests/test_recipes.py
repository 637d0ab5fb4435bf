"""Recipes (`--config FILE`, alignment/recipe.py): every file in recipes/ gives what the command in its comment gives
(and the bench demos' recipes what their drivers run); the command line overrides a recipe; a bad recipe is one
line; a run's saved config.json is a recipe that gives the run's flags back."""

import json
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from alignment.args import SCRIPTS, RLArgs, SFTArgs, EvalArgs, parse, to_dict
from alignment.run import Run

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))
PER_RUN = ["--model", "checkpoints/some-sft-run", "--seed", "3", "--output_dir", "outputs/some-rl-run"]  # the demos'


def documented(recipe: Path) -> tuple[str, list[str]]:
    """The script and the flags of the command a recipe's `# command:` line says it stands for."""
    line = next(line for line in recipe.read_text().splitlines() if line.startswith("# command: uv run "))
    words = shlex.split(line.removeprefix("# command: "))
    module = words[words.index("-m") + 1]
    return module.removeprefix("alignment."), words[words.index("-m") + 2:]


def keys(recipe: Path) -> set[str]:
    def flat(table):
        return {k for key, value in table.items() for k in (flat(value) if isinstance(value, dict) else {key})}
    return {key.replace("-", "_") for key in flat(tomllib.loads(recipe.read_text()))}


def one_error_line(capsys, cls, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(cls, argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and err.startswith("error: "), err
    return err


def test_the_recipes_folder_holds_the_readme_tour_the_default_run_and_each_demos_rl_stage():
    names = {recipe.stem for recipe in RECIPES}
    assert {"sft", "evaluate_sft", "rl_default", "steps_demo_rl", "tir_demo_rl_text", "tir_demo_rl_tool",
            "delethink_demo_rl_longcot", "delethink_demo_rl_delethink"} <= names, names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_each_recipe_gives_what_the_command_in_its_comment_gives(recipe):
    script, flags = documented(recipe)
    cls = SCRIPTS[script]
    extra = PER_RUN if "demo" in recipe.stem else []
    from_file, from_flags = parse(cls, ["--config", str(recipe)] + extra), parse(cls, flags + extra)
    assert to_dict(from_file) == to_dict(from_flags)
    assert keys(recipe) <= from_file.given_flags and from_flags.given_flags <= from_file.given_flags
    assert "config" not in to_dict(from_file)  # not a flag a resume would compare


def demo_commands() -> dict[str, list[str]]:
    """Each demo recipe's RL stage as its driver builds it, with the driver's defaults."""
    sys.path.insert(0, str(ROOT / "bench"))
    import delethink_demo
    import steps_demo
    import tir_demo
    model, seed, out = PER_RUN[1], int(PER_RUN[3]), Path(PER_RUN[5])
    commands = {"steps_demo_rl": steps_demo.rl_command(seed, out, Path(model), 20, 100, "vllm",
                                                       steps_demo.tasks("sums")[1])}
    for arm in tir_demo.ARMS:
        commands[f"tir_demo_rl_{arm}"] = tir_demo.rl_command(arm, seed, out, Path(model), 20, 100, "vllm")
    for arm in delethink_demo.ARMS:
        commands[f"delethink_demo_rl_{arm}"] = delethink_demo.rl_command(
            arm, seed, out, Path(model), 10, 100, "vllm", delethink_demo.BUDGET["until"], "until")
    return commands


def test_each_demo_recipe_is_the_rl_stage_its_driver_runs():
    for name, command in demo_commands().items():
        assert command[:2] == ["-m", "alignment.train_rl"]
        from_file = parse(RLArgs, ["--config", str(ROOT / "recipes" / f"{name}.toml")] + PER_RUN)
        assert to_dict(from_file) == to_dict(parse(RLArgs, command[2:])), name


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_command_line_overrides_the_recipe_and_values_are_typed_as_flags(tmp_path):
    recipe = write(tmp_path, "r.toml", 'learning_rate = 1\ncliprange_high = 0.28\neval_before_train = false\n'
                                       '[sampling]\ngroup_size = 8\nsampling-max-tokens = 64\n')
    args = parse(RLArgs, ["--config", recipe])
    assert to_dict(args) == to_dict(parse(RLArgs, ["--learning_rate", "1", "--cliprange_high", "0.28",
                                                   "--no_eval_before_train", "--group_size", "8",
                                                   "--sampling-max-tokens", "64"]))
    assert isinstance(args.learning_rate, float) and args.sampling_max_tokens == 64
    later = parse(RLArgs, ["--group_size", "4", f"--config={recipe}", "--eval_before_train", "--learning_rate", "2e-5"])
    assert (later.group_size, later.eval_before_train, later.learning_rate, later.cliprange_high) == (4, True, 2e-5, 0.28)


@pytest.mark.parametrize("text, says", [
    ("group_sze = 8", "unknown key group_sze; did you mean group_size?"),
    ("no_eval_before_train = true", "write eval_before_train = false"),
    ("lr = 1e-3", "lr is a flag of alignment.sft and alignment.expert_iteration, not of alignment.train_rl; its own "
                  "is learning_rate."),
    ("group_size = 8.0", "group_size = 8.0, but --group_size takes an integer"),
    ("group_size = true", "group_size = true, but --group_size takes an integer"),
    ("learning_rate = \"3e-5\"", "learning_rate = \"3e-5\", but --learning_rate takes a number"),
    ("eval_before_train = 1", "eval_before_train = 1, but --eval_before_train takes true or false"),
    ("model = 5", "model = 5, but --model takes a string (leave it out for the default)"),
    ("dataset = [\"gsm8k\"]", "but --dataset takes a string"),
    ("group_size = 4\n[sampling]\ngroup_size = 8", "group_size is given twice (the top level and [sampling]): keep one"),
    ("[a.b]\nmax_tokens = 1\n[c]\nmax-tokens = 2", None),  # (an evaluate flag: checked below with EvalArgs)
    ("group_size = ", "is not valid TOML: "),
    ("group_size = 4\ngroup_size = 8", "is not valid TOML: "),
    ("lam = 0.9", "--lam 0.9 (from --config "),  # moot without gae, as on the command line
    # a cross-flag rule against a default: the flag the recipe set is named with its file (the probe round's find)
    ("group_size = 3", "must be a multiple of --group_size 3 (--group_size from --config "),
])
def test_a_bad_recipe_is_one_line_naming_the_file_and_the_key(tmp_path, capsys, text, says):
    recipe = write(tmp_path, "bad.toml", text + "\n")
    if says is None:
        err = one_error_line(capsys, EvalArgs, ["--config", recipe])
        assert f"--config {recipe}: max_tokens is given twice ([a.b] and [c])" in err, err
        return
    err = one_error_line(capsys, RLArgs, ["--config", recipe])
    assert says in err and (recipe in err or "from --config" in err), err


@pytest.mark.parametrize("text, says", [
    ('loss_type = "grpo_klip"', 'loss_type = "grpo_klip": --loss_type \'grpo_klip\' is not one of no_baseline, '
                                'reinforce_with_baseline, grpo_clip, grpo_no_clip, gspo.'),
    ("n_steps = -5", "n_steps = -5: --n_steps must be greater than 0, not -5."),
    ("[algorithm]\nkl_coef = -0.1", "kl_coef = -0.1: --kl_coef must be 0 or more, not -0.1."),
    ("sampling_top_p = 1.5", "sampling_top_p = 1.5: --sampling_top_p is a fraction: at most 1, not 1.5."),
    ("cliprange = nan", "cliprange = nan: --cliprange must be a finite number, not nan."),
    ("async_steps = 2", "async_steps = 2: --async_steps 2 is not one of 0, 1."),
    ('dataset = "rg:chain_sum:max_terms"', 'dataset = "rg:chain_sum:max_terms": rg:chain_sum:max_terms: write task '
                                           'options as key=value'),
])
def test_a_recipes_bad_value_is_one_line_naming_the_file_and_the_key(tmp_path, capsys, text, says):
    """A value of the right type that its flag refuses (a choice it lacks, a number out of range) is refused as the
    command line refuses it, in one line that says which file and which key (docs/recipes.md)."""
    recipe = write(tmp_path, "bad.toml", text + "\n")
    err = one_error_line(capsys, RLArgs, ["--config", recipe])
    assert err.startswith(f"error: --config {recipe}: {says}"), err


def test_a_bad_value_in_a_saved_config_names_it_and_one_the_command_line_overrides_is_never_read(tmp_path, capsys):
    flags = {key: value for key, value in to_dict(parse(RLArgs, [])).items()
             if key not in ("output_dir", "resume", "overwrite")}  # (bookkeeping: skipped in a line of its own)
    saved = write(tmp_path, "config.json", json.dumps({**flags, "n_steps": -5}))
    assert one_error_line(capsys, RLArgs, ["--config", saved]) == (
        f"error: --config {saved}: n_steps = -5: --n_steps must be greater than 0, not -5.")
    recipe = write(tmp_path, "bad.toml", 'n_steps = -5\nloss_type = "grpo_klip"\n')
    assert parse(RLArgs, ["--config", recipe, "--n_steps", "3", "--loss_type", "gspo"]).n_steps == 3
    # and a bad value typed on the command line is said as before, with no recipe to name
    assert one_error_line(capsys, RLArgs, ["--config", recipe, "--n_steps", "-2", "--loss_type", "gspo"]) == (
        "error: --n_steps must be greater than 0, not -2.")


def test_a_missing_or_unreadable_recipe_is_one_line(tmp_path, capsys):
    assert f"--config {tmp_path}/none.toml: no such file." in one_error_line(
        capsys, RLArgs, ["--config", str(tmp_path / "none.toml")])
    assert "--config needs a file" in one_error_line(capsys, RLArgs, ["--config"])
    assert "--config is given twice" in one_error_line(capsys, RLArgs, ["--config", "a.toml", "--config", "b.toml"])
    assert "not valid JSON" in one_error_line(capsys, RLArgs, ["--config", write(tmp_path, "c.json", "{")])
    assert "not a list" in one_error_line(capsys, RLArgs, ["--config", write(tmp_path, "d.json", "[1]")])


def test_a_saved_run_config_gives_the_run_back(tmp_path, capsys):
    """A run's config.json (as Run writes it, with values check() implied and flags another made moot left at
    their defaults) parses back to the run's flags; its bookkeeping keys are skipped in one line."""
    flags = ["--loss_type", "no_baseline", "--eval_every", "0", "--group_size", "8", "--rollout_batch_size", "16",
             "--train_batch_size", "16", "--learning_rate", "1e-5", "--kl_coef", "0.05", "--microbatch_tokens", "512",
             "--seed", "3", "--output_dir", str(tmp_path / "run")]
    args = parse(RLArgs, flags)
    Run(args, "unused", "smollm2-135m")
    saved = tmp_path / "run" / "config.json"
    assert json.loads(saved.read_text())["advantage_estimator"] == "none"  # implied by no_baseline, then saved
    capsys.readouterr()
    again = parse(RLArgs, ["--config", str(saved), "--output_dir", str(tmp_path / "again")])
    said = capsys.readouterr().err.strip()
    assert said == (f"[config] {saved}: skipped output_dir, start_model, script, resume, overwrite (the saved run's own "
                    f"bookkeeping; this run's folder is --output_dir's)"), said
    assert to_dict(again) == {**to_dict(args), "output_dir": str(tmp_path / "again")}
    assert "eval_before_train" not in again.given_flags and {"kl_coef", "seed"} <= again.given_flags
    assert "a run of alignment.train_rl, not of alignment.sft" in one_error_line(capsys, SFTArgs, ["--config", str(saved)])


def test_every_key_a_run_adds_about_itself_is_skipped(tmp_path, capsys):
    """What Run writes beside the flags (the folder, the start model, the script, a --reward_fn file's hash) is no
    flag to give again: skipped and said, never an unknown key."""
    args = parse(RLArgs, ["--group_size", "8", "--output_dir", str(tmp_path / "run")])
    saved = write(tmp_path, "config.json", json.dumps({**to_dict(args), "start_model": "smollm2-135m",
                                                        "script": "train_rl", "reward_fn_sha256": "0" * 64}))
    again = parse(RLArgs, ["--config", saved])
    assert "reward_fn_sha256" in capsys.readouterr().err
    assert to_dict(again) == {**to_dict(args), "output_dir": None}
