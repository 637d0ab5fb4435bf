"""TIR rollouts on a scripted fake policy with the real sandbox: stop/resume stitching on token ids, the
tool-call limit and its notice, error observations, loss masks, batches whose traces run different
numbers of rounds, the token budget, the reward table, tool metrics, and evaluation. The rollout tests
run both loops: in rounds (`generate`) and served (`serve`, continuous batching), which give the same rows."""

import math

import pytest

from alignment import evaluate, sandbox, tir
from alignment.args import RolloutArgs
from alignment.sampling import SamplingParams, derive_seed
from alignment.sandbox import ExecResult
from tests.fake_policy import FakePolicy, ServingFakePolicy

PROMPTS = [[101, 102, 103], [104, 105]]


def code(src: str, lead: str = "") -> str:
    """One round of model text that asks for `src` to be run."""
    return f"{lead}```python\n{src}\n```\n```output"


def scripted(tokenizer, prompts, scripts):
    """A `respond` for TIR: scripts[g][k] is the list of texts trace k of prompt g writes, one per round
    (EOS appended to the last). The round is the number of "```output" fences in the response so far, and
    later rounds (n = 1) find their trace by the round-1 text the response starts with."""
    ids = {(g, k): [tokenizer(text, add_special_tokens=False).input_ids for text in rounds]
           for g, group in enumerate(scripts) for k, rounds in enumerate(group)}
    for rounds in ids.values():
        rounds[-1] = rounds[-1] + [tokenizer.eos_token_id]

    def respond(prompt, k):
        g = next(g for g, p in enumerate(prompts) if prompt[:len(p)] == list(p))
        response = prompt[len(prompts[g]):]
        if not response:
            return ids[(g, k)][0]
        k = next(k for (g2, k), rounds in ids.items() if g2 == g and response[:len(rounds[0])] == rounds[0])
        round_ = tokenizer.decode(response, skip_special_tokens=True).count(tir.CALL)
        return ids[(g, k)][round_]

    return respond


LOOPS = {"rounds": FakePolicy, "serve": ServingFakePolicy}


@pytest.fixture(params=list(LOOPS))
def loop(request):
    return request.param


def run(tokenizer, scripts, prompts=PROMPTS, max_tokens=200, seed=None, loop="rounds", **args):
    policy = LOOPS[loop](tokenizer, scripted(tokenizer, prompts, scripts))
    params = SamplingParams(n=len(scripts[0]), temperature=0.0, max_tokens=max_tokens, seed=seed)
    rows = tir.generate(policy, tokenizer, [list(p) for p in prompts], params, RolloutArgs(rollout_mode="tir", **args))
    return rows, policy


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def test_stop_resume_stitching_is_exact_on_token_ids(tokenizer, loop):
    first, last = code("print(6 * 7)", "Let me compute.\n"), "\nSo the answer is \\boxed{42}."
    rows, policy = run(tokenizer, [[[first, last]]], prompts=PROMPTS[:1], seed=3, loop=loop)
    (row,) = rows
    r1, obs, r2 = ids(tokenizer, first), ids(tokenizer, "\n42\n```\n"), ids(tokenizer, last) + [tokenizer.eos_token_id]
    assert len(policy.calls) == 2
    assert policy.calls[0][1].stop == (tir.CALL,) and policy.calls[0][1].n == 1
    assert policy.calls[1][0] == [PROMPTS[0] + r1 + obs]  # round 2 sees exactly prompt + sampled + forced ids
    assert policy.calls[1][1].max_tokens == 200 - len(r1) - len(obs)
    assert [c[1].seed for c in policy.calls] == [derive_seed(3, "round", r) for r in (1, 2)]  # a stream per round
    assert policy.keys == [[0], [0]]  # round 2 names the trace, not its position in the call
    assert row.prompt_ids == PROMPTS[0] and row.response_ids == r1 + obs + r2
    assert row.loss_mask == [1] * len(r1) + [0] * len(obs) + [1] * len(r2)
    assert row.text == tokenizer.decode(row.response_ids, skip_special_tokens=True)
    assert row.text == first + "\n42\n```\n" + last
    assert row.finish_reason == "stop"
    waited = row.stats.pop("sandbox_wait_s")
    assert row.stats == {"tool_calls": 1, "exec_errors": 0, "exec_failed": 0, "timeouts": 0, "used_code": 1,
                         "call_limit_hit": 0, "forced_tokens": len(obs)} and 0 <= waited < 60


