"""One run's bookkeeping, shared by SFT and RL: the run folder, the resolved config, metrics, rollouts, the
optional wandb/tensorboard logger, and checkpoints that save and resume.

    <run>/config.json        the resolved flags and the model the run started from
    <run>/metrics.jsonl      one JSON line per step and per evaluation (NaN written as null: strict JSON)
    <run>/rollouts.jsonl     a few full rollouts per step (RL) or evaluation samples (SFT)
    <run>/checkpoint/        HF weights + tokenizer (a folder `--model` takes; so does <run> itself),
                             run_config.json, trainer_state.pt, optimizer/ (torch.distributed.checkpoint)

A run folder that holds anything is never reused by accident: `--resume <run>` continues it (with the flags
it was started with, apart from `resumable` ones such as the step count), `--overwrite` deletes it first,
and anything else is refused with one line. It belongs to the script that made it (config.json names it;
another script's `--resume` is refused), and it is locked while a run writes it (an flock on <run>/.lock,
which the kernel releases when the process ends, killed or not), so two runs never write one folder. A resumed run drops the metrics and rollouts its crashed
predecessor wrote after the checkpoint, so every step is in the files once.

The rank is decided once, here: on rank 0 every method writes; on the other ranks the same calls write
nothing (a checkpoint save still runs on every rank: gathering sharded weights is collective). So the
training loops read the same in one process and under torchrun.
"""

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import pickle
import random
import shutil
import fcntl
import importlib.util
import os
import signal
import threading
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from alignment import distributed, folders, models
from alignment.folders import LOCK_FILE, RUN_FILES, WRITE_PROBE, read_jsonl
from alignment.args import SCRIPTS, saved_dict, to_dict
from alignment.errors import MissingFileError, StoppedAtOnce, UserError

STATE_FILE = "trainer_state.pt"
SAME_PRESS_SECONDS = 1.0  # signals of one kind this close together are one press (uv forwards what the group got)
ALWAYS_RESUMABLE = {"resume", "overwrite", "output_dir", "eval_every", "eval_before_train", "save_every", "log_rollouts",
                    "logger", "keep_freed_memory", "reward_timeout", "accept_changed_reward", "accept_changed_data"}


