"""Datasets as lists of dicts, and prompt templates.

Every loader returns rows `{"question": str, "answer": str}` (the gold answer, ready for the grader),
plus whatever else the source has (`solution` for GSM8K: the worked reasoning).

Data directory: `--data_dir`, else `$ALIGNMENT_DATA_DIR`, else `dataset/` in the project root.
GSM8K is downloaded on first use when missing (`uv run -m alignment.data download gsm8k` does it
explicitly); the MATH-style sets (math500, aime24, aime25, amc23, olympiadbench) are copied in by hand.
"""

import argparse
import json
import math
import os
import re
import urllib.error
import urllib.request
import warnings
from pathlib import Path

from alignment.drgrpo_grader import extract_gsm8k_answer
from alignment.errors import MissingFileError, UserError, cli, one_line_error
from alignment.seeds import derive_seed

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data"
MATH_STYLE = ("math500", "aime24", "aime25", "amc23", "olympiadbench")
BUILTIN_FILES = ("gsm8k", *MATH_STYLE)  # sets read from the data folder (a resume compares their files)
DATASETS = ("gsm8k",) + MATH_STYLE
# the most calculator annotations a GSM8K train solution holds (3 solutions): the budget the tool style (calculator.py)
# evaluates with; here, torch-free, for the card driver
MAX_TOOL_CALLS = 9


def resolve_data_dir(data_dir: str | None = None) -> Path:
    return Path(data_dir or os.environ.get("ALIGNMENT_DATA_DIR") or REPO_ROOT / "dataset")


GSM8K_AGAIN = "delete it and run `uv run -m alignment.data download gsm8k` again"


def read_jsonl(path: Path, required: tuple[str, ...], text: tuple[str, ...] | None = None,
               remedy: str | None = None, all_empty_ok: bool = True) -> list[dict]:
    """Read a JSONL file of objects with the `required` fields (the `text` ones, default all, strings), failing
    with one sentence that names the file and line of a bad row (also one whose text fields are all empty
    strings, unless `all_empty_ok`). `remedy` says what to do about a bad file: by default (a file of the
    user's, e.g. sft's --train_file) fix it; the dataset loaders pass their own."""
    path, text = Path(path), required if text is None else text
    remedy = remedy or "fix the file: each line must be one JSON object" + (
        f" with {', '.join(required)}" if required else ", one row per question")
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a file; pass the JSONL file itself.")
    _folder(path.parent, "check the path")  # a file in the way is named as such, not reported as missing
    if not path.exists():
        raise MissingFileError(f"{path} does not exist; check the path.")
    rows = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a BOM (as Windows tools save) is no text
            except UnicodeDecodeError as e:
                raise UserError(f"{path}:{line_no} is not UTF-8 text ({e.reason} at byte {e.start}); save the file as "
                                f"UTF-8 (e.g. `iconv -f latin1 -t utf-8`).") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{line_no} is not valid JSON ({e.msg}); {remedy}.") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{line_no} is not a JSON object ({line.strip()[:40]}); {remedy}.")
            missing = [key for key in required if key not in row]
            if missing:
                raise UserError(f"{path}:{line_no} lacks field(s) {', '.join(missing)}; {remedy}.")
            wrong = [f"{key} is {json.dumps(row[key])[:20]}" for key in text if not isinstance(row[key], str)]
            if wrong:
                raise UserError(f"{path}:{line_no}: {' and '.join(text)} must be strings ({', '.join(wrong)}); "
                                f"{remedy}.")
            if not all_empty_ok and not any(row[key] for key in text):
                raise UserError(f"{path}:{line_no}: {' and '.join(text)} are empty, nothing to train on; {remedy}.")
            rows.append(row)
    if not rows:
        raise UserError(f"{path} holds no rows; {remedy}.")
    return rows


DATA_DIR_AGAIN = "move it away, or point --data_dir / ALIGNMENT_DATA_DIR at another folder"


def _folder(path: Path, remedy: str = DATA_DIR_AGAIN) -> Path:
    """`path`, refused in one line where it or a folder above it is a file (not reported as missing)."""
    for part in (path, *path.parents):
        if part.is_dir():
            break
        if part.exists():
            raise UserError(f"{part} is a file where a folder is expected ({path}); {remedy}.")
    return path


