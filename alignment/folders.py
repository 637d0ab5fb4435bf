"""What a run wrote into its folder, at every depth: `--overwrite` deletes only that, and a save keeps the rest.

A run folder's top level holds the names in RUN_FILES; each checkpoint folder lists the files its save wrote in
MANIFEST, so a file the user put inside `checkpoint/` (notes, an evaluation) is told apart from the weights. A
checkpoint saved before the manifest existed is read by the names a save writes (LEGACY_NAMES). Stdlib only:
models.py (the save), run.py (the refusal), args.py (a resumed run's flags, `saved_checkpoint`) and the bench drivers
(RUN_FILES, LOCK_FILE, read_jsonl: a driver's --help, --card and usage errors load no torch) use it.
"""

import fnmatch
import json
import shutil
from pathlib import Path

from alignment.errors import UserError

LOCK_FILE = ".lock"
WRITE_PROBE = ".write-test"
PLOT_FILE = "curves.png"  # alignment.plot's picture of one run, written into its folder by default
# what a run (or plot) writes into its folder: --overwrite deletes these and refuses a folder holding anything else
RUN_FILES = {"config.json", "config.json.tmp", "metrics.jsonl", "rollouts.jsonl", "checkpoint", "checkpoint.tmp", "checkpoint.old",
             "tensorboard", "wandb", LOCK_FILE, WRITE_PROBE, PLOT_FILE}
MANIFEST = ".written"  # inside a checkpoint: one relative path a line, every file its save wrote
CHECKPOINT_DIRS = ("checkpoint", "checkpoint.tmp", "checkpoint.old")  # a save's folder and its two renames
# a checkpoint saved before MANIFEST (2026-12-07): what save_checkpoint wrote at its top, and its folders
LEGACY_NAMES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                "pytorch_model*.bin", "pytorch_model.bin.index.json", "tokenizer*", "special_tokens_map.json",
                "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json", "run_config.json",
                "trainer_state.pt")
LEGACY_FOLDERS = ("optimizer", "adapter", "critic")


def files_under(folder: Path) -> list[str]:
    """Every file (or link) below folder, as a sorted list of paths relative to it."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir() or p.is_symlink())


def write_manifest(checkpoint: Path):
    """Called by a save once every file is written, before its renames: the manifest names them all."""
    (checkpoint / MANIFEST).write_text("".join(f"{name}\n" for name in files_under(checkpoint) if name != MANIFEST))


def foreign_in_checkpoint(checkpoint: Path) -> list[str]:
    """The files inside a checkpoint folder that its save did not write (relative paths, sorted)."""
    if not checkpoint.is_dir():
        return []
    manifest = checkpoint / MANIFEST
    if manifest.is_file():
        written = set(manifest.read_text().splitlines()) | {MANIFEST}
        return [name for name in files_under(checkpoint) if name not in written]
    if checkpoint.name == "checkpoint.tmp":  # a save cut off before its manifest: all of it is the save's own
        return []
    return [name for name in files_under(checkpoint) if not _legacy_written(name)]


def _legacy_written(name: str) -> bool:
    top, _, rest = name.partition("/")
    return top in LEGACY_FOLDERS and bool(rest) or not rest and any(fnmatch.fnmatch(top, p) for p in LEGACY_NAMES)


def foreign_files(run_dir: Path, run_files: set[str]) -> list[str]:
    """What no run wrote in a run folder, at every depth (relative paths): the top level's names outside
    run_files, and inside each checkpoint folder the files outside its manifest."""
    top = sorted(p.name for p in run_dir.iterdir() if p.name not in run_files)
    nested = [f"{name}/{inner}" for name in CHECKPOINT_DIRS for inner in foreign_in_checkpoint(run_dir / name)]
    return top + nested


def carry_foreign(old: Path, new: Path):
    """Before a save replaces `old` with `new`: copy the user's files in `old` across, so the save deletes only what
    an earlier save wrote (they are copied, not moved: until the renames, `old` stays whole)."""
    for name in foreign_in_checkpoint(old):
        (new / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(old / name, new / name, follow_symlinks=False)


def saved_checkpoint(out_dir: str | Path) -> Path:
    """Where the last finished save of `out_dir` is, also when a crash cut save_checkpoint off between its two
    renames (`out_dir` moved aside to .old, the finished .tmp not yet in place): then the .tmp (complete before
    .old was made), else the .old. Reads only; models.finish_interrupted_save moves it into place. args.py reads a
    resumed run's flags from it before anything imports torch."""
    out_dir = Path(out_dir)
    tmp, old = (out_dir.with_name(out_dir.name + suffix) for suffix in (".tmp", ".old"))
    if out_dir.exists() or not old.exists():
        return out_dir
    return tmp if tmp.exists() else old


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file; a last line cut off by a crash mid-write is left out, a bad line
    anywhere else is an error that names it."""
    if not Path(path).exists():
        return []
    lines = Path(path).read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise UserError(f"line {number} of {path} is not JSON; fix or delete that line.") from None
    return records