class Run:
    """The run folder of `args` (`--output_dir`, else `default_dir`; `--resume` names it when given)."""

    def __init__(self, args, default_dir: str, start_model: str | None, resumable=()):
        self.args, self.main = args, distributed.is_main()
        _check_logger(args.logger)
        self.script = next((name for name, cls in SCRIPTS.items() if cls is type(args)), type(args).__name__)
        # rank 0 names the folder (a default name holds the time); every rank then checks the same folder
        # before rank 0 changes anything in it
        self.dir = Path(distributed.gather_objects(args.resume or args.output_dir or default_dir)[0])
        self.checkpoint = self.dir / "checkpoint"
        if args.resume and not self.dir.is_dir():
            raise MissingFileError(f"--resume {self.dir}: " + ("a file, not a run folder." if self.dir.exists() else
                                                                "no such run folder."))
        if args.resume and (self.dir / STATE_FILE).exists():  # before the lock: nothing is written into it
            raise UserError(f"--resume {self.dir} is a run's checkpoint folder: pass the run folder that holds it "
                            f"(--resume {self.dir.parent}).")
        if args.resume and not run_config(self.dir) and not any((self.dir / name).exists() for name in
                                                                 ("checkpoint", "checkpoint.tmp", "checkpoint.old")):
            raise MissingFileError(f"--resume {self.dir}: the folder holds no run of alignment.{self.script} (no "
                                   f"config.json or checkpoint/ a run writes): pass the --output_dir of a run that "
                                   f"saved at least one checkpoint.")  # before the lock: nothing is written into it
        for flag, model in (("model", start_model), ("critic_model", getattr(args, "critic_model", None))):
            if model and Path(model).exists() and self.dir.resolve() in (Path(model).resolve(),
                                                                          *Path(model).resolve().parents):
                raise UserError(f"the run folder {self.dir} holds --{flag} {model}: the run would write (or with "
                                f"--overwrite delete) the model it starts from; choose another --output_dir.")
        if not args.resume and _holds_a_run(self.dir) and not run_config(self.dir):
            raise UserError(f"{self.dir} holds files that are not a run of this project's scripts"
                            f"{' (--overwrite deletes only run folders)' if args.overwrite else ''}: choose another "
                            f"--output_dir.")
        # at every depth: a note the user put inside checkpoint/ is theirs too (a save carries it over)
        foreign = folders.foreign_files(self.dir, RUN_FILES) if args.overwrite and run_config(self.dir) else []
        if foreign:
            raise UserError(f"{self.dir} holds files no run writes ({', '.join(foreign[:5])}"
                            f"{', ...' if len(foreign) > 5 else ''}): --overwrite deletes only what a run wrote; move "
                            f"them out or choose another --output_dir.")
        self.data_hashes = _data_hash(args)  # reads --prompt_file, once for the run (a bad one: before the lock)
        self._lock = lock_folder(self.dir) if self.main else None  # held until this process ends
        self.state = self._resume_state(set(resumable) | ALWAYS_RESUMABLE) if args.resume else None
        if not args.resume and _holds_a_run(self.dir) and not args.overwrite:
            raise UserError(self._used_folder())
        distributed.barrier()
        # the model the run started from: the KL reference in RL, and what a resume reports
        self.start_model = self.state["start_model"] if self.state else start_model
        self.start_step = self.state["step"] if self.state else 0
        self.signal, self.signal_time = 0, 0.0  # the first Ctrl-C or SIGTERM inside stop_on_signal(), and when
        self.logger = _NullLogger()
        if self.main:
            if args.overwrite:  # everything but the lock this run holds
                for path in self.dir.iterdir():
                    if path.name != LOCK_FILE:
                        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            writable_folder(self.dir)  # an output path that cannot be written fails now, not after the work
            for name in ("metrics.jsonl", "rollouts.jsonl"):  # a crash after the checkpoint wrote these again
                _truncate_jsonl(self.dir / name, self.start_step, self.say if name == "metrics.jsonl" else None)
            config = {**saved_dict(args), "output_dir": str(self.dir), "start_model": self.start_model,
                      "script": self.script, **_reward_hash(args), **self.data_hashes}
            (self.dir / "config.json.tmp").write_text(json.dumps(config, indent=2, default=str))
            os.replace(self.dir / "config.json.tmp", self.dir / "config.json")  # never half a config: a user's file
            self.logger = _make_logger(args.logger, self.dir, config)

    def refuse_finished(self, total: int, flag: str):
        """A resumed run whose checkpoint is already at its last step trains nothing: say so and what to do."""
        if self.state and self.start_step >= total:
            raise UserError(f"{self.dir} has finished: its checkpoint is at step {self.start_step} of {total}, so "
                            f"--resume has nothing to train; raise {flag} (now {getattr(self.args, flag[2:])}) to "
                            f"train further, or evaluate it: uv run -m alignment.evaluate --model {self.dir}")

    @property
    def weights(self) -> str:
        """Where the policy's weights come from: the checkpoint when resuming, else the starting model."""
        return str(self.checkpoint) if self.state else self.start_model

    def say(self, message: str):
        """Print a line (above any progress bar) on rank 0."""
        if self.main:
            tqdm.write(message)

    def _still_there(self):
        """The run folder was deleted (or moved away) while the run wrote it: its lock file, held open, has no
        name left. Raised as the OSError it is, which the scripts' cli() says in one line; nothing is made again."""
        if self._lock is not None and os.fstat(self._lock.fileno()).st_nlink == 0:
            raise FileNotFoundError(errno.ENOENT, "the run folder was deleted while the run wrote it",
                                    str(self.dir / LOCK_FILE))

    def log(self, record: dict):
        """Append one record (with its "step") to metrics.jsonl and the logger."""
        if self.main:
            self._still_there()
            _append_jsonl(self.dir / "metrics.jsonl", record)
            self.logger.log(record, record["step"])

    def log_rollouts(self, step: int, records: list[dict]):
        if self.main:
            for record in records:
                _append_jsonl(self.dir / "rollouts.jsonl", {"step": step, **record})

    def metrics(self) -> list[dict]:
        return read_jsonl(self.dir / "metrics.jsonl")

    def save(self, step: int, model, tokenizer, optimizer, state: dict | None = None, submodels: dict | None = None):
        """Checkpoint atomically (every rank calls it): weights, optimizer, the step, the RNG states and the
        script's own `state`, which `restore` hands back."""
        trainer_state = {**(state or {}), "step": step, "start_model": self.start_model,
                         "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}
        config = {**saved_dict(self.args), "output_dir": str(self.dir), **_reward_hash(self.args),  # the folder it writes
                  **self.data_hashes}
        if self.main:
            self._still_there()
        models.save_checkpoint(model, tokenizer, self.checkpoint, config=config, optimizer=optimizer,
                               extra={STATE_FILE: trainer_state}, submodels=submodels)
        if self.main:  # deleted during the save: torch.distributed.checkpoint makes its folders again
            self._still_there()

    @contextlib.contextmanager
    def stop_on_signal(self):
        """Inside: the first Ctrl-C or SIGTERM asks the loop to stop after the step it is in (the loop asks
        `stop_requested()`, saves, and calls `stopped()`); a second one stops at once."""
        if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        now = time.monotonic()
        if self.signal == signum and now - self.signal_time < SAME_PRESS_SECONDS:
            return  # the same press delivered twice: `uv run` forwards what the process group already got
        if self.signal:
            raise StoppedAtOnce(self._lost(), signum)
        self.signal, self.signal_time = signum, now
        tqdm.write(f"[run] {signal.Signals(signum).name}: stopping after this step, with a checkpoint (a step "
                   f"still refilling its batch is given up, and the last finished step's is kept) "
                   f"(a second Ctrl-C or SIGTERM, a second or more later, stops at once, losing the step)")

    def _lost(self) -> str:
        """What a stop at once leaves: the last checkpoint, or none."""
        if (self.checkpoint / STATE_FILE).exists():
            return (f"stopped at once: the step in progress is lost; the last checkpoint is kept: continue with "
                    f"--resume {self.dir}")
        return (f"stopped at once, before the first checkpoint: nothing in {self.dir} can be resumed (start again "
                f"with --overwrite)")

    def stop_requested(self) -> bool:
        """Whether a signal asked the run to stop, on any rank (a collective under torchrun: all stop together)."""
        return distributed.global_max(self.signal) > 0

    def stopped(self, step: int):
        """End the program after the loop saved step `step` (none for 0): say how to go on, exit 128 + the signal."""
        if step:
            self.say(f"[run] stopped after step {step}; checkpoint saved: continue with --resume {self.dir}")
        else:
            self.say(f"[run] stopped before the first step ended: nothing in {self.dir} can be resumed (start again "
                     f"with --overwrite)")
        raise SystemExit(128 + int(distributed.global_max(self.signal)))

    def restore(self, model, optimizer) -> dict | None:
        """When resuming: load the optimizer's state (unless `optimizer` is None: a loop that starts a fresh
        one at each checkpoint, as expert iteration does, saves none) and the RNG states; return the saved
        trainer state."""
        if self.state is None:
            return None
        if optimizer is not None:
            distributed.load_optimizer(self.checkpoint / "optimizer", model, optimizer)
        torch.set_rng_state(self.state["torch_rng"])
        random.setstate(self.state["python_rng"])
        self.say(f"[run] resumed from {self.checkpoint} at step {self.start_step}")
        return self.state

    def _used_folder(self) -> str:
        """Why a new run may not start in a used folder, and only the ways on that work from there."""
        owner = run_config(self.dir).get("script") or self.script
        other = "" if owner == self.script else f" of alignment.{owner}"
        if not any((self.dir / name / STATE_FILE).exists() for name in ("checkpoint", "checkpoint.old")):
            return (f"{self.dir} already holds a run{other} that stopped before its first checkpoint (nothing in it "
                    f"can be resumed): start over with --overwrite, or choose another --output_dir.")
        resume = f"--resume {self.dir}" if not other else f"`uv run -m alignment.{owner} --resume {self.dir}`"
        return (f"{self.dir} already holds a run{other}: continue it with {resume}, start over with --overwrite, "
                f"or choose another --output_dir.")

    def _resume_state(self, resumable: set) -> dict:
        owner = run_config(self.dir).get("script")
        if owner and owner != self.script:
            raise UserError(f"{self.dir} is a run of alignment.{owner}, not of alignment.{self.script}: continue it "
                            f"with `uv run -m alignment.{owner} --resume {self.dir}`, or start a new run (--model "
                            f"{self.dir} starts from its weights).")
        with distributed.main_first():  # rank 0 completes a save a crash cut off, then every rank looks
            models.finish_interrupted_save(self.checkpoint)
        if not (self.checkpoint / STATE_FILE).exists():  # a run of this script that saved nothing, or no run
            why = (f": the run in {self.dir} stopped before its first checkpoint, so nothing can be resumed; start it "
                   f"again with --overwrite." if owner else
                   "; --resume takes a run folder that saved at least one checkpoint (see --save_every).")
            raise MissingFileError(f"{self.checkpoint} has no {STATE_FILE}{why}")
        saved = json.loads((self.checkpoint / "run_config.json").read_text())
        defaults = {f.name: f.default for f in dataclasses.fields(self.args)}  # a flag added since the run was saved
        changed = {k: f"--{k} {v} (the run's: " + (f"{saved[k]})" if k in saved else f"{defaults[k]}, the default: "
                                                    f"the run was saved before the flag existed)")
                   for k, v in to_dict(self.args).items() if k not in resumable and saved.get(k, defaults[k]) != v}
        given = getattr(self.args, "given_flags", set(changed))  # what the user typed; the rest followed from it
        typed, implied = sorted(changed[k] for k in changed if k in given), sorted(changed[k] for k in changed
                                                                                    if k not in given)
        now, then = _reward_hash(self.args).get("reward_fn_sha256"), saved.get("reward_fn_sha256")
        if now != then and not getattr(self.args, "accept_changed_reward", False):
            raise UserError(f"--reward_fn {self.args.reward_fn}: its file changed since the run's checkpoint (sha256 "
                            f"{str(then)[:12]} then, {str(now)[:12]} now): restore it, or pass --accept_changed_reward "
                            f"to go on with the new one.")
        moved = [key for key, now in self.data_hashes.items() if key in saved and saved[key] != now]  # (a run saved
        # before the hashes were kept: nothing to compare)
        edited = [f"--{key.removesuffix('_sha256')} {getattr(self.args, key.removesuffix('_sha256'))} (sha256 "
                  f"{saved[key][:12]} then, {self.data_hashes[key][:12]} now)" for key in moved]
        if edited and not getattr(self.args, "accept_changed_data", False):
            from alignment.data import BUILTIN_FILES
            builtin = any(getattr(self.args, key.removesuffix("_sha256"), None) in BUILTIN_FILES for key in moved)
            where = " (a built-in set: its files under --data_dir / ALIGNMENT_DATA_DIR)" if builtin else ""
            raise UserError(f"{', '.join(edited)}: the file changed since the run's checkpoint{where}: restore it, or "
                            f"pass --accept_changed_data to go on with the new one.")
        if changed:
            raise UserError(f"resume with the flags of the original run; these differ: {', '.join(typed or implied)}"
                            + (f" (and, implied by them, {', '.join(implied)})" if typed and implied else "")
                            + f" (see {self.checkpoint / 'run_config.json'}).")
        try:
            return torch.load(self.checkpoint / STATE_FILE, weights_only=False)
        except (EOFError, RuntimeError, pickle.UnpicklingError) as e:
            raise UserError(f"{self.checkpoint / STATE_FILE} is damaged ({e}); the run cannot continue from it: "
                            f"start over with --overwrite, or copy a good checkpoint/ into {self.dir}.") from None


def _reward_hash(args) -> dict:
    """A --reward_fn's file, by its sha256: what the run's config records, so a resume can tell it changed."""
    if not getattr(args, "reward_fn", None):
        return {}
    from alignment.user_reward import source_hash
    return {"reward_fn_sha256": source_hash(args.reward_fn)}


def _data_hash(args) -> dict:
    """The sha256 of a --prompt_file (its text as the run read it at its start) and of a --dataset / --eval_dataset
    / --train_file file (a folder saved by `datasets`: its files' names and bytes), kept like the reward's so a
    resume can tell."""
    if not hasattr(args, "accept_changed_data"):  # a script without files of its users
        return {}
    from alignment import data
    hashes = {}
    if getattr(args, "prompt_file", None):
        hashes["prompt_file_sha256"] = hashlib.sha256(data.read_prompt_file(args.prompt_file).encode()).hexdigest()
    for flag in ("dataset", "eval_dataset", "train_file"):
        path = Path(getattr(args, flag, None) or "")
        builtin = data.builtin_files(str(getattr(args, flag, None) or ""), getattr(args, "data_dir", None))
        if builtin:  # gsm8k and the MATH-style sets: the files of the data folder the run reads
            digest = hashlib.sha256()
            for file in builtin:
                digest.update(file.name.encode() + b"\0" + file.read_bytes())
            hashes[f"{flag}_sha256"] = digest.hexdigest()
        elif data.is_file(str(getattr(args, flag, None) or "")) and path.exists():
            digest = hashlib.sha256(b"" if path.is_dir() else path.read_bytes())  # a file: what sha256sum says
            for file in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []:
                digest.update(str(file.relative_to(path)).encode() + b"\0" + file.read_bytes())
            hashes[f"{flag}_sha256"] = digest.hexdigest()
    return hashes


def writable_folder(path) -> Path:
    """Create `path` (with its parents) and check that a file can be written in it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / WRITE_PROBE
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to {path} ({e.strerror or e}): choose another output folder.") from None
    return path


def _holds_a_run(folder: Path) -> bool:
    """Anything but the config.json of a run that failed before its first step (nothing to lose there; a
    config.json no run of this project wrote is a user's file, to be kept)."""
    # not the lock, nor writable_folder's probe: under torchrun rank 0 makes both while the others look
    nothing = {LOCK_FILE, WRITE_PROBE} | ({"config.json"} if run_config(folder) else set())
    return folder.is_dir() and any(p.name not in nothing for p in folder.iterdir())


def lock_folder(folder: Path):
    """An exclusive flock on folder/.lock for as long as the returned file stays open (this process's life;
    the kernel drops it when the process ends, however it ends, so a killed run never blocks the next)."""
    key = os.path.realpath(folder)
    if key in _HELD and os.fstat(_HELD[key].fileno()).st_nlink:  # this process holds it already (a script's
        return _HELD[key]  # main() called again, as tests and sweeps do), and its folder was not deleted since
    _HELD.pop(key, None)
    writable_folder(folder)
    try:
        handle = open(folder / LOCK_FILE, "a+")
    except OSError as e:
        raise UserError(f"cannot open the run lock {folder / LOCK_FILE} ({e.strerror or e}): remove it (no run "
                        f"holds a lock that is not a plain file), or choose another --output_dir.") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UserError(f"{folder} is being written by another run ({holder}): wait for it to end, or choose "
                        f"another --output_dir.") from None
    handle.truncate(0)
    handle.write(f"process {os.getpid()}")
    handle.flush()
    _HELD[key] = handle
    return handle


_HELD: dict = {}  # run folders this process has locked: folder -> its open .lock


def run_config(folder: Path) -> dict:
    """The config.json a run wrote (its flags, output_dir and start_model), else {}: a model's config.json is not one."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return config if isinstance(config, dict) and {"output_dir", "start_model"} <= config.keys() else {}


class _NullLogger:
    """Stand-in for tensorboard/wandb, so nothing checks whether one is on."""

    def log(self, metrics: dict, step: int):
        pass


def _check_logger(kind: str):
    """Before the run folder is touched: a logger whose package is missing is one line naming the install."""
    if kind in ("tensorboard", "wandb") and importlib.util.find_spec(kind) is None:
        raise UserError(f"--logger {kind} needs the {kind} package, which is not installed: `uv pip install {kind}`, "
                        f"or leave --logger out (metrics.jsonl is always written).")


def _make_logger(kind: str, run_dir: Path, config: dict):
    logger = _NullLogger()
    if kind == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(run_dir / "tensorboard")
        logger.log = lambda metrics, step: [writer.add_scalar(k, v, step) for k, v in metrics.items()
                                            if isinstance(v, (int, float))]
    elif kind == "wandb":
        import wandb
        run = wandb.init(project="alignment", config=config, dir=str(run_dir))
        logger.log = lambda metrics, step: run.log(metrics, step=step)
    return logger


def _append_jsonl(path: Path, record: dict):
    """One JSON line; NaN (a rate over an empty subset, e.g. TIR accuracy with code when none used code)
    becomes null so that strict JSON readers accept the file."""
    record = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in record.items()}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_jsonl(path: Path, step: int, say=None):
    """Keep the records of steps up to `step` (none for a new run). Every step logs its record before its
    checkpoint, so with `say` (metrics.jsonl) a file whose last record is of an earlier step than the checkpoint
    lost lines (a kill mid-write cuts the last one, which read_jsonl drops): say so, the steps have a gap."""
    if not path.exists():
        return
    records = [r for r in read_jsonl(path) if r["step"] <= step]
    last = max((r["step"] for r in records), default=0)
    if say and last < step:
        say(f"[run] warning: {path} has no record after step {last}, and the checkpoint is at step {step}: the "
            f"record of step{'s' if step - last > 1 else ''} {last + 1}{f'-{step}' if step - last > 1 else ''} was "
            f"lost (the run was killed while writing it), so the file has a gap there; the checkpoint is whole.")
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