def download_gsm8k(data_dir: str | Path | None = None, base_url: str | None = None,
                   splits: tuple[str, ...] = ("train", "test")) -> Path:
    """Fetch GSM8K's `splits` from the official repository into <data_dir>/gsm8k/ (those not there yet)."""
    out = _folder(resolve_data_dir(data_dir) / "gsm8k")
    out.mkdir(parents=True, exist_ok=True)
    base_url = base_url or os.environ.get("ALIGNMENT_GSM8K_URL", GSM8K_URL)
    for split in splits:
        target = out / f"{split}.jsonl"
        if target.exists():
            continue
        url = f"{base_url}/{split}.jsonl"
        print(f"[data] downloading {url} -> {target}")
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                payload = response.read()
        except (urllib.error.URLError, OSError) as e:
            if not any(out.iterdir()):
                out.rmdir()  # (made for the download: nothing is left behind)
            where = "point --data_dir at a folder that has it" if data_dir else "set ALIGNMENT_DATA_DIR"
            raise MissingFileError(f"could not download {url} ({e}); without a network, copy GSM8K's "
                                    f"{split}.jsonl to {target} or {where}.") from None
        tmp = target.with_suffix(".jsonl.tmp")
        tmp.write_bytes(payload)
        os.replace(tmp, target)  # never leave a half-written file behind
    return out


def load_gsm8k(split: str = "test", data_dir: str | None = None) -> list[dict]:
    if split not in ("train", "test"):  # before a download of a file that does not exist
        raise UserError(f"gsm8k has the splits train and test, not {split!r}; choose one (--split).")
    path = resolve_data_dir(data_dir) / "gsm8k" / f"{split}.jsonl"
    if not path.exists():
        download_gsm8k(data_dir, splits=(split,))  # only what is asked for: evaluate needs no train split
    rows = read_jsonl(path, ("question", "answer"), remedy=GSM8K_AGAIN)
    return [{"question": r["question"], "answer": extract_gsm8k_answer(r["answer"]), "solution": r["answer"]}
            for r in rows]


def load_math_style(name: str, data_dir: str | None = None) -> list[dict]:
    path = _folder(resolve_data_dir(data_dir) / name) / "test.jsonl"
    if not path.exists():
        raise MissingFileError(f"{path} is missing; copy the {name} test.jsonl (fields problem, answer) "
                                f"there or point --data_dir / ALIGNMENT_DATA_DIR at a folder that has it.")
    return [{**r, "question": r["problem"], "answer": str(r["answer"])}
            for r in read_jsonl(path, ("problem", "answer"), text=("problem",),  # a copied set's answers may be numbers
                                remedy=f"copy the {name} test.jsonl (fields problem, answer) there again")]


def load_reasoning_gym(spec: str, size: int, seed: int) -> list[dict]:
    """Procedural problems from the reasoning-gym package (offline, seeded). `spec` is a task name,
    optionally followed by its config fields: `chain_sum` or `chain_sum:max_terms=3,max_digits=2`."""
    with warnings.catch_warnings():  # some of its dependencies' modules compile with SyntaxWarnings (`is` with a literal)
        warnings.simplefilter("ignore", SyntaxWarning)
        import reasoning_gym

        from alignment import tasks  # noqa: F401  (registers the project's own tasks: rg:repeated_addition, rg:add_until)
    task, config = rg_options(spec)
    if task == "basic_arithmetic" and config.get("allow_parentheses") is False and \
            set(str(config.get("operators", "+-*/"))) & set("*/"):
        # reasoning-gym 0.1.19 evaluates such a chain left to right, not * and / first, and may print another
        # divisor than it divides by: a third of the answers disagree with the printed question
        raise UserError(f"rg:{spec}: reasoning-gym's basic_arithmetic without parentheses gets * and / wrong "
                        f"(left to right, no precedence); use operators=+- or allow_parentheses=true.")
    try:
        generated = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    except (KeyError, ValueError) as e:
        raise UserError(f"reasoning-gym has no task {task!r} ({e}); try rg:chain_sum, rg:basic_arithmetic "
                         f"or rg:gsm_symbolic.") from None
    except (TypeError, AssertionError) as e:
        raise UserError(f"rg:{spec}: reasoning-gym rejected the options ({e or 'invalid value'}); "
                         f"see the task's config class for its fields.") from None
    try:  # the rows are made here, one by one: options it accepted can still leave it nothing to draw from
        return [{"question": item["question"], "answer": str(item["answer"])} for item in generated]
    except (IndexError, ValueError, ZeroDivisionError, RecursionError) as e:
        raise UserError(f"rg:{spec}: reasoning-gym cannot generate a problem with these options ({type(e).__name__}: "
                        f"{e}); change them (for basic_arithmetic, operators needs one of + - *).") from None