def test_second_call_over_the_limit_gets_the_notice_and_is_not_run(tokenizer, monkeypatch, loop):
    ran = []
    real = sandbox.run_code
    monkeypatch.setattr(sandbox, "run_code", lambda src, timeout=5.0: ran.append(src) or real(src, timeout))
    script = [code("print(2 + 3)"), code("print('SECOND')", "\nAgain:\n"),
              "\n```python\nprint('THIRD')\n```\nDone: \\boxed{5}"]
    rows, policy = run(tokenizer, [[script]], prompts=PROMPTS[:1], max_tool_calls=1, loop=loop)
    (row,) = rows
    assert [src for src in ran if src != "pass"] == ["print(2 + 3)"]
    notice = "\n" + tir.LIMIT_NOTICE + "\n```\n"
    assert row.text == script[0] + "\n5\n```\n" + script[1] + notice + script[2]
    assert "SECOND" not in row.text.replace("print('SECOND')", "")
    assert [c[1].stop for c in policy.calls] == [(tir.CALL,), (tir.CALL,), ()]  # the stop goes after the notice
    notice_ids = ids(tokenizer, notice)
    end = len(row.response_ids) - len(ids(tokenizer, script[2])) - 1
    assert row.response_ids[end - len(notice_ids):end] == notice_ids
    assert row.loss_mask[end - len(notice_ids):end] == [0] * len(notice_ids)
    assert row.stats["tool_calls"] == 1 and row.stats["call_limit_hit"] == 1


@pytest.mark.parametrize("src, expected, timed_out", [
    ("x = 1\nprint(y)", "NameError: name 'y' is not defined", 0),
    ("print('partial')\n1 / 0", "partial", 0),  # ToRL: stdout wins when there is any
    ("x = 1", tir.EMPTY_OUTPUT, 0),
    ("import time\ntime.sleep(5)", "TimeoutError: timed out after 0.5 seconds", 1),
])
def test_observation_is_stdout_or_the_error_last_line(tokenizer, src, expected, timed_out, loop):
    script = [code(src), "\n\\boxed{1}"]
    rows, _ = run(tokenizer, [[script]], prompts=PROMPTS[:1], tool_timeout=0.5, loop=loop)
    assert rows[0].text == script[0] + f"\n{expected}\n```\n" + script[1]
    failed = int(expected != tir.EMPTY_OUTPUT)
    assert rows[0].stats["exec_errors"] == rows[0].stats["exec_failed"] == failed
    assert rows[0].stats["timeouts"] == timed_out


def test_no_mask_observations_trains_on_everything(tokenizer, loop):
    rows, _ = run(tokenizer, [[[code("print(1)"), "\\boxed{1}"]]], prompts=PROMPTS[:1], mask_observations=False,
                  loop=loop)
    assert rows[0].loss_mask == [1] * len(rows[0].response_ids)
    assert rows[0].stats["forced_tokens"] == len(ids(tokenizer, "\n1\n```\n"))


