"""Microbatches sized per device (issue 61): by rows (--train_mini_batch_size) or by tokens (--microbatch_tokens,
CUDA's default), the same gradient either way; the packing cap per device; host tensors copied to CUDA from pinned
memory without blocking."""

import pytest
import torch

from alignment import distributed, experience, tokens, train_rl
from alignment.args import RLArgs, parse
from alignment.rollout import Rollout
from tests.test_train_rl import read_jsonl, tiny_args


def rows_of(groups: list[tuple[int, list[int]]]) -> list[Rollout]:
    """(prompt length, response lengths) per group -> the rows, group by group, each group with its own prompt."""
    rows = []
    for g, (prompt, responses) in enumerate(groups):
        rows += [Rollout([g + 1] * prompt, [5] * n, [1] * n, trace_id=len(rows), group_id=g, text="",
                         finish_reason="stop") for n in responses]
    return rows


def an_experience(rows: list[Rollout]) -> experience.Experience:
    width = max(len(r.response_ids) for r in rows)
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        mask[i, :len(row.response_ids)] = 1
    return experience.Experience(rows, torch.arange(len(rows)), mask, torch.randn(len(rows), 1),
                                 torch.full((len(rows), width), -0.5), old_log_probs=-mask)


def test_token_microbatches_keep_groups_whole_where_they_fit():
    # rows' prompt + response tokens: group 0 5 + 5 = 10, group 1 5 + 5 + 5 = 15, group 2 19
    exp = an_experience(rows_of([(2, [3, 3]), (1, [4, 4, 4]), (9, [10])]))
    everything = list(range(6))
    assert exp.token_microbatches(everything, 1000) == [everything]
    assert exp.token_microbatches(everything, 25) == [[0, 1, 2, 3, 4], [5]]  # 10 + 15 fill one; 19 starts the next
    # group 1 fits 16 but not beside group 0: it starts a microbatch rather than being cut (a cut group cannot pack)
    assert exp.token_microbatches(everything, 16) == [[0, 1], [2, 3, 4], [5]]
    # group 1 is above 12: cut between its rows; the row of 19 above the budget is a microbatch of its own
    assert exp.token_microbatches(everything, 12) == [[0, 1], [2, 3], [4], [5]]
    assert exp.token_microbatches([1, 2, 3], 1000) == [[1, 2, 3]]  # a train batch's rows only
    assert exp.token_microbatches([], 1000) == []  # a rank with nothing to train


def test_a_sharded_rank_runs_as_many_microbatches_as_the_busiest(monkeypatch):
    monkeypatch.setattr(distributed, "even_out", lambda count: 3)  # another rank has 3 microbatches
    assert distributed.evened([[0, 1], [2]], collective=True) == [[0, 1], [2], []]  # a dummy one
    assert distributed.evened([], collective=True) == [[], [], []]
    assert distributed.evened([[0, 1], [2]], collective=False) == [[0, 1], [2]]
    assert distributed.microbatches([0, 1, 2], 2, collective=False) == [[0, 1], [2]]
    assert distributed.microbatches([0, 1, 2], 2, collective=True) == [[0, 1], [2], []]


def test_sizes_are_chosen_per_device():
    args = RLArgs()
    assert train_rl.microbatch_tokens(args, "cpu") == 0  # rows of --train_mini_batch_size, as measured on CPU
    assert train_rl.microbatch_tokens(args, torch.device("cuda", 0)) == train_rl.CUDA_MICROBATCH_TOKENS > 0
    assert train_rl.microbatch_tokens(RLArgs(microbatch_tokens=0), "cuda:0") == 0  # asked for rows
    assert train_rl.microbatch_tokens(RLArgs(microbatch_tokens=700), "cpu") == 700
    assert tokens.pack_tokens("cpu") == tokens.PACK_TOKENS == 512
    assert tokens.pack_tokens("cuda:0") == tokens.CUDA_PACK_TOKENS > tokens.PACK_TOKENS


def test_microbatch_tokens_flag_checks(capsys):
    with pytest.raises(SystemExit):
        parse(RLArgs, ["--microbatch_tokens", "4096", "--train_mini_batch_size", "4"])
    assert "--train_mini_batch_size 4 has no effect with --microbatch_tokens 4096" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(RLArgs, ["--microbatch_tokens", "-1"])
    assert "--microbatch_tokens must be 0 or more" in capsys.readouterr().err
    # token microbatches need no row count that divides the train batch (the default 8 does not divide 12)
    assert parse(RLArgs, ["--microbatch_tokens", "4096", "--train_batch_size", "12", "--rollout_batch_size", "12",
                          "--group_size", "4"]).microbatch_tokens == 4096
    assert parse(RLArgs, ["--microbatch_tokens", "0", "--train_mini_batch_size", "4"]).train_mini_batch_size == 4


class FakeHostTensor:
    """Records what is done to it: a stand-in for a host tensor copied to a GPU this machine does not have."""

    def __init__(self):
        self.calls = []

    def pin_memory(self):
        self.calls.append("pin_memory")
        return self

    def to(self, device, non_blocking=False):
        self.calls.append(("to", str(device), non_blocking))
        return self


