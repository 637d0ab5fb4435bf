"""Delethink rollout mode: reasoning in fixed-size chunks with a short head + tail carryover.

"The Markovian Thinker" (Aghajohari et al. 2025, arXiv 2510.06557, Alg. 1). Chunk 1 sees the prompt
and gets up to C = `delethink_chunk_size` new tokens. Every later chunk starts from a fresh context:

    prompt  +  first keep_head tokens of chunk 1  +  last (m - keep_head) response tokens so far

and gets up to C - m new tokens (m = `delethink_carryover`, default C/2). A trace ends when a chunk
finishes with "stop" (EOS or a stop string such as `</answer>`: the answer's end) or after
`delethink_max_turns` chunks (I). Attention cost is therefore O(N*C) for N thinking tokens instead of
O(N^2), and the KV cache never holds more than |prompt| + C entries.

Rules chosen here (and where they depart from the paper or the reference code):
- Cuts are made on token ids, never by decoding and re-encoding, so each row's prompt is exactly what
  the sampler saw (re-tokenising would make the training log-probs off-policy).
- The head comes from chunk 1 only and is never refreshed; keep_head + keep_tail = m, so every carryover
  is exactly m tokens. The tail is the last keep_tail tokens of the trace's response so far. This is the
  last keep_tail tokens of the latest chunk whenever C - m >= m - keep_head (every setting of the paper
  with m <= C/2); with a larger m the latest chunk is shorter than the tail, and the tail reaches back
  into the previous chunk (tokens that were in the model's context) instead of shrinking the carryover,
  as the reference code's `latest_chunk[-keep_tail:]` would.
- `params.max_tokens` is ignored: the budgets are C and C - m. `params.min_tokens` is a trace-level
  floor: each chunk gets what is still missing, capped at its budget.
- Chunk 1 is one sampler call with `params.n` samples per prompt (the prompt is prefilled once per
  group, and every request has its own seed); each later round is one call over every still-running
  trace with n = 1, a seed derived from the round and the trace id as the request key, so traces whose
  contexts are identical still draw different samples.
- The trace text (what the reward reads) is the decode of all chunks' token ids concatenated, not the
  concatenation of per-chunk texts: a chunk boundary can split a multi-byte character, which per-chunk
  decoding would turn into two replacement characters. When a stop string ended the trace, the text
  ends with it, as the samplers do.
- A stop string split across a chunk boundary (`</` | `answer>`) ends the trace where it is completed: each
  chunk's sampler checks only its own tokens, so after every later chunk the end of the tokens before it and
  the chunk's first tokens are decoded together, and a stop string begun before the boundary cuts the chunk
  after the token that completes it (finish "stop", as a sampler ends at a stop string). Without this the trace
  ran on past its `</answer>` to EOS or its last chunk.

Rows: every chunk is a training row (prompt = that chunk's input, response = its output, loss mask all
1: the carryover lives in the prompt, so no row ever trains on tokens it did not sample). Rows are
sorted by (trace, chunk); every row carries the whole trace's text and final finish reason, and
`stats` = {chunk (1-based), chunks (in the trace), trace_response_tokens (the trace's total response
length, the `trace_lengths` that `grpo.aggregate_loss(mode="trace-length")` needs)}.
"""

import dataclasses

import torch

from alignment.args import delethink_carryover
from alignment.rollout import Rollout
from alignment.sampling import Completion, SamplingParams, derive_seed


def budgets(args) -> tuple[int, int, int, int]:
    """(chunk_size C, carryover m, keep_head, keep_tail) from the rollout args."""
    chunk_size = args.delethink_chunk_size
    carryover = delethink_carryover(args)
    keep_head = args.delethink_keep_head
    if not 0 <= keep_head <= carryover < chunk_size:
        raise ValueError(f"delethink needs 0 <= keep_head ({keep_head}) <= carryover ({carryover}) < chunk_size "
                         f"({chunk_size}); lower --delethink_keep_head or --delethink_carryover.")
    return chunk_size, carryover, keep_head, carryover - keep_head


def next_prompt(prompt: list[int], response_so_far: list[int], keep_head: int, keep_tail: int) -> list[int]:
    """The next chunk's input: prompt + head of chunk 1 + tail of the response so far (token ids).

    `response_so_far` is every response token of the trace in order; its first keep_head tokens are
    chunk 1's (chunk 1 is never shorter than keep_head when it did not end the trace).
    """
    tail = response_so_far[len(response_so_far) - keep_tail:] if keep_tail else []  # [-0:] would keep all
    return list(prompt) + list(response_so_far[:keep_head]) + list(tail)


