"""A step's experience: rollouts sampled, scored and filtered, then everything the update needs, computed
before any weight changes: old-policy and reference log-probs, the critic's values, and the advantages.

The advantage estimator is picked here, in one place (`compute_advantages`):
- none: the reward itself (REINFORCE without a baseline; what --loss_type no_baseline trains on).
- grpo: reward minus the group mean, over the group std when --use_std_normalization (DeepSeekMath eq. 3;
  Dr. GRPO without the std). One number per trace, on every token of every row of the trace.
- rloo: reward minus the mean of the other group members (Ahmadian et al. 2024). Per trace.
- reinforce_pp: REINFORCE++ (Hu 2025): per-token discounted return-to-go, whitened over the batch.
- reinforce_pp_baseline: the same after subtracting the group mean from each reward.
- gae: PPO's generalised advantage estimation with a learned critic (Schulman et al. 2016), whitened
  over the batch's tokens as PPO does; the returns are the critic's targets.
With --kl_in_reward the per-token KL to the reference (estimator --kl_estimator) times --kl_coef is
subtracted from the token rewards (the PPO / REINFORCE++ way); the per-trace estimators use the trace's
reward minus its summed penalty.

Two records cross from here to the loop: `Batch` (one step's scored rollouts) and `Experience` (what the
update needs: padded (rows, T) tensors over the kept traces' rows, in trace order, on the CPU), which
gives each train batch its loss weights once and each microbatch its slice on the policy's device.
"""

import itertools
import math
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from alignment import adaptive, distributed, lora, tir
from alignment.args import TOKEN_LEVEL_ESTIMATORS
from alignment.estimators import (compute_gae_advantages, compute_reinforce_pp_advantages, compute_rloo_advantages,
                                  explained_variance, kl_penalty, outcome_token_rewards, pool_statistics,
                                  subtract_group_mean, whiten)
from alignment.evaluate import PROMPT_SETTINGS, ROLLOUT_MODES, build_prompts, score_all
from alignment.grpo import compute_group_normalized_rewards, filter_pools, loss_weights, reward_metrics
from alignment.errors import UserError
from alignment.rollout import Rollout, traces
from alignment.sampling import SamplingParams, derive_seed
from alignment.tokens import rollout_log_probs, rollout_values, to_device


@dataclass
class Batch:
    """One step's scored rollouts on this rank."""

    traces: list[list[Rollout]]  # the kept traces (whole groups, in order), each a list of rows
    rewards: torch.Tensor  # (traces,) each kept trace's reward
    metrics: dict  # reward and sampling numbers over every sampled trace of every rank
    samples: list[dict]  # full rollouts (prompt, response, reward) for rollouts.jsonl
    seconds: dict  # {"sample": s, "score": s}
    policy_version: int = 0  # the policy version (RL steps taken) whose weights sampled it: async_rollouts.py
    pools: list[torch.Tensor] | None = None  # adaptive groups: each kept group's pool of rewards (adaptive.py)


@dataclass
class Microbatch:
    """An Experience's rows for one forward/backward, on the policy's device; T is their longest response."""

    prompts: list[list[int]]
    responses: list[list[int]]
    mask: torch.Tensor  # (B, T)
    advantages: torch.Tensor  # (B, 1) or (B, T)
    sampler_log_probs: torch.Tensor  # (B, T)
    old_log_probs: torch.Tensor | None  # (B, T) or None
    ref_log_probs: torch.Tensor | None
    old_values: torch.Tensor | None
    returns: torch.Tensor | None
    sequence_log_ratio: torch.Tensor | None = None  # (B,) the row's whole trace's log(old / sampler), summed
    sequence_tokens: torch.Tensor | None = None  # (B,) the sampled tokens of the row's whole trace


