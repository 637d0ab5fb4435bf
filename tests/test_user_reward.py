"""A --reward_fn's worker (alignment/user_reward.py): the user's import path, one long-lived worker that imported the
file once (state and imports last between calls), restarted after a call that passed its time or ended it, a batched
form, and no process a reward forked left behind."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from alignment.errors import UserError
from alignment.user_reward import UserReward, source_hash

REPO = Path(__file__).resolve().parents[1]

REWARDS = textwrap.dedent('''
    import os
    import sys
    import time
    from pathlib import Path

    import evaluate  # the fake one beside this file, not alignment/evaluate.py

    calls = 0
    PACKAGE = Path(os.environ["ALIGNMENT_PACKAGE_DIR"]).resolve()

    def which_evaluate(response, ground_truth, **columns):
        package_first = any(Path(p or ".").resolve() == PACKAGE for p in sys.path)
        return float(getattr(evaluate, "FAKE", False) and not package_first)

    def counts(response, ground_truth, **columns):
        global calls
        calls += 1
        import counted  # a module whose import appends a line to a file: done once in a worker that lasts
        return float(calls)

    def pid_or_trouble(response, ground_truth, **columns):
        if response == "hang":
            time.sleep(60)
        if response == "die":
            os._exit(3)
        return float(os.getpid())

    def sizes(responses, ground_truths, columns):
        assert isinstance(responses, list) and isinstance(columns, list) and columns[0]["topic"] == "sums"
        return [float(len(responses))] * (len(responses) - (responses[0] == "short"))
    sizes.batched = True

    def one_bad(responses, ground_truths, columns):
        return [None if r == "bad" else 1.0 for r in responses]
    one_bad.batched = True

    def forks(response, ground_truth, **columns):
        child = os.fork()
        if child == 0:  # outlives the call, holding every pipe the worker has
            time.sleep(60)
            os._exit(0)
        Path(os.environ["CHILD_PID_FILE"]).write_text(str(child))
        if response == "then hang":
            time.sleep(60)
        return 1.0

    def takes_one(response):
        return 1.0

    def call_sizes(responses, ground_truths, columns):  # how many answers each call got
        return [float(len(responses))] * len(responses)
    call_sizes.batched = True

    def keyword_column(response, ground_truth, tolerance, **columns):  # a column by name: loads and is called
        return float(tolerance == "0.5")
''')


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "evaluate.py").write_text("FAKE = True\n")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "counted.py").write_text(f"with open({str(tmp_path / 'imports')!r}, 'a') as f:\n    f.write('x')\n")
    monkeypatch.syspath_prepend(str(lib))  # the run's own import path reaches the worker
    monkeypatch.setenv("ALIGNMENT_PACKAGE_DIR", str(REPO / "alignment"))
    monkeypatch.setenv("CHILD_PID_FILE", str(tmp_path / "child.pid"))
    return tmp_path


def spec(folder, name):
    return f"{folder / 'rewards.py'}:{name}"


def alive(pid: int) -> bool:
    """Running: a zombie (killed, not yet reaped by whichever process inherited it) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def gone_soon(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_reward_imports_with_the_users_path_not_the_package_folder_first(rewards):
    """`import evaluate` got alignment/evaluate.py (the worker ran as `python alignment/user_reward.py`)."""
    reward = UserReward(spec(rewards, "which_evaluate"), timeout=5.0)
    try:
        assert reward("x", "1", {})["reward"] == 1.0 and reward.errors == []
    finally:
        reward.close()


def test_state_and_imports_inside_the_function_last_between_calls(rewards):
    """Each call ran in a fresh fork: a module counter read 1 every time, and an import inside it was done again."""
    reward = UserReward(spec(rewards, "counts"), timeout=5.0)
    try:
        assert [reward("x", "1", {})["reward"] for _ in range(4)] == [1.0, 2.0, 3.0, 4.0]
        assert (rewards / "imports").read_text() == "x" and reward.errors == []
    finally:
        reward.close()


def test_a_call_past_its_time_or_that_ends_the_worker_restarts_it_and_the_next_call_works(rewards):
    reward = UserReward(spec(rewards, "pid_or_trouble"), timeout=1.0)
    try:
        first = reward("x", "1", {})["reward"]
        assert reward("x", "1", {})["reward"] == first == float(reward.proc.pid)  # one worker, no fork a call
        start = time.monotonic()
        assert reward("hang", "1", {})["reward_failed"] == 1.0
        assert time.monotonic() - start < 5 and "took more than 1 s (--reward_timeout)" in reward.errors[-1]
        second = reward("x", "1", {})
        assert second["reward_failed"] == 0.0 and second["reward"] != first  # a new worker answers
        assert reward("die", "1", {})["reward_failed"] == 1.0
        assert "ended the reward worker (exit status 3)" in reward.errors[-1]
        assert reward("x", "1", {})["reward"] not in (first, second["reward"]) and len(reward.errors) == 2
    finally:
        reward.close()


def test_a_batched_reward_is_called_with_lists_and_a_bad_return_fails_its_samples(rewards):
    columns = [{"topic": "sums"}] * 3
    reward = UserReward(spec(rewards, "sizes"), timeout=5.0)
    try:
        assert [s["reward"] for s in reward.many(["a", "b", "c"], ["1", "2", "3"], columns)] == [3.0, 3.0, 3.0]
        assert reward("a", "1", {"topic": "sums"})["reward"] == 1.0  # one answer: a list of one
        failed = reward.many(["short", "b", "c"], ["1", "2", "3"], columns)  # two values for three answers
        assert [s["reward_failed"] for s in failed] == [1.0, 1.0, 1.0] and len(reward.errors) == 3
        assert reward.news() == ["TypeError: it returned 2 values for 3 answers"]  # said once
    finally:
        reward.close()
    reward = UserReward(spec(rewards, "one_bad"), timeout=5.0)
    try:
        scores = reward.many(["a", "bad", "c"], ["1", "2", "3"], [{}] * 3)
        assert [s["reward_failed"] for s in scores] == [0.0, 1.0, 0.0] and len(reward.errors) == 1
    finally:
        reward.close()


def test_a_child_the_reward_forks_is_not_a_timeout_and_is_gone_after_close(rewards):
    """The call's forked process held the answer's pipe open: a call that returned at once read as a timeout, and
    its children lived on after the run (parent 1)."""
    reward = UserReward(spec(rewards, "forks"), timeout=2.0)
    try:
        start = time.monotonic()
        assert reward("x", "1", {})["reward"] == 1.0 and reward.errors == []
        assert time.monotonic() - start < 1.5
        child = int((rewards / "child.pid").read_text())
        assert alive(child)
    finally:
        reward.close()
    assert gone_soon(child)


def test_the_worker_and_what_it_forked_end_when_the_run_is_killed(rewards):
    """kill -9 of the run in the middle of a call: the worker, its call and the call's child end with it, not at the
    call's --reward_timeout (here a minute) nor never."""
    driver = ("import sys\nfrom alignment.user_reward import UserReward\n"
              "reward = UserReward(sys.argv[1], timeout=60.0)\nprint(reward.proc.pid, flush=True)\n"
              "reward('then hang', '1', {})\n")
    run = subprocess.Popen([sys.executable, "-c", driver, spec(rewards, "forks")], cwd=REPO, stdout=subprocess.PIPE,
                           text=True)
    try:
        worker = int(run.stdout.readline())
        deadline = time.monotonic() + 10
        while not (rewards / "child.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int((rewards / "child.pid").read_text())
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    assert gone_soon(worker) and gone_soon(child)


def test_a_spec_that_is_no_reward_says_what_is_wrong(rewards):
    """`os.path:join` said "no module os.path is importable here": it is, but it has no source file to hash."""
    for where in ("os.path:join", "sys:exit"):
        with pytest.raises(UserError, match=f"{where.split(':')[0]} is importable, but .* no source file"):
            source_hash(where)
    with pytest.raises(UserError, match=r"takes_one\(response\) cannot be called as takes_one\(response, ground_truth, "
                                        r"\*\*columns\)"):
        UserReward(spec(rewards, "takes_one"), timeout=1.0)
    with pytest.raises(UserError, match="no module nosuchmodule is importable here"):
        source_hash("nosuchmodule:f")


def test_a_restart_after_the_file_changed_does_not_run_the_new_code(rewards):
    """The config holds the file's sha256: a worker restarted mid-run on an edited file would score with code the
    run never recorded."""
    reward = UserReward(spec(rewards, "pid_or_trouble"), timeout=1.0)
    try:
        reward("hang", "1", {})
        (rewards / "rewards.py").write_text(REWARDS + "\n# edited\n")
        assert reward("x", "1", {})["reward_failed"] == 1.0
        assert "its file changed since the run began" in reward.errors[-1]
    finally:
        reward.close()


def test_scoring_sends_a_batched_reward_every_answer_at_once(rewards):
    """evaluate and train_rl score through score_all: a batched reward gets the whole list in one call (each answer
    was its own call, so a reward model scored one answer at a time)."""
    from types import SimpleNamespace

    from alignment.evaluate import make_scorer, score_all
    args = SimpleNamespace(reward_fn=spec(rewards, "call_sizes"), reward_timeout=5.0, prompt="question_only")
    rows = [{"question": f"q{i}", "answer": "1"} for i in range(5)]
    score = make_scorer(args, rows)
    try:
        answers = [SimpleNamespace(text=f"a{i}", stats={}) for i in range(5)]
        assert [s["reward"] for s in score_all(score, answers, rows)] == [5.0] * 5
        assert score(answers[0], rows[0])["reward"] == 1.0
    finally:
        score.user_reward.close()
    reward = UserReward(spec(rewards, "keyword_column"), timeout=5.0)  # a column as a named argument
    try:
        assert reward("x", "1", {"tolerance": "0.5"})["reward"] == 1.0 and reward.errors == []
    finally:
        reward.close()


def test_a_run_called_in_process_ends_its_reward_worker(rewards):
    """train_rl.main and expert_iteration.main called from Python (tests, notebooks) left the worker and what it
    forked running until the interpreter exited (a probe round, 2026-12-07): closes_workers ends them with the call,
    on a raise too."""
    from alignment import expert_iteration, train_rl, user_reward
    assert train_rl.main.__wrapped__ and expert_iteration.main.__wrapped__  # both mains are wrapped
    started = []

    @user_reward.closes_workers
    def run(fail: bool):
        reward = UserReward(spec(rewards, "pid_or_trouble"), timeout=5.0)
        started.append(reward.proc.pid)
        if fail:
            raise RuntimeError("the run failed")
        return reward("x", "1", {})["reward"]
    assert run(False) == float(started[0]) and gone_soon(started[0])
    with pytest.raises(RuntimeError):
        run(True)
    assert gone_soon(started[1]) and user_reward.OPEN == []


def test_a_slow_import_gets_the_longer_of_the_start_time_and_the_reward_timeout(tmp_path, monkeypatch):
    """A file that loads something slow at import (a reward model) was cut off after a fixed 60 s whatever
    --reward_timeout said (the probe round's find): the import gets the longer of the two, and the refusal says
    which flag to raise."""
    import alignment.user_reward as user_reward
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(2.0)\n\ndef score(response, ground_truth, **columns):\n"
                                      "    return 1.0\n")
    monkeypatch.setattr(user_reward, "START_TIMEOUT_S", 0.5)
    with pytest.raises(UserError, match=r"its import took more than 0.5 s .* raise --reward_timeout"):
        UserReward(f"{tmp_path / 'slow.py'}:score", timeout=0.2)
    reward = UserReward(f"{tmp_path / 'slow.py'}:score", timeout=8.0)
    try:
        assert reward("x", "y", {})["reward"] == 1.0
    finally:
        reward.close()
