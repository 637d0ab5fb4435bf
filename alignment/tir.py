"""Tool-integrated reasoning (TIR) rollout mode and its reward: the model writes Python, a sandbox runs it,
the output is put back into the context and generation resumes (ToRL, Li et al. 2025, arXiv 2503.23383;
the Qwen2.5-Math TIR evaluation). References and their details: shared/notes/tir.md (sections A1-A6).

    uv run -m alignment.evaluate --rollout_mode tir --prompt tir --limit 20

One trace reads (| marks who wrote what):

    prompt | model: ...```python\\n<code>\\n```\\n```output | forced: \\n<obs>\\n```\\n | model: ...\\boxed{7}<eos>

Rules chosen here (departures from the references are marked):
- The stop string is "```output", as in ToRL (A1.1) and Qwen2.5-Math (A6): the model asks for a run by
  opening an output fence after its code. Preferred over stopping at the closing fence of a ```python
  block because it is what the reference RL recipe trains and what TIR-trained models already write, a
  block the model only shows is not run, and one stop string suffices (a closing-fence stop needs
  ZeroTIR's two-phase stops, A3, since "```" also opens blocks). Cost: a model that closes its block and
  never writes "```output" never runs code (SmolLM2-135M, zero-shot, mostly does not).
- Our samplers keep the stop string, so the model's "```output" stays in its sampled tokens, in the loss
  (ToRL's mask keeps the re-inserted opener in the loss too, A1.9). The forced text is
  "\\n{observation}\\n```\\n", without the leading newline when the sampled text after the stop string (a
  token may run past it) already ends in one.
- Code: the last complete ```python block in this round's text (A1.4, stateless, no replay); a line
  starting with ``` closes a block, so "```output" itself closes an unclosed one. A request without a
  block is answered with a SyntaxError-style line and counts as a failed call (departure: ToRL skips it).
- Observation (A1.6): stdout when the code ran or printed something, else the error's last line (the
  sandbox returns only that); stripped; over 256 characters it keeps the first and last 128 around "...".
  An empty result reads "(no output)" (departure: ToRL writes a stray TimeoutError text, Qwen leaves it
  empty); an explicit text tells the model it forgot to print.
- Budget C = --max_tool_calls: requests 1..C are answered by the sandbox; request C+1 gets
  "Reach max function call limit." as its observation (Qwen2.5-Math A6; ToRL gives no notice, A1.8), and
  from then on that trace samples without the "```output" stop, so no later code runs. A trace thus takes
  at most C + 2 rounds.
- Token budget: `params.max_tokens` caps the whole response, forced tokens included, so a trace fits the
  training sequence length (departure: ToRL gives every round the full 3072). A trace samples with its own
  budget left (in rounds: the largest left in the call) and is cut to its own; a forced text that would overrun
  the budget is cut and ends the trace with "length". `params.min_tokens` is a trace-level floor.
- Token-in/token-out: sampled ids are never re-tokenised; the forced text is tokenised on its own and
  appended as ids; the next round's prompt is the original prompt + every response id so far
  (departure: ToRL re-tokenises the whole string, A1.7, which puts training slightly off-policy).
- Batching: with a sampler that serves (vLLM, `VLLMSampler.serve`) every trace is a request of its own and
  its next round enters the engine as soon as its code has run, beside the traces still decoding (continuous
  batching, as the agent loops of verl and prime-rl run multi-turn rollouts): no trace waits for a round's
  slowest. Other samplers (HF) run in rounds: round 1 is one call with `params.n` samples per prompt (each
  prompt prefilled once); each later round samples every running trace with n = 1, in at most two calls:
  traces past their budget (no "```output" stop) and traces that may still call the tool. Either way round
  r of a trace draws from derive_seed(derive_seed(seed, "round", r), key, child), key and child being the
  prompt and the sample in round 1 and the trace afterwards: the same seeds give the same traces, and
  identical contexts still draw different samples.
- Overlap: executions run in a thread pool (the sandbox serves one snippet per core and is thread-safe),
  started in the background while round 1 generates. Under `serve` a trace's code runs while the others
  decode, and sandbox_wait_s stays near 0 (the engine idles only when nothing but code is running). In
  rounds all executions of a round run at once; traces past their budget (their forced text is the
  notice, known at once) are sampled while the round's code still runs, the traces waiting for code
  results after it; a trace's code does not run while other traces of its round still generate.

Rows: one per trace (prompt = the original prompt, response = everything after it, loss_mask 1 on sampled
tokens and 0 on forced ones, or 1 everywhere with --no_mask_observations). `text` is the decode of the
whole response (ending at a user stop string when one ended the trace). `stats`: tool_calls (requests the
sandbox answered), exec_errors, exec_failed (0/1), timeouts, used_code (0/1: at least one call),
call_limit_hit (0/1), forced_tokens, sandbox_wait_s (seconds the rollout was blocked on this trace's code).
`tir_metrics` turns rows and rewards into the per-step metrics.
"""

