"""Adaptive group size (--group_size_max, alignment/adaptive.py): growth stops when balanced (the authors' rule)
or at M, the trained group keeps both sides, dynamic sampling reads the whole pool, the baselines come from the whole pool, and a run replays exactly."""

import json
import zlib

import pytest
import torch

from alignment import adaptive, experience, train_rl
from alignment.args import RLArgs, parse
from alignment.estimators import compute_rloo_advantages, pool_statistics, subtract_group_mean
from alignment.grpo import compute_group_normalized_rewards, filter_groups, filter_pools
from alignment.rollout import Rollout
from alignment.sampling import SamplingParams
from tests.test_train_rl import tiny_args


def test_pool_statistics_of_fixed_groups_are_the_fixed_group_baselines():
    torch.manual_seed(0)
    for n in (1, 2, 4):
        rewards = torch.randint(0, 2, (6 * n,)).float()
        pools = list(rewards.view(-1, n))
        stats = pool_statistics(rewards, pools, n)
        for normalize in (False, True):
            args = RLArgs(group_size=n, rollout_batch_size=6 * n, train_batch_size=6 * n, use_std_normalization=normalize)
            fixed, _, _ = compute_group_normalized_rewards(lambda r, _: {"reward": r}, rewards.tolist(), [None] * len(rewards),
                                                           n, args.advantage_eps, normalize)
            mask, row_trace = torch.ones(len(rewards), 3), torch.arange(len(rewards))
            pooled, _ = experience.compute_advantages(args, rewards, mask, row_trace, None, None, pools)
            torch.testing.assert_close(pooled[:, 0], fixed)
        torch.testing.assert_close(rewards - stats["leave_one_out"], compute_rloo_advantages(rewards, n))
        torch.testing.assert_close(rewards - stats["mean"], subtract_group_mean(rewards, n))


def test_the_baselines_of_a_grown_group_are_those_of_its_whole_pool():
    # one question: 8 sampled, 1 right; it trains on 4 of them (the right one among them)
    rewards, pool = torch.tensor([1.0, 0.0, 0.0, 0.0]), [torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])]
    mask, row_trace = torch.ones(4, 2), torch.arange(4)
    for estimator, expected in (("grpo", rewards - 1 / 8), ("rloo", rewards - (1 - rewards) / 7)):
        args = RLArgs(group_size=4, rollout_batch_size=4, train_batch_size=4, advantage_estimator=estimator)
        advantages, _ = experience.compute_advantages(args, rewards, mask, row_trace, None, None, pool)
        torch.testing.assert_close(advantages[:, 0], expected)
    args = RLArgs(group_size=4, rollout_batch_size=4, train_batch_size=4, use_std_normalization=True)
    advantages, _ = experience.compute_advantages(args, rewards, mask, row_trace, None, None, pool)
    torch.testing.assert_close(advantages[:, 0], (rewards - 1 / 8) / (pool[0].std() + args.advantage_eps))


class ScriptedMode:
    """A rollout mode whose answers are numbered per question; the script says which numbers are right."""

    def __init__(self, right: dict):
        self.right, self.count, self.calls = right, {}, []

    def __call__(self, prompt_ids, params):
        self.calls.append(([p[0] for p in prompt_ids], params.n, params.seed))
        rows = []
        for group, prompt in enumerate(prompt_ids):
            for k in range(params.n):
                number = self.count.get(prompt[0], 0)
                self.count[prompt[0]] = number + 1
                rows.append(Rollout(list(prompt), [7] * 3, [1] * 3, trace_id=group * params.n + k, group_id=group,
                                    text=f"{prompt[0]}:{number}", finish_reason="stop"))
        return rows

    def score(self, trace, group):
        question, number = map(int, trace[-1].text.split(":"))
        right = float(number in self.right.get(question, ()))
        return {"reward": right, "answer_reward": right}