@dataclass
class Experience:
    """Everything one step's update needs, computed before any weight changes: padded (rows, T) float32 CPU
    tensors over the kept traces' rows, in trace order (0 past each row's end)."""

    rows: list[Rollout]
    row_trace: torch.Tensor  # (rows,) the index of each row's trace
    mask: torch.Tensor  # (rows, T) the loss mask: 1 on sampled tokens
    advantages: torch.Tensor  # (rows, 1) from a per-trace estimator, (rows, T) from a per-token one
    sampler_log_probs: torch.Tensor  # (rows, T) the sampler's own log-probs; NaN where it gave none
    old_log_probs: torch.Tensor | None = None  # None on-policy: the loop uses its own detached log-probs
    ref_log_probs: torch.Tensor | None = None  # None without a reference model
    old_values: torch.Tensor | None = None  # gae: the critic's values before the update
    returns: torch.Tensor | None = None  # gae: the critic's targets
    metrics: dict = field(default_factory=dict)
    # sequence-level rollout correction of traces that span several rows (Delethink): each row's whole
    # trace's summed log(old / sampler) and sampled tokens, so a trace's chunks share one ratio
    sequence_log_ratio: torch.Tensor | None = None  # (rows,)
    sequence_tokens: torch.Tensor | None = None  # (rows,)

    def loss_weights(self, rows: list[int], mode: str, max_response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's weight in the loss of the train batch made of `rows`: for the policy loss under
        `mode` (`grpo.loss_weights`) and for the token-mean value loss. (all rows,) each, 0 outside the
        train batch. The batch's counts are over every rank (one collective), taken once per train batch."""
        mask, traces = self.mask[rows], self.row_trace[rows]
        num_rows, num_tokens, num_traces = distributed.per_rank_counts(len(rows), mask.sum().item(),
                                                                        len(set(traces.tolist())))
        # Delethink's trace length counts the tokens the loss sums over (forced tokens excluded)
        trace_tokens = torch.zeros(len(self.rows) and int(self.row_trace.max()) + 1).index_add(
            0, self.row_trace, self.mask.sum(-1))
        policy, value = torch.zeros(len(self.rows), dtype=torch.float64), torch.zeros(len(self.rows), dtype=torch.float64)
        policy[rows] = loss_weights(mode, mask, num_rows=num_rows, num_tokens=num_tokens, num_traces=num_traces,
                                    max_response_length=max_response_length, trace_lengths=trace_tokens[traces])
        value[rows] = loss_weights("token-mean", mask, num_rows=num_rows, num_tokens=num_tokens)
        return policy, value

    def microbatch(self, rows: list[int], device) -> Microbatch:
        """The slice of `rows`, cut to their longest response, on `device` (to CUDA without a host sync:
        `tokens.to_device`)."""
        width = max(len(self.rows[i].response_ids) for i in rows)

        def take(tensor):  # (rows, T) cut to the width; (rows,) and (rows, 1) whole
            if tensor is None:
                return None
            return to_device(tensor[rows, :width] if tensor.dim() == 2 and tensor.shape[1] > 1 else tensor[rows], device)
        return Microbatch(prompts=[self.rows[i].prompt_ids for i in rows],
                          responses=[self.rows[i].response_ids for i in rows], mask=take(self.mask),
                          advantages=take(self.advantages),
                          sampler_log_probs=take(self.sampler_log_probs), old_log_probs=take(self.old_log_probs),
                          ref_log_probs=take(self.ref_log_probs), old_values=take(self.old_values),
                          returns=take(self.returns), sequence_log_ratio=take(self.sequence_log_ratio),
                          sequence_tokens=take(self.sequence_tokens))

    def token_microbatches(self, rows: list[int], budget: int) -> list[list[int]]:
        """`rows` in consecutive microbatches of at most `budget` prompt + response tokens (an upper bound on a
        forward's tokens: a group's prompt runs once), each group (consecutive rows with one prompt) whole where
        it fits, so that it packs into one row (tokens.rollout_log_probs); a larger group is cut between its
        rows, and a row above `budget` is a microbatch of its own."""
        parts, used = [], 0
        for _, group in itertools.groupby(rows, key=lambda i: self.rows[i].prompt_ids):
            sizes = {i: len(self.rows[i].prompt_ids) + len(self.rows[i].response_ids) for i in group}
            units = [list(sizes)] if sum(sizes.values()) <= budget else [[i] for i in sizes]
            for unit in units:
                size = sum(sizes[i] for i in unit)
                if not parts or used + size > budget:
                    parts.append([])
                    used = 0
                parts[-1] += unit
                used += size
        return parts


def questions_at(rows: list[dict], position: int, count: int, seed: int) -> list[dict]:
    """`count` questions from position `position` of an endless stream: a seeded permutation of the
    rows per epoch, read in order. A pure function of (position, seed); the loop keeps the position (how
    many questions it has drawn) in its checkpoint, so a resumed run draws what the uninterrupted run
    would have, also when dynamic sampling drew extra questions."""
    picked = []
    for index in range(position, position + count):
        epoch, offset = divmod(index, len(rows))
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        picked.append(rows[order[offset]])
    return picked


class SamplingStopped(Exception):
    """A stop (Ctrl-C, SIGTERM) was asked for while dynamic sampling refilled a step's batch: the step is
    given up before any update, so the policy is the one the last finished step left."""


def collect_rollouts(args, step: int, drawn: int, rows, sampler, tokenizer, score,
                     stopping=lambda: False) -> tuple[Batch, int]:
    """Sample, score and (with dynamic sampling) filter groups for one step; returns the batch and the
    new stream position. DAPO's refill (section 3.2): while fewer than rollout_batch_size / group_size
    informative groups were kept, draw that many more questions, up to --max_sampling_rounds rounds;
    the kept groups are cut to one batch. Rewards are logged over every sampled trace. Each further round
    prints a line; where `stopping()` turns true before a further round, the step is given up
    (`SamplingStopped`) rather than trained on a batch the uninterrupted run would not have had.

    Under torchrun each rank samples its own share of each round's questions (whole groups, so group
    normalisation stays local), with its own seeds; a round is the last when every rank has its share of
    kept groups (a collective decision), and the logged numbers are over all ranks.

    The Batch: traces (the kept ones, lists of rows), rewards (kept traces,), metrics (reward and sampling
    numbers; sampled_tokens: the tokens the policy generated, filtered traces included), samples (full rollouts
    for rollouts.jsonl, every sampled trace's, in order, with its reward, format_reward and answer_reward),
    seconds {"sample", "score"}, and with adaptive groups each kept group's pool of rewards.
    """
    questions = args.rollout_batch_size // args.group_size  # per round, over all ranks
    share = questions // distributed.world_size()
    wanted = share * args.group_size  # kept traces this rank needs
    adaptive_groups = args.group_size_max > args.group_size
    tally = _Tally()

    def generate(prompt_ids, params):  # the run's rollout mode
        return ROLLOUT_MODES[args.rollout_mode](sampler, tokenizer, prompt_ids, params, args)
    for sampling_round in range(1, args.max_sampling_rounds + 1):
        # 1. This rank's share of the round's questions, a group of traces each, every trace scored.
        start = time.perf_counter()
        asked = questions_at(rows, drawn + distributed.rank() * share, share, args.seed)
        drawn += questions
        prompt_texts, prompt_ids, params, round_traces = _sample_round(args, step, sampling_round, asked, tokenizer,
                                                                       generate)
        tally.seconds["sample"] += time.perf_counter() - start
        scores, raw = _score_round(args, tally, round_traces, asked, prompt_texts, score)
        # 2. Adaptive groups: more samples for the questions without spread (sampling and scoring).
        pools = None
        if adaptive_groups:
            round_traces, scores, pools, raw = _grow_groups(args, tally, step, sampling_round, generate, prompt_ids,
                                                            params, round_traces, scores,
                                                            lambda t, group: score(t[-1], asked[group]))
        # 3. Dynamic sampling: keep the groups the filters pass.
        _keep(tally, _kept_traces(args, scores, pools), round_traces, raw, pools, args.group_size)
        # 4. Another round only while some rank holds fewer kept traces than its share.
        if not _another_round(args, tally, wanted, step, sampling_round, questions, stopping):
            break
    # 5. One batch of kept traces, with the numbers of every trace sampled.
    kept, rewards = tally.kept[:wanted], tally.kept_rewards[:wanted]
    metrics = _batch_metrics(args, tally, len(kept), questions)
    return Batch(kept, torch.stack(rewards) if kept else torch.zeros(0), metrics, tally.samples, tally.seconds,
                 pools=tally.kept_pools[:wanted // args.group_size] if adaptive_groups else None), drawn


@dataclass
class _Tally:
    """What a step's sampling rounds gather: the kept traces, and the numbers of every trace sampled."""

    kept: list = field(default_factory=list)  # the kept traces (whole groups, in order), each a list of rows
    kept_rewards: list = field(default_factory=list)  # each kept trace's reward (0-d tensors)
    kept_pools: list = field(default_factory=list)  # adaptive groups: each kept group's pool of rewards
    metas: list = field(default_factory=list)  # each round's reward_metrics
    last_rows: list = field(default_factory=list)  # each sampled trace's last row (tir's metrics)
    lengths: list = field(default_factory=list)  # sampled tokens per trace
    contexts: list = field(default_factory=list)  # per trace, each row's prompt + response tokens
    samples: list = field(default_factory=list)  # full rollouts for rollouts.jsonl
    grown: list = field(default_factory=list)  # adaptive groups: each round's adaptive.grow_groups numbers
    seconds: dict = field(default_factory=lambda: {"sample": 0.0, "score": 0.0})
    failures: float = 0.0  # a --reward_fn's calls that scored 0


def _sample_round(args, step: int, sampling_round: int, asked: list[dict], tokenizer, generate):
    """The prompts of the round's questions and their traces: --group_size each, with this round's seeds (and
    this rank's, under torchrun)."""
    rank = distributed.rank()
    prompt_texts, prompt_ids = build_prompts(tokenizer, asked, args.prompt, args.chat_template, args.prompt_file)
    params = SamplingParams(n=args.group_size, temperature=args.sampling_temperature, top_p=args.sampling_top_p,
                            max_tokens=args.sampling_max_tokens, min_tokens=args.sampling_min_tokens,
                            stop=PROMPT_SETTINGS[args.prompt][1], logprobs=True,
                            seed=derive_seed(args.seed, step, sampling_round, *(("rank", rank) if rank else ())))
    return prompt_texts, prompt_ids, params, traces(generate(prompt_ids, params))


def _score_round(args, tally: _Tally, round_traces, asked: list[dict], prompt_texts: list[str], score):
    """Each trace's scores and reward (a trace's last row holds its whole text), tallied with its lengths and its
    full rollout: every sampled trace is logged, kept or not."""
    start = time.perf_counter()
    scores = score_all(score, [t[-1] for t in round_traces], [asked[t[-1].group_id] for t in round_traces])
    tally.failures += sum(s.get("reward_failed", 0.0) for s in scores)  # a --reward_fn's calls that scored 0
    raw = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)
    # the reward numbers are of the first group_size samples per question: comparable across runs
    tally.metas.append(reward_metrics(raw, scores, args.group_size))
    tally.last_rows += [t[-1] for t in round_traces]
    tally.lengths += [sum(sum(r.loss_mask) for r in t) for t in round_traces]  # sampled tokens per trace
    tally.contexts += [[len(r.prompt_ids) + len(r.response_ids) for r in t] for t in round_traces]  # per row
    tally.samples += [{"prompt": prompt_texts[t[-1].group_id], "response": t[-1].text, "reward": r,
                       "format_reward": s.get("format_reward"), "answer_reward": s.get("answer_reward"),
                       "ground_truth": asked[t[-1].group_id]["answer"], "rows": len(t), "stats": t[-1].stats}
                      for t, r, s in zip(round_traces, raw.tolist(), scores)]
    tally.seconds["score"] += time.perf_counter() - start
    return scores, raw


def _grow_groups(args, tally: _Tally, step: int, sampling_round: int, generate, prompt_ids, params, round_traces,
                 scores, score_trace):
    """Adaptive groups (alignment/adaptive.py): the round's groups grown where they lack spread, each cut back to
    --group_size traces; their scores, each group's whole pool of scores, and the cut groups' rewards."""
    start = time.perf_counter()
    round_traces, scores, pools, numbers = adaptive.grow_groups(args, step, sampling_round, generate, prompt_ids,
                                                                params, round_traces, scores, score_trace)
    raw = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)
    tally.grown.append(numbers)
    tally.seconds["sample"] += time.perf_counter() - start
    return round_traces, scores, pools, raw


def _filtering(args) -> bool:
    return args.filter_low is not None or args.filter_high is not None


def _kept_traces(args, scores: list[dict], pools) -> torch.Tensor:
    """(traces,) bool: the traces of the groups dynamic sampling keeps (every one without a filter). A filter reads
    what it filters: with adaptive groups, each whole grown pool."""
    n = args.group_size
    if not _filtering(args):
        return torch.ones(len(scores), dtype=torch.bool)
    groups = pools if pools is not None else [scores[g * n:(g + 1) * n] for g in range(len(scores) // n)]
    accuracy = [torch.tensor([float(s["answer_reward"]) for s in g]) for g in groups]
    if any(a.isnan().any() for a in accuracy):
        raise UserError("--filter_low / --filter_high read each answer's answer_reward, which --reward_fn "
                        "does not return: return it in the reward's dict, or drop the filter.")
    return filter_pools([torch.tensor([s["reward"] for s in g], dtype=torch.float32) for g in groups],
                        accuracy, args.filter_low, args.filter_high).repeat_interleave(n)


def _keep(tally: _Tally, keep: torch.Tensor, round_traces, raw: torch.Tensor, pools, n: int):
    """Add the kept traces to the tally, with their rewards and (adaptive groups) each kept group's pool."""
    for i in keep.nonzero().flatten().tolist():
        tally.kept.append(round_traces[i])
        tally.kept_rewards.append(raw[i])
        if pools is not None and i % n == 0:
            tally.kept_pools.append(torch.tensor([s["reward"] for s in pools[i // n]], dtype=torch.float32))


def _another_round(args, tally: _Tally, wanted: int, step: int, sampling_round: int, questions: int, stopping) -> bool:
    """Whether dynamic sampling draws a further round: while some rank holds fewer than its share of kept traces,
    up to --max_sampling_rounds (one collective a round, so every rank decides alike). A stop asked for on any
    rank gives the step up (`SamplingStopped`)."""
    if not _filtering(args) or sampling_round == args.max_sampling_rounds:
        return False
    short, asked_to_stop = distributed.global_sums([len(tally.kept) < wanted, stopping()])
    if not short:  # every rank holds its share
        return False
    if asked_to_stop:  # any rank's stop stops all
        raise SamplingStopped(f"stopped in step {step + 1}'s sampling round {sampling_round}")
    if distributed.rank() == 0:
        tqdm.write(f"[rl] step {step + 1}: {len(tally.kept)} of {wanted} traces kept after sampling round {sampling_round}"
                   f"; round {sampling_round + 1} of at most {args.max_sampling_rounds} (--max_sampling_rounds) "
                   f"samples {questions} more questions")
    return True


def _batch_metrics(args, tally: _Tally, kept_traces: int, questions: int) -> dict:
    """The step's reward and sampling numbers, over every trace sampled on every rank."""
    metas, lengths, contexts, grown = tally.metas, tally.lengths, tally.contexts, tally.grown
    metrics = {key: sum(m[key] for m in metas) / len(metas) for key in metas[0]}  # rounds are of equal size
    metrics = {"reward": metrics.pop("reward_mean"), "format_reward": metrics.get("format_reward_mean", 0.0),
               "answer_reward": metrics.get("answer_reward_mean", 0.0), "zero_std_groups": metrics["zero_std_fraction"],
               "response_tokens": sum(lengths) / len(lengths),
               # the cost of a trace beside its length (Delethink's claim): causal query-key pairs over its rows,
               # prompt included (attention's work to sample it and to train on it), and its longest row (the KV
               # cache it needs); means over every sampling round's traces (growth rounds aside), as response_tokens
               "attention_pairs": sum(n * (n + 1) // 2 for rows in contexts for n in rows) / len(contexts),
               "context_tokens": sum(max(rows) for rows in contexts) / len(contexts),
               "kept_traces": kept_traces, "sampling_rounds": len(metas), "questions_sampled": len(metas) * questions}
    if grown:  # adaptive groups: samples per question, share with spread, and every sampled token
        means = ("samples_per_question", "spread_fraction", "balanced_fraction")
        metrics.update({key: sum(g[key] for g in grown) / len(grown) for key in means})
        metrics["samples_per_question_max"] = max(g["samples_per_question_max"] for g in grown)
    metrics["sampled_tokens"] = sum(lengths) + sum(g["growth_tokens"] for g in grown)
    if args.reward_fn:
        metrics.pop("reward_failed_mean", None)
        metrics["reward_failures"] = tally.failures  # first-round scores of every sampling round (growth aside)
    if args.rollout_mode == "tir":
        metrics.update(tir.tir_metrics(tally.last_rows, [s["reward"] for s in tally.samples]))
    counts = ("kept_traces", "questions_sampled", "sampled_tokens", "reward_failures")  # summed over ranks; the rest are means of equal shares
    totals = distributed.global_sums(list(metrics.values()))
    return {k: v / (1 if k in counts else distributed.world_size()) for k, v in zip(metrics, totals)}


def build_experience(args, batch: Batch, policy, reference, critic, autocast) -> Experience:
    """The update's inputs for the kept traces: old-policy log-probs (only off-policy or with KL in the
    reward), reference log-probs (with a reference), the critic's values (gae), and the advantages."""
    rows = [row for trace in batch.traces for row in trace]  # none on a rank that kept no group
    row_trace = torch.tensor([i for i, trace in enumerate(batch.traces) for _ in trace], dtype=torch.long)
    width = max((len(r.response_ids) for r in rows), default=1)
    mask = _pad([r.loss_mask for r in rows], width, 0.0)
    on_policy = args.epochs_per_rollout_batch == 1 and args.train_batch_size == args.rollout_batch_size
    temperature = args.sampling_temperature

    def log_probs(model, sharded=False):  # the sharded policy: one collective forward per microbatch
        return no_grad_rows(lambda p, r: rollout_log_probs(model, p, r, temperature=temperature,
                                                           one_forward=sharded)["log_probs"],
                            model, rows, width, args.train_mini_batch_size, autocast, collective=sharded)
    # a trace's ratio over several rows needs the old log-probs of all its rows before the first microbatch
    per_trace = args.rollout_is != "none" and args.rollout_is_level != "token" and len(rows) > len(batch.traces)
    old = log_probs(policy, distributed.launched()) if not on_policy or args.kl_in_reward or per_trace else None
    with lora.frozen(reference):  # a LoRA policy as its own reference: its adapters off
        ref = log_probs(reference) if reference is not None else None
    token_kl = kl_penalty(old, ref, args.kl_estimator) if args.kl_in_reward else None
    values = (no_grad_rows(lambda p, r: rollout_values(critic, p, r), critic, rows, width,
                           args.train_mini_batch_size, autocast) if critic is not None else None)
    if rows:
        advantages, returns = compute_advantages(args, batch.rewards, mask, row_trace, token_kl, values, batch.pools)
    else:  # this rank kept no group; a whitening estimator still adds its (empty) share to the global statistics
        advantages, returns = torch.zeros(0, 1), None
        if args.advantage_estimator in TOKEN_LEVEL_ESTIMATORS:
            whiten(advantages, advantages, distributed.global_sum)
    metrics = {}
    if values is not None:
        metrics = {"value_mean": torch.where(mask.bool(), values, 0.0).sum().item() / mask.sum().clamp(min=1).item(),
                   "explained_variance": explained_variance(values, returns, mask)}
    if token_kl is not None:
        metrics["kl_in_reward"] = torch.where(mask.bool(), token_kl, 0.0).sum().item() / mask.sum().clamp(min=1).item()
    sampler = _pad([r.sampler_logprobs or [] for r in rows], width, math.nan)
    sequence = (None, None)
    if per_trace:  # sums over each trace's rows, given to each of its rows
        log_ratio = torch.where(mask.bool(), old - sampler, 0.0).sum(-1)
        traces = len(batch.traces)
        sequence = (torch.zeros(traces).index_add(0, row_trace, log_ratio)[row_trace],
                    torch.zeros(traces).index_add(0, row_trace, mask.sum(-1))[row_trace])
    return Experience(rows, row_trace, mask, advantages, sampler, old, ref, values, returns, metrics, *sequence)


def _pad(lists: list[list[float]], width: int, value: float) -> torch.Tensor:
    """(len(lists), width) float32, each list from the left, `value` after its end."""
    out = torch.full((len(lists), width), value)
    for i, values in enumerate(lists):
        out[i, :len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def compute_advantages(args, rewards: torch.Tensor, mask: torch.Tensor, row_trace: torch.Tensor,
                       token_kl: torch.Tensor | None, values: torch.Tensor | None,
                       pools: list[torch.Tensor] | None = None):
    """(advantages, returns) for --advantage_estimator: the one place that branches on it, and the only place
    advantages are computed. Advantages are (rows, 1) for the per-trace estimators and (rows, T) for the
    per-token ones; returns (rows, T) for gae, else None. `rewards` (traces,) in consecutive groups;
    `row_trace` maps rows to traces. `pools`: with adaptive groups, each group's pool of rewards, which the
    group baselines are taken from (Reinforce-Ada; alignment/adaptive.py)."""
    # torch.where, not * mask: a forced token's KL can be NaN (both log-probs -inf), and NaN * 0 is NaN
    penalty = (torch.where(mask.bool(), -args.kl_coef * token_kl, 0.0) if token_kl is not None
               else torch.zeros_like(mask))  # (rows, T)
    estimator, n = args.advantage_estimator, args.group_size
    pooled = pool_statistics(rewards, pools, n) if pools is not None else None  # (no KL in the reward: checked)
    returns = None
    if estimator in ("none", "grpo", "rloo"):
        trace_rewards = rewards.float() + torch.zeros_like(rewards, dtype=torch.float32).index_add(
            0, row_trace, penalty.sum(-1))  # the trace's reward minus its summed KL penalty
        if estimator == "none":
            per_trace = trace_rewards
        elif estimator == "grpo" and pooled:  # DeepSeekMath eq. 3 with the pool's mean and std
            centered = trace_rewards - pooled["mean"]
            if args.use_std_normalization:
                centered = centered / (pooled["std"] + args.advantage_eps)
            per_trace = torch.where(pooled["spread"] > 0, centered, 0.0)
        elif estimator == "grpo":
            per_trace, _, _ = compute_group_normalized_rewards(
                lambda reward, _: {"reward": reward}, trace_rewards.tolist(), [None] * len(trace_rewards), n,
                args.advantage_eps, args.use_std_normalization)
        else:
            per_trace = (trace_rewards - pooled["leave_one_out"] if pooled
                         else compute_rloo_advantages(trace_rewards, n))
        advantages = per_trace[row_trace][:, None]  # (rows, 1): the same on every token
    else:  # token level: one row per trace (checked at parse time)
        base = rewards
        if estimator == "reinforce_pp_baseline":
            base = rewards.float() - pooled["mean"] if pooled else subtract_group_mean(rewards, n)
        token_rewards = outcome_token_rewards(base[row_trace], mask) + penalty
        if estimator == "gae":
            advantages, returns = compute_gae_advantages(token_rewards, values, mask, args.gamma, args.lam)
            advantages = whiten(advantages, mask, distributed.global_sum)
        else:
            advantages = compute_reinforce_pp_advantages(token_rewards, mask, args.gamma, distributed.global_sum)
    return advantages, returns


@torch.no_grad()
def no_grad_rows(fn, model, rows, width: int, microbatch: int, autocast, collective: bool = False) -> torch.Tensor:
    """`fn(prompts, responses)` -> (b, t) over all rows in microbatches, without gradient, in eval mode:
    a (rows, width) float32 CPU tensor (0 past each row's end). `collective`: `model` is sharded, so
    every rank makes as many calls as the busiest one (the extra ones on a one-token dummy row)."""
    was_training = model.training
    model.eval()
    out = torch.zeros(len(rows), width)
    for call, part in enumerate(distributed.microbatches(rows, microbatch, collective)):
        with autocast:
            if not part:
                fn([[0]], [[0]])
                continue
            values = fn([r.prompt_ids for r in part], [r.response_ids for r in part])
        out[call * microbatch:call * microbatch + len(part), :values.shape[1]] = values.float().cpu()
    model.train(was_training)
    return out