def rg_options(spec: str) -> tuple[str, dict]:
    """`chain_sum:max_terms=3,max_digits=2` -> ("chain_sum", {"max_terms": 3, "max_digits": 2}); a malformed or
    repeated option is one line (the scripts check this when they parse their flags, before any work)."""
    task, _, options = spec.partition(":")
    config = {}
    for option in filter(None, options.split(",")):
        key, eq, value = option.partition("=")
        if not eq:
            raise UserError(f"rg:{spec}: write task options as key=value, e.g. rg:chain_sum:max_terms=3.")
        if key.strip() in config:
            raise UserError(f"rg:{spec}: {key.strip()} is given twice; give each option once.")
        config[key.strip()] = _option_value(value.strip())
        bound = next((most for part, most in RG_BOUNDS.items() if part in key), None)
        if bound is not None and isinstance(config[key.strip()], int) and config[key.strip()] > bound:
            raise UserError(f"rg:{spec}: {key.strip()}={config[key.strip()]} is above {bound:,} (every problem is made "
                            f"in memory at the start, and Python prints integers of at most 4,300 digits); lower it.")
    return task, config


RG_BOUNDS = {"digits": 1_000, "terms": 100_000, "times": 100_000}  # the most an rg: option of this kind may ask for


def _option_value(text: str):
    """`3` -> 3, `0.5` -> 0.5, `true`/`false` -> bool, anything else stays a string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


RG_TEST_SEED = 1_000_003  # every rg: test split's data seed, whatever the run's seed (the set evaluate scores)


def rg_data_seed(split: str, seed: int) -> int:
    """The reasoning-gym seed of a split. reasoning-gym seeds row i with `data seed + i`, so run seeds used as
    data seeds would give consecutive seeds the same rows shifted by one: a training split's data seed is a hash
    of (split, run seed), so each seed draws other questions; the test split's is fixed, so every run and every
    later `alignment.evaluate` score the same questions (31 bits: some tasks seed numpy with it)."""
    return RG_TEST_SEED if split == "test" else derive_seed("rg", split, seed) % 2**31


FILE_KINDS = (".jsonl", ".json", ".parquet", ".csv")  # a user's own table of questions (or a `datasets` folder)
HELD_OUT_EVERY = 10  # a file's test split: one question in ten, by a hash of its text (the same for every seed)


def is_file(name: str) -> bool:
    """Whether --dataset names a user's file or folder rather than a built-in set or an rg: task."""
    return bool(name) and (name.lower().endswith(FILE_KINDS) or name not in DATASETS and not name.startswith("rg:") and (
        "/" in name or Path(name).exists()))


def same_question(text: str) -> str:
    """The question as held out and compared: runs of whitespace made one space, the ends trimmed, so a copy that
    differs only in spacing is the same question (it would otherwise be trained on while its twin is evaluated).
    Text already in this form is unchanged, so its hash, and the split of a file without such copies, are too."""
    return " ".join(text.split())


def twin(text: str) -> str:
    """The question as compared with the evaluation's before training: `same_question`, with its case folded too, so
    a copy that differs only in case ("What"/"what") is also left out of training. (The held-out hash itself keeps
    case: folding it would move the split of every file.)"""
    return same_question(text).casefold()


def held_out(question: str) -> bool:
    """A file's row is in its test split by a hash of its question alone: no seed, no other row moves it."""
    return derive_seed("held out", same_question(question)) % HELD_OUT_EVERY == 0


FILE_SPLITS = ("test", "train", "all")  # a file's splits (evaluate --split); any other name is refused


def usable_answer(answer) -> bool:
    """A gold the graders can match: non-empty text or a finite number. An empty gold would reward an empty answer;
    true/false (a bool is an int) and NaN would become the golds "true" and "NaN"."""
    if isinstance(answer, str):
        return bool(answer.strip())
    return isinstance(answer, (int, float)) and not isinstance(answer, bool) and math.isfinite(answer)