import dataclasses
import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

from alignment import sandbox
from alignment.drgrpo_grader import extract_boxed, grade
from alignment.rollout import Rollout
from alignment.sampling import Completion, Request, SamplingParams, derive_seed

CALL = "```output"  # the stop string: the model asks for its code to be run
LIMIT_NOTICE = "Reach max function call limit."
NO_CODE = "SyntaxError: no complete ```python block before ```output"
EMPTY_OUTPUT = "(no output)"
MAX_OBSERVATION_CHARS = 256
REWARD_SCHEMES = {"plus_minus_one": (1.0, -1.0), "zero_one": (1.0, 0.0)}  # (right, wrong), ToRL A2


@dataclasses.dataclass
class _Trace:
    prompt: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)  # response so far: sampled and forced
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # the sampler's; NaN on forced tokens
    finish: str = "length"
    stop: str | None = None  # the stop string that ended the latest round
    done: bool = False
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    limit_hit: bool = False
    forced: int = 0  # forced tokens (observations and notices)
    waited: float = 0.0  # seconds the rollout waited for this trace's code to finish (the sandbox's share)
    pending: Future | None = None  # the sandbox run whose observation is still to be appended
    round: int = 1  # the round it sampled last (`serve`; in rounds every running trace samples each round)
    newline: str = "\n"  # what the pending observation starts with


def extract_code(text: str) -> str | None:
    """The last complete ```python block of `text` (a line starting with ``` closes it), or None."""
    code, block = None, None
    for line in text.split("\n"):
        stripped = line.strip()
        if block is None:
            if stripped.startswith("```python") or stripped.endswith("```python"):
                block = []
        elif stripped.startswith("```"):
            code, block = "\n".join(block), None
        else:
            block.append(line)
    return code if code and code.strip() else None


def observation(result: sandbox.ExecResult) -> str:
    """What the model sees of a run: stdout, or the error's last line when it failed silently (ToRL)."""
    text = (result.stdout if result.ok or result.stdout.strip() else result.error or "").strip()
    if len(text) > MAX_OBSERVATION_CHARS:
        half = MAX_OBSERVATION_CHARS // 2
        text = text[:half] + "..." + text[-half:]
    return text or EMPTY_OUTPUT