def test_groups_grow_until_balanced_as_the_authors_code_does_or_hold_m_samples():
    """Reinforce-Ada's balanced rule (RLHFlow/Reinforce-Ada-Tinker, strategy "balanced"): a pool grows until
    it holds n//2 right and n - n//2 wrong answers, samples after that point are not added, and the trained
    group is n//2 right and n - n//2 wrong (else the authors' fallback)."""
    n, m = 4, 10
    args = RLArgs(group_size=n, group_size_max=m, rollout_batch_size=16, train_batch_size=16)
    # q0 is balanced at once (2 right, 2 wrong); q1 has 1 right, and gets its second at sample 5 (6 and 7 are
    # dropped); q2 is never right: 4, then 8, then 10 samples (the last round only 2); q3 is all right at
    # first, and its second wrong answer is sample 6 (7 dropped). Old rule: q1 and q3 had spread at once.
    mode = ScriptedMode({0: {0, 1}, 1: {1, 5, 6}, 3: {0, 1, 2, 3, 4}})
    prompts = [[0], [1], [2], [3]]
    params = SamplingParams(n=n, seed=1)
    first = [[row] for row in mode(prompts, params)]
    chosen, scores, pools, numbers = adaptive.grow_groups(args, 3, 1, mode, prompts, params, first,
                                                          [mode.score(t, 0) for t in first], mode.score)
    assert [len(p) for p in pools] == [4, 6, 10, 7]
    assert [(asked, k) for asked, k, _ in mode.calls[1:]] == [([1, 2, 3], 4), ([2], 2)]  # only unbalanced groups
    assert len({seed for _, _, seed in mode.calls}) == 3  # each round its own seed
    assert len(chosen) == 4 * n and all(t[-1].group_id == i // n for i, t in enumerate(chosen))
    texts = [t[-1].text for t in chosen]
    assert texts[:4] == ["0:0", "0:1", "0:2", "0:3"]
    assert texts[4:8] == ["1:0", "1:1", "1:2", "1:5"]  # 2 right (1, 5) and 2 wrong, not 1 and 3
    assert texts[8:12] == ["2:0", "2:1", "2:2", "2:3"]  # never right: the first n
    assert texts[12:] == ["3:0", "3:1", "3:5", "3:6"]
    assert [s["reward"] for s in scores[4:8]] == [0.0, 1.0, 0.0, 1.0]
    assert [s["reward"] for s in pools[1]] == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert numbers["samples_per_question"] == pytest.approx(27 / 4) and numbers["samples_per_question_max"] == 10
    assert numbers["spread_fraction"] == pytest.approx(3 / 4) and numbers["balanced_fraction"] == pytest.approx(3 / 4)
    assert numbers["growth_tokens"] == (3 * 4 + 2) * 3  # every sampled token, the dropped ones too
    pool = [(f"t{i}", {"answer_reward": r}) for i, r in enumerate([1, 1, 1, 0, 0, 1, 0, 0])]
    assert [t for t, _ in adaptive._balanced(pool, 4)] == ["t0", "t1", "t3", "t4"]
    pool = [(f"t{i}", {"answer_reward": r}) for i, r in enumerate([1, 1, 1, 0, 1])]  # capped, one wrong
    assert [t for t, _ in adaptive._balanced(pool, 4)] == ["t0", "t1", "t2", "t3"]


def test_dynamic_sampling_reads_the_accuracy_of_the_whole_pool():
    """A pool of 12 with 1 right (accuracy 1/12) is dropped by --filter_low 0.2, though the 4 answers picked
    from it (1 right) have accuracy 0.25; a fixed group is read as before."""
    pool_rewards = [torch.tensor([0.0] * 11 + [1.0]), torch.tensor([1.0, 0.0, 0.0, 1.0])]
    keep = filter_pools(pool_rewards, pool_rewards, low=0.2)
    assert keep.tolist() == [False, True]
    picked = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert filter_groups(picked, 4, low=0.2).tolist() == [True] * 4  # the picked subset alone would pass
    assert filter_pools([torch.tensor([1.0, 1.0])], [torch.tensor([1.0, 1.0])]).tolist() == [False]  # no spread


def test_the_loop_filters_adaptive_groups_on_their_pools(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (rare_reward, ()))
    seen = []
    original = experience.filter_pools
    monkeypatch.setattr(experience, "filter_pools", lambda r, a, low, high: seen.append([len(x) for x in r])
                        or original(r, a, low, high))
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", group_size_max=12, sampling_max_tokens=4,
                            filter_low=0.0, max_sampling_rounds=1, n_steps=3))  # (a step may need no growth)
    assert seen and any(size > 4 for sizes in seen for size in sizes)  # grown pools, not the picked 4