def load_file(path: str, split: str, question_key: str = "question", answer_key: str = "answer",
              flag: str = "--dataset") -> list[dict]:
    """A user's rows (`.jsonl`, `.json` list, `.parquet`, `.csv`, or a folder saved by `datasets`): `question` and
    `answer` (a string: the built-in graders compare strings) from the named columns, and `columns`, every column
    but the answer one by its own name (what a --reward_fn receives). Split "test" is the held-out tenth
    (`held_out`), "train" the rest, "all" every row; a `datasets` folder with named splits gives its own. `flag`
    names the file in an error (--dataset or --eval_dataset)."""
    if question_key == answer_key:
        raise UserError(f"--question_key and --answer_key both name the column {question_key}: the gold answer would "
                        f"be the question; name the answer's column with --answer_key.")
    (rows, own_split), where = _read_table(Path(path), split, flag), f"{flag} {path}"
    if not own_split and split not in FILE_SPLITS:  # any other name quietly gave the training rows
        raise UserError(f"--split {split} is not a split of {path}; choose test (its held-out tenth), train or all.")
    if not rows:
        raise UserError(f"{where} holds no rows; give a file with one row per question.")
    missing = [key for key in (question_key, answer_key) if key not in rows[0]]
    if missing:
        flags = {question_key: "--question_key", answer_key: "--answer_key"}
        raise UserError(f"{where} has no column {', '.join(missing)} (its columns: {', '.join(map(str, rows[0]))[:200]}); "
                        f"name the right ones with {' and '.join(flags[key] for key in missing)}.")
    out = []
    for number, row in enumerate(rows, 1):
        question, answer = row.get(question_key), row.get(answer_key)
        if not isinstance(question, str) or not question.strip() or not usable_answer(answer):
            raise UserError(f"{where}: row {number} needs a non-empty text {question_key} and a non-empty text or "
                            f"finite number {answer_key} (it has {json.dumps(question, default=str)[:40]} and "
                            f"{json.dumps(answer, default=str)[:40]}); fix or drop it.")
        out.append({"question": question, "answer": answer if isinstance(answer, str) else json.dumps(answer),
                    "columns": {key: value for key, value in row.items() if key != answer_key}})
    if split == "all" or own_split:
        return out
    return [row for row in out if held_out(row["question"]) == (split == "test")]


def load_pairs(path: str, prompt_key: str = "prompt", response_key: str = "response") -> list[dict]:
    """SFT's --train_file: {prompt, response} rows from the named columns of any file load_file reads."""
    if path.lower().endswith(".jsonl"):  # every line checked, with its number
        rows = read_jsonl(Path(path), (prompt_key, response_key), all_empty_ok=False)
    else:
        rows = _read_table(Path(path), "all", "--train_file")[0]
        bad = next((n for n, row in enumerate(rows, 1) if not all(isinstance(row.get(key), str)
                                                                    for key in (prompt_key, response_key))), None)
        if bad or not rows:
            raise UserError(f"--train_file {path}: " + (f"row {bad} lacks a text {prompt_key} or {response_key} (name "
                            f"the columns with --prompt_key and --response_key)" if bad else "holds no rows") + ".")
        empty = next((n for n, row in enumerate(rows, 1) if not (row[prompt_key] or row[response_key])), None)
        if empty:  # read_jsonl's rule for .jsonl: no token to train on crashed the first step's forward
            raise UserError(f"--train_file {path}: row {empty}: {prompt_key} and {response_key} are empty, nothing to "
                            f"train on; fix or drop it.")
    return [{"prompt": row[prompt_key], "response": row[response_key]} for row in rows]


def _read_table(path: Path, split: str, flag: str = "--dataset") -> tuple[list[dict], bool]:
    """The file's rows, and whether they are the `split` the file itself names (a `datasets` folder's)."""
    if not path.exists():
        raise MissingFileError(f"{flag} {path} does not exist; check the path.")
    try:
        if path.is_dir():  # a folder `datasets` saved (save_to_disk): one dataset, or several splits
            import datasets
            saved = datasets.load_from_disk(str(path))
            if isinstance(saved, datasets.DatasetDict):
                if split == "all" and split not in saved:  # every row: each named split's, in the folder's order
                    return [row for name in saved for row in saved[name].to_list()], True
                if split not in saved:
                    raise UserError(f"{flag} {path} has the splits {', '.join(saved)}, not {split}; save a {split} "
                                    f"split, or save one dataset (its test split is then held out by question).")
                return saved[split].to_list(), True
            return saved.to_list(), False
        kind = path.suffix.lower()  # (`.JSONL` as some tools name it)
        if kind == ".jsonl":
            return read_jsonl(path, (), text=()), False
        if kind == ".json":
            rows = json.loads(path.read_text(encoding="utf-8-sig"))  # -sig: a BOM is not part of the text
            if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
                raise UserError(f"{flag} {path} must hold a JSON list of objects, one per question.")
            return rows, False
        if kind == ".parquet":
            import pyarrow.parquet
            return pyarrow.parquet.read_table(path).to_pylist(), False
        if kind == ".csv":
            import csv
            with open(path, newline="", encoding="utf-8-sig") as f:  # as Excel saves it: the BOM is no column name
                return _csv_rows(csv.DictReader(f), path), False
    except (OSError, ValueError) as e:  # a damaged parquet or folder, bad JSON, bytes that are not UTF-8
        if isinstance(e, UserError):
            raise
        raise UserError(f"{flag} {path} cannot be read ({type(e).__name__}: {str(e)[:200]}); fix the file.") from None
    raise UserError(f"{flag} {path}: give a {', '.join(FILE_KINDS)} file or a folder saved by `datasets`.")