def test_host_tensors_go_to_cuda_pinned_and_without_blocking_and_stay_as_they_were_on_cpu():
    fake = FakeHostTensor()
    tokens.to_device(fake, "cuda:0")
    assert fake.calls == ["pin_memory", ("to", "cuda:0", True)]
    fake = FakeHostTensor()
    tokens.to_device(fake, torch.device("cpu"))
    assert fake.calls == [("to", "cpu", False)]  # no pinning, a plain copy
    host = torch.arange(4.0)
    assert tokens.to_device(host, "cpu") is host and not host.is_pinned()  # on the CPU: the tensor itself


def test_every_tensor_of_a_microbatch_is_copied_through_to_device(monkeypatch):
    copied = []
    monkeypatch.setattr(experience, "to_device", lambda tensor, device: copied.append((tuple(tensor.shape), device))
                        or tensor)
    exp = an_experience(rows_of([(2, [3, 1]), (1, [2])]))
    exp.sequence_log_ratio, exp.sequence_tokens = torch.zeros(3), torch.ones(3)
    mb = exp.microbatch([0, 1], "cuda:0")  # never reaches a GPU: the stand-in returns the slices
    # mask, advantages, sampler and old log-probs (rows, T); the two per-row sums; none left on the host un-copied
    assert copied == [((2, 3), "cuda:0"), ((2, 1), "cuda:0"), ((2, 3), "cuda:0"), ((2, 3), "cuda:0"),
                      ((2,), "cuda:0"), ((2,), "cuda:0")]
    assert mb.ref_log_probs is None and mb.returns is None


@pytest.mark.parametrize("budget,sizes,packed", [
    (100_000, [8], 2),  # the train batch in one microbatch, both groups packed into one forward
    (1, [1] * 8, 0),  # every row above the budget: one row each, the groups' prompts shared across microbatches
])
def test_token_microbatches_take_the_same_gradient_as_row_microbatches(tiny_model_dir, tmp_path, parity, monkeypatch,
                                                                       budget, sizes, packed):
    """One optimizer step with 4 microbatches of 2 rows (each group of 4 split over two: its prompt shared, not
    packed) and with microbatches of `budget` tokens: the loss weights are the train batch's, so the gradient is the
    same up to float rounding, whatever the split and whether groups are packed."""
    real_step, real_microbatch = train_rl._clip_and_step, experience.Experience.microbatch
    real_pack = tokens._packed_log_probs
    gradients, parts, packs = [], [], []

    def recording_step(model, optimizer, max_grad_norm, train, name, losses=()):
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return real_step(model, optimizer, max_grad_norm, train, name, losses)
    monkeypatch.setattr(train_rl, "_clip_and_step", recording_step)
    monkeypatch.setattr(experience.Experience, "microbatch", lambda exp, rows, device: parts[-1].append(len(rows))
                        or real_microbatch(exp, rows, device))
    monkeypatch.setattr(tokens, "_packed_log_probs", lambda model, groups, *rest: packs.append(len(groups))
                        or real_pack(model, groups, *rest))
    runs = {"rows": dict(train_mini_batch_size=2), "tokens": dict(microbatch_tokens=budget)}
    for name, flags in runs.items():
        parts.append([])
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / name, n_steps=1, **flags))
    assert parts == [[2, 2, 2, 2], sizes]
    assert sum(packs) == packed  # groups packed (all in the token run's one microbatch, none in the row run's)
    rows_grad, tokens_grad = gradients
    assert rows_grad.keys() == tokens_grad.keys() and rows_grad
    for name, grad in rows_grad.items():
        torch.testing.assert_close(tokens_grad[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    (by_rows,), (by_tokens,) = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in runs)
    assert by_tokens["loss"] == pytest.approx(by_rows["loss"], rel=1e-5, abs=1e-7)
    assert by_tokens["grad_norm"] == pytest.approx(by_rows["grad_norm"], rel=1e-5)


def test_the_cuda_default_sizes_by_tokens_and_says_it_leaves_a_given_row_count_unused(tiny_model_dir, tmp_path, parity,
                                                                                      monkeypatch, capsys):
    """CUDA's default emulated on this CPU: a run without --microbatch_tokens trains in token microbatches, and a
    --train_mini_batch_size the user gave is named as unused (not dropped silently)."""
    monkeypatch.setattr(train_rl, "microbatch_tokens", lambda args, device: 100_000 if args.microbatch_tokens is None
                        else args.microbatch_tokens)
    real_microbatch, parts = experience.Experience.microbatch, []
    monkeypatch.setattr(experience.Experience, "microbatch", lambda exp, rows, device: parts.append(len(rows))
                        or real_microbatch(exp, rows, device))
    args = tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1)  # --train_mini_batch_size 4
    args.given_flags = {"train_mini_batch_size"}
    train_rl.main(args)
    out = capsys.readouterr().out
    assert parts == [8]  # not two microbatches of 4 rows
    assert "microbatches of up to 100000 tokens" in out and "--train_mini_batch_size is not used" in out
