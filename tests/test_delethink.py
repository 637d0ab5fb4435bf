"""Delethink rollouts on a scripted fake policy: carryover composition, stop rules, trace text, rows and
loss masks, trace ids, advantage expansion and trace-length aggregation, and evaluation."""

import pytest
import torch

from alignment import delethink, evaluate, grpo
from alignment.args import RolloutArgs
from alignment.rollout import traces
from alignment.sampling import SamplingParams
from tests.fake_policy import FakePolicy, continue_streams

PROMPTS = [[101, 102, 103], [104, 105], [106, 107, 108, 109]]  # ids disjoint from every stream below
EMOJI = [10813, 38887]  # "🙂" in the SmolLM2 vocabulary: one character, two byte-level tokens


def filler(trace: int, length: int) -> list[int]:
    """Distinct token ids, distinct across traces, so every carried-over tail is unique."""
    return list(range(1000 + 500 * trace, 1000 + 500 * trace + length))


def mode_args(chunk_size, carryover, keep_head, max_turns=5) -> RolloutArgs:
    return RolloutArgs(rollout_mode="delethink", delethink_chunk_size=chunk_size, delethink_carryover=carryover,
                       delethink_keep_head=keep_head, delethink_max_turns=max_turns)


def run(tokenizer, streams_by_prompt, args, **params):
    policy = FakePolicy(tokenizer, continue_streams({tuple(p): s for p, s in streams_by_prompt}))
    prompts = [list(p) for p, _ in streams_by_prompt]
    n = len(streams_by_prompt[0][1])
    rows = delethink.generate(policy, tokenizer, prompts, SamplingParams(n=n, temperature=0.0, **params), args)
    return rows, policy


@pytest.mark.parametrize("chunk_size, carryover, keep_head", [
    (16, 8, 3), (16, None, 3), (9, 4, 1), (20, 10, 0),
    (10, 7, 2),  # m > C/2: chunks of 3 new tokens, tail of 5 reaches back into the previous chunk
])
def test_carryover_is_prompt_plus_head_of_chunk1_plus_tail(tokenizer, chunk_size, carryover, keep_head):
    stream = filler(0, 200)
    rows, policy = run(tokenizer, [(PROMPTS[0], [stream])], mode_args(chunk_size, carryover, keep_head, 4))
    m = carryover if carryover is not None else chunk_size // 2
    tail = m - keep_head
    ends = [chunk_size + i * (chunk_size - m) for i in range(4)]  # stream position after each chunk
    assert [r.response_ids for r in rows] == [stream[:ends[0]]] + [stream[a:b] for a, b in zip(ends, ends[1:])]
    assert rows[0].prompt_ids == PROMPTS[0]
    for row, end in zip(rows[1:], ends):
        assert row.prompt_ids == PROMPTS[0] + stream[:keep_head] + stream[end - tail:end]
        assert len(row.prompt_ids) - len(PROMPTS[0]) == m
    # each row's prompt is exactly what the sampler saw, and the budgets are C then C - m
    assert [prompts[0] for prompts, _ in policy.calls] == [r.prompt_ids for r in rows]
    assert [params.max_tokens for _, params in policy.calls] == [chunk_size] + [chunk_size - m] * 3


def test_carryover_without_tail_keeps_only_the_head(tokenizer):
    stream = filler(0, 100)
    rows, _ = run(tokenizer, [(PROMPTS[0], [stream])], mode_args(12, 6, 6, 3))
    assert [r.prompt_ids for r in rows[1:]] == [PROMPTS[0] + stream[:6]] * 2  # not the whole chunk ([-0:])
    assert [r.response_ids for r in rows] == [stream[:12], stream[6:12], stream[6:12]]