def _csv_rows(reader, path: Path) -> list[dict]:
    """The CSV's rows; one with more fields than the header is refused (DictReader keeps the extra under None)."""
    twice = sorted({name for name in reader.fieldnames or () if name and (reader.fieldnames or []).count(name) > 1})
    if twice:  # DictReader would keep the last column of the name, silently
        raise UserError(f"{path}: the header names {', '.join(map(repr, twice))} more than once; give each column its "
                        f"own name.")
    rows = []
    for row in reader:
        if None in row:
            raise UserError(f"{path}:{reader.line_num} has {len(row) - 1 + len(row[None])} fields but the header names "
                            f"{len(reader.fieldnames)} ({', '.join(reader.fieldnames)})"[:300] + "; quote a field that "
                            f"holds a comma, or fix the row.")
        rows.append(row)
    return rows


EVALUATE_RG_SIZE = 2000  # the rg: test rows `alignment.evaluate` makes (and scores all of on a GPU, --limit 0)


def builtin_files(name: str, data_dir: str | None = None) -> list[Path]:
    """The files a built-in set is read from (under --data_dir, else ALIGNMENT_DATA_DIR), when all are there: a
    resume compares their sha256, so a run that moved to another data folder says so. [] for anything else."""
    folder = resolve_data_dir(data_dir)
    paths = ([folder / "gsm8k" / f"{split}.jsonl" for split in ("train", "test")] if name == "gsm8k" else
             [folder / name / "test.jsonl"] if name in MATH_STYLE else [])
    return paths if paths and all(path.is_file() for path in paths) else []


def test_twins(name: str, data_dir: str | None = None, question_key: str = "question", answer_key: str = "answer",
               flag: str = "--dataset") -> set[str]:
    """The twins of every question `alignment.evaluate --dataset name` can score: its whole test split (a file's
    hashed tenth, a `datasets` folder's own test split, an rg: task's EVALUATE_RG_SIZE rows at its fixed test seed,
    GSM8K's 1,319). The scripts leave them out of training whatever their own --eval_limit. A `datasets` folder
    whose splits leave out `test` has none to score."""
    if is_file(name) and Path(name).is_dir() and (Path(name) / "dataset_dict.json").is_file():
        try:
            if "test" not in json.loads((Path(name) / "dataset_dict.json").read_text()).get("splits", ["test"]):
                return set()
        except (OSError, ValueError, AttributeError):
            pass  # (load_dataset says what is wrong with the folder)
    return {twin(row["question"]) for row in load_dataset(name, "test", data_dir, size=EVALUATE_RG_SIZE,
                                                        question_key=question_key, answer_key=answer_key, flag=flag)}


def log_trained_test_questions(dataset: str, held_out: str, questions: list[str], log, script: str,
                               data_dir: str | None = None, **keys) -> None:
    """A run that holds out another set (--eval_dataset) trains on --dataset's own test questions, if it draws any:
    the held-out set is the one evaluated, and a small procedural task's test split can be every problem it has. One
    line counts them, since `alignment.evaluate --dataset DATASET` after the run would score questions it trained on."""
    if held_out == dataset:
        return
    own = test_twins(dataset, data_dir, **keys)
    if shared := sum(twin(question) in own for question in questions):
        log(f"[{script}] {shared} of the {len(questions)} training questions are in the test split of {dataset}: kept "
            f"(this run holds out {held_out}); `alignment.evaluate --dataset {dataset}` after it would score questions "
            f"it trained on.")