def generate(sampler, tokenizer, prompt_ids: list[list[int]], params: SamplingParams, args) -> list[Rollout]:
    """TIR traces, `params.n` per prompt, one row per trace (trace t = group * n + k)."""
    n, budget, user_stops = params.n, params.max_tokens, tuple(params.stop)
    forced_mask = 0 if args.mask_observations else 1
    traces = [_Trace(prompt=list(p)) for p in prompt_ids for _ in range(n)]
    trace_ids = {id(t): i for i, t in enumerate(traces)}  # trace -> its request key in later rounds

    def force(trace: _Trace, body: str, newline: str):
        ids = tokenizer(newline + body + "\n```\n", add_special_tokens=False).input_ids
        room = budget - len(trace.ids)
        trace.ids += ids[:room]
        trace.mask += [forced_mask] * len(ids[:room])
        trace.logprobs += [math.nan] * len(ids[:room])
        trace.forced += len(ids[:room])
        if len(ids) >= room:  # nothing left to sample after it
            trace.finish, trace.stop, trace.done = "length", None, True

    def take(trace: _Trace, completion: Completion):
        ids = completion.token_ids[:budget - len(trace.ids)]
        cut = len(ids) < len(completion.token_ids)
        trace.ids += ids
        trace.mask += [1] * len(ids)
        trace.logprobs += (completion.logprobs or [math.nan] * len(completion.token_ids))[:len(ids)]
        trace.finish, trace.stop = ("length", None) if cut else (completion.finish_reason, completion.stop_reason)
        if trace.stop != CALL:  # EOS, a user stop string or the budget: the trace is over
            trace.done = True
            return
        if len(trace.ids) >= budget:  # it asks for a run but there is no room left for the output
            trace.finish, trace.stop, trace.done = "length", None, True
            return
        after = tokenizer.decode(ids, skip_special_tokens=True)
        after = after[after.rfind(CALL) + len(CALL):]  # a token may run past the stop string
        newline = "" if after.endswith("\n") else "\n"
        if trace.calls == args.max_tool_calls:
            trace.limit_hit = True
            return force(trace, LIMIT_NOTICE, newline)
        trace.calls += 1
        code = extract_code(completion.text)
        if code is None:
            trace.errors += 1
            return force(trace, NO_CODE, newline)
        trace.pending, trace.newline = pool.submit(sandbox.run_code, code, args.tool_timeout), newline

    def settle(trace: _Trace):
        start = time.perf_counter()
        result, trace.pending = trace.pending.result(), None
        trace.waited += time.perf_counter() - start
        trace.errors += not result.ok
        trace.timeouts += result.timed_out
        force(trace, observation(result), trace.newline)

    def params_for(group: list[_Trace], stops: tuple[str, ...], round_: int, n_: int) -> SamplingParams:
        max_tokens = max(budget - len(t.ids) for t in group)
        min_tokens = min(max(params.min_tokens - len(t.ids), 0) for t in group)
        seed = derive_seed(params.seed, "round", round_) if params.seed is not None else None
        return dataclasses.replace(params, n=n_, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                                   stop=stops, seed=seed)

    def request(trace: _Trace) -> Request:  # the trace's next round, as a request of its own (`serve`)
        stops = user_stops if trace.limit_hit else user_stops + (CALL,)
        trace.round += 1
        return Request(trace.prompt + trace.ids, params_for([trace], stops, trace.round, 1), trace_ids[id(trace)])

    def follow(trace_id: int, event: Completion | Future) -> Request | Future | None:
        trace = traces[trace_id]
        if isinstance(event, Future):
            settle(trace)
        else:
            take(trace, event)
        return None if trace.done else trace.pending or request(trace)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        warm_up = pool.submit(sandbox.run_code, "pass")  # starts the zygotes while round 1 generates
        first = params_for(traces, user_stops + (CALL,), 1, n)
        if hasattr(sampler, "serve"):  # continuous: a trace's next round starts as soon as its code has run
            sampler.serve({t: Request(list(prompt_ids[t // n]), first, t // n, t % n) for t in range(len(traces))},
                          follow)
        else:
            _rounds(sampler, traces, trace_ids, prompt_ids, first, user_stops, take, settle, params_for)
        warm_up.result()  # a sandbox that cannot start should say so even when no code ran

    rollouts = []
    for trace_id, trace in enumerate(traces):
        text = tokenizer.decode(trace.ids, skip_special_tokens=True)
        if trace.stop in user_stops:  # the last token may run past the stop string; the text ends with it
            text = text[:text.rfind(trace.stop) + len(trace.stop)]
        stats = {"tool_calls": trace.calls, "exec_errors": trace.errors, "exec_failed": int(trace.errors > 0),
                 "timeouts": trace.timeouts, "used_code": int(trace.calls > 0),
                 "call_limit_hit": int(trace.limit_hit), "forced_tokens": trace.forced, "sandbox_wait_s": trace.waited}
        rollouts.append(Rollout(prompt_ids=trace.prompt, response_ids=trace.ids, loss_mask=trace.mask,
                                trace_id=trace_id, group_id=trace_id // n, text=text, finish_reason=trace.finish,
                                stats=stats, sampler_logprobs=trace.logprobs if params.logprobs else None))
    return rollouts


def _rounds(sampler, traces, trace_ids, prompt_ids, first: SamplingParams, user_stops, take, settle, params_for):
    """`generate` in rounds, for samplers that return a batch only as a whole: round 1 samples every prompt
    `first.n` times; each later round samples every running trace once, in at most two calls (traces past
    their budget first: they wait for no code, so they sample while code runs)."""
    for trace, completion in zip(traces, [c for completions in sampler.generate(prompt_ids, first) for c in completions]):
        take(trace, completion)
    round_ = 1
    while any(not t.done for t in traces):
        round_ += 1
        for limit_hit, stops in ((True, user_stops), (False, user_stops + (CALL,))):
            group = [t for t in traces if not t.done and t.limit_hit == limit_hit]
            for trace in group:
                if trace.pending is not None:
                    settle(trace)
            group = [t for t in group if not t.done]
            if not group:
                continue
            outputs = sampler.generate([t.prompt + t.ids for t in group], params_for(group, stops, round_, 1),
                                       keys=[trace_ids[id(t)] for t in group])  # a stream per trace
            for trace, completions in zip(group, outputs):
                take(trace, completions[0])


def tir_reward_fn(response: str, ground_truth, scheme: str = "plus_minus_one", exec_penalty: float = 0.0,
                  exec_failed: bool = False, fast: bool = True) -> dict:
    """ToRL's outcome reward (A2): +1 if the last \\boxed{} is right, else -1 (also with no box);
    `scheme="zero_one"` gives 1/0. Minus `exec_penalty` when the response's code failed to run.

    format_reward: a \\boxed{} exists; answer_reward: 1/0 correctness (so evaluate's accuracy is the
    correctness rate whatever the scheme).
    """
    if scheme not in REWARD_SCHEMES:
        raise ValueError(f"unknown --tir_reward_scheme {scheme!r}; choose {' or '.join(REWARD_SCHEMES)}.")
    right, wrong = REWARD_SCHEMES[scheme]
    answer = extract_boxed(response)
    correct = answer is not None and grade(answer, ground_truth, fast)
    reward = (right if correct else wrong) - (exec_penalty if exec_failed else 0.0)
    return {"format_reward": float(answer is not None), "answer_reward": float(correct), "reward": reward}


def tir_metrics(items, rewards) -> dict:
    """Tool-use metrics of a batch: `items` are TIR rows (Rollout) or evaluate's records (dicts with
    "stats"); `rewards` the matching reward dicts (answer_reward is correctness) or numbers (> 0 = right).
    Accuracies over an empty subset are NaN."""
    stats = [item["stats"] if isinstance(item, dict) else item.stats for item in items]
    correct = [r["answer_reward"] if isinstance(r, dict) else float(r > 0) for r in rewards]
    if len(stats) != len(correct):
        raise ValueError(f"tir_metrics got {len(stats)} rows but {len(correct)} rewards; pass one reward per row.")
    used = [s.get("used_code", 0) > 0 for s in stats]
    calls = sum(s.get("tool_calls", 0) for s in stats)

    def mean(values):
        values = list(values)
        return sum(values) / len(values) if values else math.nan

    return {
        "code_use_rate": mean(used),
        "tool_calls_per_response": mean(s.get("tool_calls", 0) for s in stats),
        "exec_error_rate": sum(s.get("exec_errors", 0) for s in stats) / calls if calls else math.nan,
        "call_limit_rate": mean(s.get("call_limit_hit", 0) for s in stats),
        "accuracy": mean(correct),
        "accuracy_with_code": mean(c for c, u in zip(correct, used) if u),
        "accuracy_without_code": mean(c for c, u in zip(correct, used) if not u),
        "sandbox_wait_s": sum(s.get("sandbox_wait_s", 0.0) for s in stats),  # the batch's time waiting on code
    }