def test_batch_traces_progress_through_different_rounds(tokenizer, loop):
    scripts = [
        [["No code: \\boxed{3}"], [code("print(10)", "A "), "\\boxed{10}"]],
        [[code("print(1)", "B "), code("print(2)", "\n"), "\\boxed{2}"],
         [code("oops(", "C "), code("print(4)"), code("print(5)"), "\\boxed{4}"]],
    ]
    rows, policy = run(tokenizer, scripts, max_tool_calls=2, loop=loop)
    assert [r.trace_id for r in rows] == [0, 1, 2, 3] and [r.group_id for r in rows] == [0, 0, 1, 1]
    if loop == "rounds":
        assert [len(c[0]) for c in policy.calls] == [2, 3, 2, 1]  # prompts in round 1 (n=2), then running traces
        assert policy.calls[0][1].n == 2 and all(c[1].n == 1 for c in policy.calls[1:])
    else:  # a request per trace and round: 4 in round 1, then the 8 later rounds of the traces
        assert len(policy.calls) == 4 + 1 + 2 + 3 and all(c[1].n == 1 and len(c[0]) == 1 for c in policy.calls)
    assert rows[0].text == "No code: \\boxed{3}" and rows[0].stats["tool_calls"] == 0
    assert rows[1].text == scripts[0][1][0] + "\n10\n```\n\\boxed{10}"
    assert rows[2].text == scripts[1][0][0] + "\n1\n```\n" + scripts[1][0][1] + "\n2\n```\n\\boxed{2}"
    assert "SyntaxError" in rows[3].text and "\n4\n```\n" in rows[3].text and tir.LIMIT_NOTICE in rows[3].text
    assert [r.stats["tool_calls"] for r in rows] == [0, 1, 2, 2]
    assert [r.stats["exec_errors"] for r in rows] == [0, 0, 0, 1]
    assert [r.stats["call_limit_hit"] for r in rows] == [0, 0, 0, 1]
    for row in rows:
        assert len(row.loss_mask) == len(row.response_ids)
        sampled = [t for t, m in zip(row.response_ids, row.loss_mask) if m]
        assert tokenizer.decode(sampled, skip_special_tokens=True) == "".join(
            scripts[row.group_id][row.trace_id % 2])


def test_response_budget_counts_forced_tokens(tokenizer, loop):
    first = code("print('x' * 100)")
    budget = len(ids(tokenizer, first)) + 5  # room for only part of the observation
    rows, policy = run(tokenizer, [[[first, "\\boxed{1}"]]], prompts=PROMPTS[:1], max_tokens=budget, loop=loop)
    assert len(policy.calls) == 1 and len(rows[0].response_ids) == budget
    assert rows[0].finish_reason == "length" and rows[0].loss_mask[-5:] == [0] * 5


def test_extract_code_takes_the_last_complete_block():
    assert tir.extract_code("```python\na = 1\n```\ntext\n```python\nb = 2\n```\n```output") == "b = 2"
    assert tir.extract_code("```python\nc = 3\n```output") == "c = 3"  # the output fence closes it
    assert tir.extract_code("Use this: ```python\nd = 4\n```\n```output") == "d = 4"
    assert tir.extract_code("no code\n```output") is None
    assert tir.extract_code("```python\n\n```\n```output") is None


def test_observation_is_capped():
    text = tir.observation(ExecResult(ok=True, stdout="a" * 200 + "b" * 200 + "\n", error=None, timed_out=False))
    assert text == "a" * 128 + "..." + "b" * 128


@pytest.mark.parametrize("response, kwargs, expected", [
    ("so \\boxed{42}", {}, (1.0, 1.0, 1.0)),
    ("so \\boxed{41}", {}, (1.0, 0.0, -1.0)),
    ("42", {}, (0.0, 0.0, -1.0)),  # no box: wrong, even with the right number
    ("\\boxed{41} then \\boxed{42}", {}, (1.0, 1.0, 1.0)),  # the last box counts
    ("so \\boxed{42}", {"scheme": "zero_one"}, (1.0, 1.0, 1.0)),
    ("so \\boxed{7}", {"scheme": "zero_one"}, (1.0, 0.0, 0.0)),
    ("so \\boxed{42}", {"exec_penalty": 0.5, "exec_failed": True}, (1.0, 1.0, 0.5)),
    ("so \\boxed{7}", {"exec_penalty": 0.5, "exec_failed": True}, (1.0, 0.0, -1.5)),
    ("so \\boxed{7}", {"exec_penalty": 0.5, "exec_failed": False}, (1.0, 0.0, -1.0)),
])
def test_reward_table(response, kwargs, expected):
    r = tir.tir_reward_fn(response, "42", **kwargs)
    assert (r["format_reward"], r["answer_reward"], r["reward"]) == expected