def load_dataset(name: str, split: str = "test", data_dir: str | None = None, size: int = EVALUATE_RG_SIZE,
                 seed: int = 0, question_key: str = "question", answer_key: str = "answer",
                 flag: str = "--dataset") -> list[dict]:
    """Rows for `name`: gsm8k, a MATH-style set, `rg:<task>` (reasoning-gym; `size` problems generated from
    `rg_data_seed(split, seed)`; a task with few distinct problems can repeat a question across splits, which the
    scripts leave out of training), or a user's file or folder (`load_file`, with its columns' names)."""
    if name.startswith("rg:"):
        return load_reasoning_gym(name[3:], size, rg_data_seed(split, seed))
    if is_file(name):
        return load_file(name, split, question_key, answer_key, flag)
    if name == "gsm8k":
        return load_gsm8k(split, data_dir)
    if name in MATH_STYLE:
        if split != "test":
            raise UserError(f"{name} has only a test split: evaluate on it (alignment.evaluate --dataset {name}, or "
                            f"--eval_dataset {name}), and train on gsm8k or an rg:<task>.")
        return load_math_style(name, data_dir)
    raise UserError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)} or rg:<task>.")


def load_prompt(name: str) -> str:
    path = PROMPTS_DIR / f"{name}.prompt"
    if not path.exists():
        names = sorted(p.stem for p in PROMPTS_DIR.glob("*.prompt"))
        raise UserError(f"unknown prompt {name!r}; choose one of {', '.join(names)}.")
    return path.read_text(encoding="utf-8")


_PROMPT_FILES: dict = {}  # --prompt_file -> its text as read at the run's start (read_prompt_file)


def read_prompt_file(path: str) -> str:
    """Read --prompt_file now (a run's start: run.py, evaluate) and keep its text: prompts are built from it for the
    whole run, so an edit mid-run changes nothing (a resume compares its sha256). Bytes that are not UTF-8 are one
    line naming the file, the byte and its line."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise MissingFileError(f"--prompt_file {path} cannot be read ({e.strerror or e}); check the path.") from None
    try:
        text = raw.decode("utf-8-sig")  # (a BOM, as Windows tools save, is no text)
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise UserError(f"--prompt_file {path} is not UTF-8 text: byte 0x{raw[e.start]:02x} at line {line} (byte "
                        f"{e.start}); save the file as UTF-8.") from None
    _PROMPT_FILES[str(path)] = text
    return text


def prompt_template(name: str, prompt_file: str | None = None) -> str:
    """The text of --prompt_file when given (as read at the run's start), else of the built-in template `name`."""
    if prompt_file:
        return _PROMPT_FILES[str(prompt_file)] if str(prompt_file) in _PROMPT_FILES else read_prompt_file(prompt_file)
    return load_prompt(name)


PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_]\w*)\}")  # {{ and }} are literal braces, as in str.format


def format_prompt(template: str, question: str, columns: dict | None = None) -> str:
    """The template with {question} filled in, and each {column} of a user's row by its name (a file's rows carry
    `columns`); {{ and }} write a literal brace. One pass, not str.format: questions and LaTeX are full of braces
    (`\\boxed{}` stays as it is), and a filled-in value is never read again. A {name} the row lacks is refused."""
    values = {**(columns or {}), "question": question}

    def fill(match):
        if match.group(1) is None:
            return match.group(0)[0]
        if match.group(1) not in values:
            raise UserError(f"--prompt_file has {match.group(0)}, and the data has no such column (its columns: "
                            f"{', '.join(sorted(values))}): rename it to one of them, or write {{{{{match.group(1)}}}}} "
                            f"for the text itself.")
        return str(values[match.group(1)])
    return PLACEHOLDER.sub(fill, template)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m alignment.data", description="Fetch datasets.")
    parser.error = one_line_error  # argparse's complaints as one line, as the other scripts'
    sub = parser.add_subparsers(dest="command", required=True)
    download = sub.add_parser("download", help="download a dataset into the data directory")
    download.add_argument("name", choices=["gsm8k"], help="dataset to fetch (MATH-style sets are copied by hand)")
    download.add_argument("--data_dir", default=None, help="target folder (default $ALIGNMENT_DATA_DIR or dataset/)")
    cli(_download, parser.parse_args(argv))


def _download(args):
    out = download_gsm8k(args.data_dir)
    for split in ("train", "test"):
        print(f"{out / (split + '.jsonl')}: {len(load_gsm8k(split, args.data_dir))} rows")


if __name__ == "__main__":
    main()
