"""The rollout record every mode produces, and the standard (single long chain of thought) mode.

A rollout mode is a function `generate(sampler, tokenizer, prompt_ids, params, args) -> list[Rollout]`:
`prompt_ids` holds one tokenised prompt per question, `params.n` traces are drawn per question, and
`args` carries the mode's own options. One trace may span several rows (Delethink chunks); each row is
one training example with its own prompt and response. Tokens the model did not sample (tool output,
notices) sit in `response_ids` with loss_mask 0, so the loss never needs to know which mode ran.
"""

from dataclasses import dataclass, field

from alignment.sampling import SamplingParams


@dataclass
class Rollout:
    prompt_ids: list[int]  # the exact context this row's response was generated from
    response_ids: list[int]  # tokens after the prompt, sampled or forced
    loss_mask: list[int]  # 1 on sampled tokens, 0 on forced ones (tool output, notices)
    trace_id: int  # rows of one trace share it; traces are numbered group by group: group_id * n + k
    group_id: int  # index of the question in the batch; its n traces share the reward baseline
    text: str  # the whole trace's response text (all rows, in order): what the reward reads
    finish_reason: str  # of the trace's last generation: "stop" or "length"
    stats: dict = field(default_factory=dict)  # per-mode numbers: chunks, tool calls, ...
    # the sampler's log-prob of each response token (NaN on forced ones), when it was asked for them:
    # compared with the learner's own log-probs to log the sampler/learner mismatch
    sampler_logprobs: list[float] | None = None


def generate(sampler, tokenizer, prompt_ids: list[list[int]], params: SamplingParams, args=None) -> list[Rollout]:
    """Standard LongCoT: one generation of up to `params.max_tokens` per trace, one row per trace."""
    outputs = sampler.generate(prompt_ids, params)
    rollouts = []
    for group_id, (prompt, completions) in enumerate(zip(prompt_ids, outputs)):
        for k, completion in enumerate(completions):
            rollouts.append(Rollout(prompt_ids=list(prompt), response_ids=list(completion.token_ids),
                                    loss_mask=[1] * len(completion.token_ids), trace_id=group_id * params.n + k,
                                    group_id=group_id, text=completion.text, finish_reason=completion.finish_reason,
                                    sampler_logprobs=completion.logprobs))
    return rollouts


def traces(rollouts: list[Rollout]) -> list[list[Rollout]]:
    """Group rows by trace, in trace order (one list of rows per trace)."""
    by_trace: dict[int, list[Rollout]] = {}
    for row in rollouts:
        by_trace.setdefault(row.trace_id, []).append(row)
    return [by_trace[t] for t in sorted(by_trace)]