def test_reward_rejects_unknown_scheme():
    with pytest.raises(ValueError, match="tir_reward_scheme"):
        tir.tir_reward_fn("\\boxed{1}", "1", scheme="plus_one")


def test_tir_metrics():
    stats = [{"used_code": 1, "tool_calls": 2, "exec_errors": 1, "call_limit_hit": 1, "sandbox_wait_s": 0.25},
             {"used_code": 1, "tool_calls": 1, "exec_errors": 0, "call_limit_hit": 0, "sandbox_wait_s": 0.5},
             {"used_code": 0, "tool_calls": 0, "exec_errors": 0, "call_limit_hit": 0},
             {"used_code": 0, "tool_calls": 0, "exec_errors": 0, "call_limit_hit": 0}]
    m = tir.tir_metrics([{"stats": s} for s in stats], [1.0, -1.0, {"answer_reward": 0.0}, -1.0])
    assert m["code_use_rate"] == 0.5 and m["tool_calls_per_response"] == 0.75 and m["call_limit_rate"] == 0.25
    assert m["exec_error_rate"] == pytest.approx(1 / 3) and m["accuracy"] == 0.25
    assert m["accuracy_with_code"] == 0.5 and m["accuracy_without_code"] == 0.0
    assert m["sandbox_wait_s"] == 0.75  # summed: the batch's time blocked on its code
    empty = tir.tir_metrics([{"stats": stats[2]}], [1.0])
    assert math.isnan(empty["exec_error_rate"]) and math.isnan(empty["accuracy_with_code"])


def test_evaluate_tir_reports_tool_stats(tokenizer, loop):
    rows = [{"question": "What is 6 times 7?", "answer": "42"}, {"question": "What is 2 plus 2?", "answer": "4"}]
    _, prompt_ids = evaluate.build_prompts(tokenizer, rows, "tir")
    assert tokenizer.decode(prompt_ids[0]).endswith("What is 6 times 7?\nAssistant:\n")
    scripts = [[[code("print(6 * 7)"), "\nThe answer is \\boxed{42}."]], [["It is \\boxed{5}."]]]
    policy = LOOPS[loop](tokenizer, scripted(tokenizer, prompt_ids, scripts))
    params = SamplingParams(temperature=0.0, max_tokens=100)
    summary, records = evaluate.evaluate(policy, tokenizer, rows, "tir", params, rollout_mode="tir",
                                         mode_args=RolloutArgs(rollout_mode="tir"))
    assert summary["avg_answer_rewards"] == 0.5 and summary["avg_all_rewards"] == 0.0
    assert summary["mean_used_code"] == 0.5 and summary["mean_tool_calls"] == 0.5 and summary["mean_exec_errors"] == 0
    m = tir.tir_metrics(records, records)
    assert m["accuracy_with_code"] == 1.0 and m["accuracy_without_code"] == 0.0


def test_training_on_tool_output_with_rollout_correction_is_refused_when_the_flags_are_parsed(capsys):
    from alignment.args import RLArgs, parse
    with pytest.raises(SystemExit):
        parse(RLArgs, ["--rollout_mode", "tir", "--prompt", "tir", "--no_mask_observations"])
    assert "add --rollout_is none" in capsys.readouterr().err
    assert parse(RLArgs, ["--rollout_mode", "tir", "--prompt", "tir", "--no_mask_observations", "--rollout_is", "none"])
