"""Recipes: a script's flags in a file, `--config recipe.toml` (recipes/ holds the README's and the demos' runs).

A recipe is TOML whose keys are the flags' names (`group_size = 8`; `max-tokens` means max_tokens, as on the
command line), optionally grouped in tables of any name (`[sampling]`), which are flattened: a key given twice
across tables is an error. A run's saved `config.json` is a recipe too, less the keys a run adds about itself
(BOOKKEEPING); one of another script is refused. Each value must be what the flag takes: true or false for a
switch, an integer for an int (a float is refused), a number for a float, a string for the rest. `parse` puts the
values under the command line (flags given there win) and counts the keys as given flags, so a recipe key that
another flag makes moot is refused as the flag would be.
"""

import difflib
import json
import os
import sys
import tomllib
from dataclasses import fields
from pathlib import Path

# What a run's config.json (alignment/run.py) holds about the run itself rather than as a flag to give again
BOOKKEEPING = ("output_dir", "start_model", "script", "resume", "overwrite", "reward_fn_sha256", "prompt_file_sha256",
               "dataset_sha256", "eval_dataset_sha256", "train_file_sha256", "accept_changed_data",
               "accept_changed_reward")  # the last two: what one --resume accepted (args.ONE_RESUME)


def take_config(argv: list[str]) -> tuple[list[str], str | None]:
    """argv without `--config FILE` (or `--config=FILE`), and FILE."""
    rest, path = [], None
    words = iter(argv)
    for word in words:
        if word == "--config" or word.startswith("--config="):
            if path is not None:
                raise ValueError("--config is given twice: pass one recipe (flags on the command line override it).")
            path = word.partition("=")[2] if "=" in word else next(words, None)
            if not path or path.startswith("--"):
                raise ValueError("--config needs a file: --config recipes/<name>.toml or a run's config.json.")
        else:
            rest.append(word)
    return rest, path


def read_recipe(path: str, cls, scripts: dict, same_flag: dict) -> tuple[dict, set]:
    """The flags the recipe at `path` sets for `cls` (typed as the command line would give them), and the
    ones that count as given: every key of a TOML recipe; of a run's config.json those that are not the
    default (a saved config holds every flag, and most of them the run never set). `scripts`: each script's
    dataclass by name; `same_flag`: a flag by the name another script gives the same setting (args.py's)."""
    script = next((name for name, other in scripts.items() if other is cls), cls.__name__)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file.") from None
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror or e}).") from None
    except UnicodeDecodeError:
        raise ValueError(f"--config {path} is not a text file: a recipe is TOML, or a run's config.json.") from None
    saved_run = path.endswith(".json")
    try:
        table = json.loads(text) if saved_run else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--config {path} is not valid {'JSON' if saved_run else 'TOML'}: {e}.") from None
    if not isinstance(table, dict):
        raise ValueError(f"--config {path}: a recipe holds flag names and their values, not a {type(table).__name__}.")
    if saved_run:
        owner = table.get("script")
        if owner and owner != script:
            raise ValueError(f"--config {path} is the config of a run of alignment.{owner}, not of alignment.{script}: "
                             f"`uv run -m alignment.{owner} --config {path}`.")
        skipped = [key for key in BOOKKEEPING if key in table and not (key.startswith("accept_changed_")
                                                                      and table[key] is False)]  # nothing to say
        if skipped and os.environ.get("RANK", "0") == "0":
            print(f"[config] {path}: skipped {', '.join(skipped)} (the saved run's own bookkeeping; this run's folder "
                  f"is --output_dir's)", file=sys.stderr)
        table = {key: value for key, value in table.items() if key not in BOOKKEEPING}
    flags = {f.name: f for f in fields(cls)}
    values, where = {}, {}
    for key, value, table_name in _flat(table):
        name = key.replace("-", "_")
        if name in values:
            raise ValueError(f"--config {path}: {name} is given twice ({where[name]} and {table_name}): keep one.")
        if name not in flags:
            raise ValueError(f"--config {path}: {_unknown(name, cls, script, scripts, same_flag)}")
        values[name], where[name] = _typed(path, flags[name], value), table_name
    defaults = {name: f.default for name, f in flags.items()}
    given = {name for name, value in values.items() if not saved_run or value != defaults[name]}
    return values, given


def _flat(table: dict, table_name: str = "the top level"):
    """(key, value, the table it is in) for every value, nested tables opened."""
    for key, value in table.items():
        if isinstance(value, dict):
            inner = key if table_name == "the top level" else f"{table_name[1:-1]}.{key}"
            yield from _flat(value, f"[{inner}]")
        else:
            yield key, value, table_name


def _typed(path: str, f, value):
    """`value` as the flag `f` takes it from the command line, or one line saying what it should be."""
    kinds = getattr(f.type, "__args__", (f.type,))
    if value is None and type(None) in kinds:  # (JSON's null: a saved run's unset flag)
        return None
    kind = next(t for t in kinds if t is not type(None))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # --learning_rate 1 gives 1.0
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
    raise ValueError(f"--config {path}: {f.name} = {_shown(value)}, but --{f.name} takes {expected}"
                     f"{' (leave it out for the default)' if type(None) in kinds else ''}.")


def recipe_value_refused(path: str, name: str, value, reason: str) -> ValueError:
    """A recipe's value of the right type that its flag's own check refused (`reason`: what the command line would
    have been told), as one line naming the file and the key."""
    return ValueError(f"--config {path}: {name} = {_shown(value)}: {reason}")


def _shown(value) -> str:
    """A value as the recipe wrote it: TOML's and JSON's spelling of strings and switches."""
    return json.dumps(value) if isinstance(value, (bool, str, type(None))) else repr(value)


def _unknown(name: str, cls, script: str, scripts: dict, same_flag: dict) -> str:
    """What to say about a key that is no flag of `cls`: a switch written as its --no_ form, a flag of another
    script, or a near miss of one of its own."""
    own = [f.name for f in fields(cls)]
    if name.startswith("no_") and name[3:] in own:
        return f"unknown key {name}: write {name[3:]} = false."
    owners = [f"alignment.{other}" for other, other_cls in scripts.items()
              if other != script and name in {f.name for f in fields(other_cls)}]
    if owners:
        same = same_flag.get(name)
        return f"{name} is a flag of {' and '.join(owners)}, not of alignment.{script}" + (
            f"; its own is {same}." if same in own else " (see --help).")
    guess = difflib.get_close_matches(name, own, n=1)
    return f"unknown key {name}" + (f"; did you mean {guess[0]}?" if guess else
                                    f": not a flag of alignment.{script} (see --help).")