def test_stop_rules_and_batching_over_running_traces(tokenizer):
    eos = tokenizer.eos_token_id
    in_chunk1 = filler(0, 5) + [eos]
    in_chunk3 = filler(1, 27) + [eos]  # chunks 16, 8 and then 4 tokens ending in EOS
    never = filler(2, 100)
    rows, policy = run(tokenizer, [(PROMPTS[0], [in_chunk1]), (PROMPTS[1], [in_chunk3]), (PROMPTS[2], [never])],
                       mode_args(16, 8, 2, max_turns=4))
    assert [(r.trace_id, r.stats["chunk"]) for r in rows] == [(0, 1), (1, 1), (1, 2), (1, 3),
                                                              (2, 1), (2, 2), (2, 3), (2, 4)]
    assert rows[0].response_ids == in_chunk1 and rows[0].finish_reason == "stop"
    assert rows[3].response_ids == in_chunk3[24:] and [r.finish_reason for r in rows[1:4]] == ["stop"] * 3
    assert [len(r.response_ids) for r in rows[4:]] == [16, 8, 8, 8]
    assert [r.finish_reason for r in rows[4:]] == ["length"] * 4  # clipped at max turns: never an end
    # one sampler call per round, over the traces still running, n=1 per context after chunk 1
    assert [len(prompts) for prompts, _ in policy.calls] == [3, 2, 2, 1]
    assert [params.n for _, params in policy.calls] == [1, 1, 1, 1]


def test_stop_string_ends_the_trace_and_the_text(tokenizer):
    answer = tokenizer(" </think> <answer>4</answer>", add_special_tokens=False).input_ids
    stream = filler(0, 27) + answer + filler(1, 30)
    rows, policy = run(tokenizer, [(PROMPTS[0], [stream])], mode_args(16, 8, 2), stop=("</answer>",))
    assert len(rows) == 4 and rows[-1].finish_reason == "stop"
    assert sum(len(r.response_ids) for r in rows) == 27 + len(answer)
    assert rows[0].text == tokenizer.decode(stream[:27 + len(answer)]) and rows[0].text.endswith("</answer>")
    assert all(params.stop == ("</answer>",) for _, params in policy.calls)


def test_min_tokens_is_a_trace_level_floor(tokenizer):
    _, policy = run(tokenizer, [(PROMPTS[0], [filler(0, 100)])], mode_args(16, 8, 2, 3), min_tokens=20)
    assert [params.min_tokens for _, params in policy.calls] == [16, 4, 0]


def test_trace_text_decodes_all_chunks_at_once(tokenizer):
    stream = filler(0, 15) + EMOJI + filler(1, 40)  # chunk 1 ends between the emoji's two tokens
    rows, _ = run(tokenizer, [(PROMPTS[0], [stream])], mode_args(16, 8, 2, 2))
    assert rows[0].response_ids[-1] == EMOJI[0] and rows[1].response_ids[0] == EMOJI[1]
    assert "\ufffd" in tokenizer.decode(rows[0].response_ids)  # per-chunk decoding would break it
    assert rows[0].text == rows[1].text == tokenizer.decode(stream[:24])
    assert "🙂" in rows[0].text and "\ufffd" not in rows[0].text


def n_traces_setup(tokenizer):
    """2 prompts x 3 traces ending in chunk 1, 2, never, never, EOS first, chunk 3 (C=8, m=4, I=3)."""
    eos = tokenizer.eos_token_id
    scripts = [filler(0, 3) + [eos], filler(1, 10) + [eos], filler(2, 50),
               filler(3, 50), [eos], filler(4, 13) + [eos]]
    return run(tokenizer, [(PROMPTS[0], scripts[:3]), (PROMPTS[1], scripts[3:])], mode_args(8, 4, 1, 3))