def generate(sampler, tokenizer, prompt_ids: list[list[int]], params: SamplingParams, args) -> list[Rollout]:
    """Delethink traces, `params.n` per prompt, as one row per chunk, sorted by (trace, chunk)."""
    chunk_size, carryover, keep_head, keep_tail = budgets(args)
    n = params.n
    # One entry per trace: its chunks as (input ids, completion); trace t = group * n + k.
    chunks: list[list[tuple[list[int], Completion]]] = [[] for _ in range(len(prompt_ids) * n)]
    first = sampler.generate(prompt_ids, dataclasses.replace(
        params, max_tokens=chunk_size, min_tokens=min(params.min_tokens, chunk_size)))
    for group_id, completions in enumerate(first):
        for k, completion in enumerate(completions):
            chunks[group_id * n + k].append((list(prompt_ids[group_id]), completion))

    for turn in range(2, args.delethink_max_turns + 1):
        running = [t for t, trace in enumerate(chunks) if trace[-1][1].finish_reason != "stop"]
        if not running:
            break
        contexts = [next_prompt(prompt_ids[t // n], _response(chunks[t]), keep_head, keep_tail) for t in running]
        budget = chunk_size - carryover
        produced = min(len(_response(chunks[t])) for t in running)  # equal for all: they hit every budget
        seed = derive_seed(params.seed, "round", turn) if params.seed is not None else None
        outputs = sampler.generate(contexts, dataclasses.replace(
            params, n=1, max_tokens=budget, min_tokens=min(max(params.min_tokens - produced, 0), budget), seed=seed),
            keys=running)  # each trace keeps its own random stream: same contexts still differ
        for t, context, completions in zip(running, contexts, outputs):
            chunks[t].append((context, _stop_across_boundary(tokenizer, _response(chunks[t]), completions[0],
                                                             params.stop)))

    rollouts = []
    for trace_id, trace in enumerate(chunks):
        response = _response(trace)
        last = trace[-1][1]
        text = tokenizer.decode(response, skip_special_tokens=True)
        if last.stop_reason:  # the last token may run past the stop string; the text ends with it
            text = text[:text.rfind(last.stop_reason) + len(last.stop_reason)]
        for index, (context, completion) in enumerate(trace, start=1):
            ids = list(completion.token_ids)
            rollouts.append(Rollout(prompt_ids=context, response_ids=ids, loss_mask=[1] * len(ids),
                                    trace_id=trace_id, group_id=trace_id // n, text=text,
                                    finish_reason=last.finish_reason, sampler_logprobs=completion.logprobs,
                                    stats={"chunk": index, "chunks": len(trace),
                                           "trace_response_tokens": len(response)}))
    return rollouts


def _stop_across_boundary(tokenizer, before: list[int], completion: Completion, stops) -> Completion:
    """`completion` (a later chunk, after the response tokens `before`) cut after the token that completes a stop
    string begun before the boundary, with finish "stop"; else unchanged. A stop string of s characters crosses
    the boundary with at most s - 1 characters on each side, so s tokens of each side (a token holds at least
    one character) are all that is decoded."""
    longest = max(map(len, stops), default=0)
    if not longest or not before:
        return completion
    tail = before[-longest:]
    seen = tokenizer.decode(tail, skip_special_tokens=True)
    for k in range(1, min(longest, len(completion.token_ids)) + 1):
        text = tokenizer.decode(tail + list(completion.token_ids[:k]), skip_special_tokens=True)
        found = [stop for stop in stops if stop in text and stop not in seen]
        if found:
            logprobs = completion.logprobs[:k] if completion.logprobs is not None else None
            return dataclasses.replace(completion, token_ids=list(completion.token_ids[:k]), finish_reason="stop",
                                       stop_reason=found[0], logprobs=logprobs,
                                       text=tokenizer.decode(completion.token_ids[:k], skip_special_tokens=True))
    return completion


def _response(trace) -> list[int]:
    return [token for _, completion in trace for token in completion.token_ids]


def expand_to_rows(rollouts: list[Rollout], per_trace_values) -> torch.Tensor:
    """Copy one value per trace (indexed by trace_id, e.g. GRPO advantages) onto every row: (rows,).

    Advantages are group-normalised over traces, never over rows (a trace with more chunks must not
    count more), then every chunk of a trace gets its trace's advantage on all its tokens.
    """
    values = torch.as_tensor(per_trace_values)
    return values[torch.tensor([row.trace_id for row in rollouts], dtype=torch.long)]