def rare_reward(text, ground_truth, *rest):
    """Right about one time in five, by a hash of the text: most groups of 4 have no spread."""
    right = float(zlib.crc32(text.encode()) % 5 == 0)
    return {"reward": right, "format_reward": 1.0, "answer_reward": right}


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_an_adaptive_run_trains_logs_its_samples_and_replays_exactly(tiny_model_dir, tmp_path, monkeypatch, estimator):
    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (rare_reward, ()))
    runs = []
    for name in ("a", "b"):
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / name, group_size_max=12, advantage_estimator=estimator,
                                sampling_max_tokens=4))
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs.append([{k: v for k, v in json.loads(line).items() if not k.startswith("seconds")} for line in lines])
    assert runs[0] == runs[1]  # the same samples, rewards and updates
    steps = [m for m in runs[0] if "loss" in m]
    assert len(steps) == 2 and all(4 <= m["samples_per_question"] <= 12 for m in steps)
    assert any(m["samples_per_question"] > 4 for m in steps) and all(m["kept_traces"] == 8 for m in steps)
    assert all(0 <= m["balanced_fraction"] <= m["spread_fraction"] <= 1 for m in steps)  # as docs/algorithms.md lists
    # every sampled token is counted: the first round's (8 answers) and the growth rounds'
    assert all(m["sampled_tokens"] > 8 * m["response_tokens"] for m in steps if m["samples_per_question"] > 4)


def test_adaptive_groups_are_refused_where_they_cannot_work(capsys):
    for argv, message in [(["--group_size_max", "4"], "must be above --group_size 4"),
                          (["--group_size_max", "8", "--advantage_estimator", "gae"], "use grpo, rloo or"),
                          (["--group_size_max", "8", "--loss_type", "no_baseline"], "use grpo, rloo or"),
                          (["--group_size_max", "8", "--kl_coef", "0.1", "--kl_in_reward"], "drop --kl_in_reward"),
                          (["--group_size_max", "1000000"], "above its bound 128 (32 x --group_size 4")]:
        with pytest.raises(SystemExit):
            parse(RLArgs, argv)
        assert message in capsys.readouterr().err
    with pytest.raises(train_rl.UserError, match="not supported under torchrun"):
        train_rl._refuse_under_torchrun(parse(RLArgs, ["--group_size_max", "8"]), "cpu")


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "none"])
def test_a_nan_kl_at_a_forced_token_stays_out_of_the_kl_in_reward_advantages(estimator):
    """Old and reference both -inf at a forced token make its k3 KL NaN; the penalty is masked with
    torch.where, so it does not reach the trace's reward (NaN * 0 would)."""
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    token_kl = torch.tensor([[0.01, float("nan"), 0.02], [0.03, 0.04, 0.05]])
    args = RLArgs(group_size=2, rollout_batch_size=2, train_batch_size=2, train_mini_batch_size=2, kl_coef=0.1,
                  kl_in_reward=True, advantage_estimator=estimator, kl_estimator="k3",
                  loss_type="no_baseline" if estimator == "none" else "grpo_clip")
    advantages, _ = experience.compute_advantages(args, torch.tensor([1.0, 0.0]), mask, torch.arange(2), token_kl,
                                                  None, None)
    assert torch.isfinite(advantages).all()
    penalties = torch.tensor([-0.1 * 0.03, -0.1 * 0.12])
    rewards = torch.tensor([1.0, 0.0]) + penalties
    expected = {"none": rewards, "grpo": rewards - rewards.mean(), "rloo": rewards - rewards.flip(0)}[estimator]
    torch.testing.assert_close(advantages[:, 0], expected)