def test_rows_ids_and_loss_masks_for_n_traces_per_prompt(tokenizer):
    rows, policy = n_traces_setup(tokenizer)
    assert [r.trace_id for r in rows] == [0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 5, 5, 5]
    assert [r.group_id for r in rows] == [r.trace_id // 3 for r in rows]
    assert [r.stats["chunk"] for r in rows] == [1, 1, 2, 1, 2, 3, 1, 2, 3, 1, 1, 2, 3]
    assert [len(r.response_ids) for r in rows] == [4, 8, 3, 8, 4, 4, 8, 4, 4, 1, 8, 4, 2]
    for trace in traces(rows):
        total = sum(len(r.response_ids) for r in trace)
        assert all(r.stats["chunks"] == len(trace) and r.stats["trace_response_tokens"] == total for r in trace)
        assert len({(r.text, r.finish_reason) for r in trace}) == 1
    assert all(r.loss_mask == [1] * len(r.response_ids) for r in rows)  # carryover is prompt, not response
    assert [(len(prompts), params.n) for prompts, params in policy.calls] == [(2, 3), (4, 1), (3, 1)]


def test_trace_advantage_reaches_every_row_and_trace_length_loss(tokenizer):
    rows, _ = n_traces_setup(tokenizer)
    all_traces = traces(rows)
    texts = [trace[0].text for trace in all_traces]

    def reward_fn(text, ground_truth):
        return {"reward": float(len(text))}

    advantages, raw, _ = grpo.compute_group_normalized_rewards(reward_fn, texts, [""] * 6, group_size=3,
                                                              advantage_eps=1e-6, normalize_by_std=True)
    row_advantages = delethink.expand_to_rows(rows, advantages)
    for g in range(2):  # group-normalised over the group's traces, not over its rows
        group = raw[3 * g:3 * g + 3]
        expected = (group - group.mean()) / (group.std() + 1e-6)
        for row, advantage in zip(rows, row_advantages):
            if row.group_id == g:
                assert advantage == pytest.approx(expected[row.trace_id - 3 * g].item())
    assert len(set(row_advantages.tolist())) == 6  # six different trace advantages, none lost

    torch.manual_seed(0)
    width = max(len(r.response_ids) for r in rows)
    logp = -torch.rand(len(rows), width)  # (R, T)
    mask = torch.tensor([r.loss_mask + [0] * (width - len(r.loss_mask)) for r in rows])
    per_token = grpo.compute_naive_policy_gradient_loss(row_advantages[:, None], logp)
    trace_lengths = torch.tensor([r.stats["trace_response_tokens"] for r in rows])
    loss = grpo.aggregate_loss(per_token, mask, "trace-length", trace_lengths=trace_lengths, num_traces=6)
    expected = 0.0  # Delethink eq. 3: (1/G) sum_traces (1/len(trace)) sum of the trace's token losses
    for t, trace in enumerate(all_traces):
        index = [i for i, r in enumerate(rows) if r.trace_id == t]
        tokens = torch.cat([logp[i, :len(rows[i].response_ids)] for i in index])
        expected += (-advantages[t] * tokens).sum() / len(tokens) / 6
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    halves = [grpo.aggregate_loss(per_token[s], mask[s], "trace-length", trace_lengths=trace_lengths[s], num_traces=6)
              for s in (slice(0, 5), slice(5, None))]  # a trace's rows split over two microbatches
    assert sum(halves).item() == pytest.approx(expected.item(), rel=1e-5)
    row_mean = grpo.aggregate_loss(per_token, mask, "seq-mean-token-mean")
    assert row_mean.item() != pytest.approx(expected.item(), rel=1e-3)  # the rows' shape matters here


def test_evaluate_reports_chunks_and_thinking_tokens(tokenizer):
    rows = [{"question": "What is 2+2?", "answer": "4"}, {"question": "What is 2+3?", "answer": "5"}]
    _, prompt_ids = evaluate.build_prompts(tokenizer, rows, "r1_zero")
    answer = lambda a: tokenizer(f" </think> <answer>{a}</answer>", add_special_tokens=False).input_ids
    long, short = filler(0, 27) + answer(4) + filler(1, 30), filler(2, 5) + answer(6) + filler(3, 30)
    policy = FakePolicy(tokenizer, continue_streams({tuple(prompt_ids[0]): [long], tuple(prompt_ids[1]): [short]}))
    summary, records = evaluate.evaluate(policy, tokenizer, rows, "r1_zero", SamplingParams(temperature=0.0),
                                         rollout_mode="delethink", mode_args=mode_args(16, 8, 2))
    lengths = [27 + len(answer(4)), 5 + len(answer(6))]  # 37 tokens -> chunks 16, 8, 8, 5; 15 -> one chunk
    assert [r["n_rows"] for r in records] == [4, 1]
    assert summary["mean_chunks"] == 2.5
    assert summary["mean_trace_response_tokens"] == summary["mean_response_tokens"] == sum(lengths) / 2
    assert summary["avg_answer_rewards"] == 0.5 and summary["avg_format_rewards"] == 1.0


def test_bad_budgets_fail_loudly():
    with pytest.raises(ValueError, match="keep_head"):
        delethink.budgets(mode_args(16, 4, 8))


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_sequence_level_correction_takes_a_delethink_traces_ratio_over_all_its_chunks(tiny_model, level):
    """A trace of two rows (chunks) and a trace of one: with a sequence or geometric level, both chunks of the
    first trace get the ratio of the whole trace, computed from its summed log(old / sampler) (and, for
    geometric, its token count), as the definition written out per trace says; rows apart would each get
    their own."""
    import contextlib
    import math
    from alignment.args import RLArgs
    from alignment.estimators import compute_rollout_is_weights
    from alignment.experience import Batch, build_experience
    from alignment.rollout import Rollout
    from alignment.tokens import rollout_log_probs
    g = torch.Generator().manual_seed(3)
    prompts, responses = [[5, 6, 7], [5, 6, 7, 8, 9], [5, 6]], [[11, 12, 13], [14, 15], [16, 17, 18, 19]]
    with torch.no_grad():
        learner = rollout_log_probs(tiny_model, prompts, responses)["log_probs"]
    shifts = [torch.randn(len(r), generator=g) * 0.3 for r in responses]
    rows = [Rollout(p, r, [1] * len(r), trace_id=t, group_id=0, text="x", finish_reason="stop",
                    sampler_logprobs=(learner[i, :len(r)] - shifts[i]).tolist())
            for i, (p, r, t) in enumerate(zip(prompts, responses, [0, 0, 1]))]
    batch = Batch([rows[:2], rows[2:]], torch.tensor([1.0, 0.0]), {}, [], {})
    args = RLArgs(rollout_mode="delethink", group_size=2, rollout_batch_size=2, train_batch_size=2, train_mini_batch_size=2,
                  rollout_is_level=level, loss_agg_mode="trace-length")
    args.check()
    exp = build_experience(args, batch, tiny_model, None, None, contextlib.nullcontext())
    mb = exp.microbatch([0, 1, 2], "cpu")
    weights, _ = compute_rollout_is_weights(mb.old_log_probs, mb.sampler_log_probs, mb.mask, "truncate", level, 2.0,
                                            mb.sequence_log_ratio, mb.sequence_tokens)
    trace_sums = [float(shifts[0].sum() + shifts[1].sum()), float(shifts[2].sum())]
    trace_tokens = [5, 4]
    for row, trace in ((0, 0), (1, 0), (2, 1)):
        log_ratio = trace_sums[trace] / (trace_tokens[trace] if level == "geometric" else 1)
        expected = min(math.exp(log_ratio), 2.0)
        n = len(responses[row])
        torch.testing.assert_close(weights[row, :n], torch.full((n,), expected), rtol=1e-4, atol=1e-5)


def test_sft_rows_are_the_rows_delethink_cuts_a_written_solution_into(tokenizer, data_dir):
    _check_sft_rows_against_delethink(tokenizer, data_dir, min_terms=4)


def _check_sft_rows_against_delethink(tokenizer, data_dir, min_terms: int):
    """`sft --delethink_chunk_size`: had the model written each worked solution, Delethink's later chunks would
    start from exactly the SFT rows' prompts, and what each row trains on is the rest of that solution."""
    from alignment import sft
    from alignment.args import SFTArgs
    args = SFTArgs(dataset=f"rg:basic_arithmetic:min_terms={min_terms},max_terms=9,max_digits=1,operators=+,allow_negation=false,"
                           "allow_parentheses=false", worked_style="counted", max_examples=12, data_dir=str(data_dir),
                   delethink_chunk_size=48, delethink_carryover=24)
    examples = sft.load_sft_examples(args, tokenizer)
    full, cut = examples[:12], examples[12:]
    prompts = [tokenizer(e["prompt"], add_special_tokens=False).input_ids for e in full]
    streams = [tokenizer(e["response"], add_special_tokens=False).input_ids for e in full]
    assert max(map(len, streams)) > 72 and min(map(len, streams)) <= 48  # no cut, one, and several
    policy = FakePolicy(tokenizer, continue_streams({tuple(p): [s + [tokenizer.eos_token_id]]
                                                     for p, s in zip(prompts, streams)}))
    rows = delethink.generate(policy, tokenizer, prompts, SamplingParams(n=1, temperature=0.0, stop=("</answer>",)),
                              mode_args(48, 24, 0, max_turns=10))
    later = [row for row in rows if row.stats["chunk"] > 1]
    assert len(later) == len(cut) > 12
    for row, example in zip(later, cut):
        source = full[row.trace_id]
        assert tokenizer.decode(row.prompt_ids) == example["prompt"]
        carried = example["prompt"].removeprefix(source["prompt"])  # the m tokens before the cut, then the rest
        assert carried != example["prompt"] and source["response"].endswith(carried + example["response"])
        assert example["response"].startswith(tokenizer.decode(row.response_ids))
    assert all(row.finish_reason == "stop" and row.text == full[row.trace_id]["response"] for row in rows)


def test_sft_rows_need_a_carryover_inside_the_chunk():
    from alignment.args import SFTArgs
    with pytest.raises(ValueError, match="--delethink_carryover 48 must be above 0 and below --delethink_chunk_size 48"):
        SFTArgs(dataset="rg:chain_sum", delethink_chunk_size=48, delethink_carryover=48).check()


def test_a_stop_string_split_by_a_chunk_boundary_ends_the_trace_where_it_is_completed(tokenizer):
    """`</` at the end of one chunk and `answer>` at the start of the next: each chunk's sampler sees only its own
    tokens, so the trace once ran on to EOS (or its last chunk); it ends after the token that completes the stop."""
    prompt = tokenizer("Q: 1 + 2?", add_special_tokens=False).input_ids
    stream = tokenizer(" 1 + 2 = 3 so the answer is 3 </answer> and then more words here", add_special_tokens=False).input_ids
    text_upto = [tokenizer.decode(stream[:k]) for k in range(len(stream) + 1)]
    split = next(k for k in range(len(stream)) if text_upto[k].endswith("</") or
                 ("</answer>" in text_upto[k + 1] and "</answer>" not in text_upto[k] and text_upto[k].endswith("<")))
    end = next(k for k in range(len(stream) + 1) if "</answer>" in text_upto[k])
    assert 0 < split < end  # the stop string spans the boundary after `split` tokens
    policy = FakePolicy(tokenizer, continue_streams({tuple(prompt): [stream + [tokenizer.eos_token_id]]}))
    rows = delethink.generate(policy, tokenizer, [prompt], SamplingParams(n=1, temperature=0.0, stop=("</answer>",)),
                              mode_args(split, split // 2, 0, max_turns=5))
    assert [row.stats["chunk"] for row in rows] == [1, 2]
    assert rows[-1].finish_reason == "stop" and rows[-1].text.endswith("</answer>")
    assert rows[0].response_ids + rows[1].response_ids == stream[:end]  # cut after `answer>`: no EOS, no more words
