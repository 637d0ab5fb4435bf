import contextlib
import hashlib
import json
import math

import pytest
import torch

from alignment import data, models, run, sft
from alignment.args import SFTArgs, parse
from alignment.drgrpo_grader import r1_zero_reward_fn
from alignment.errors import UserError


def test_gsm8k_example_drops_annotations_and_has_the_exact_format(data_dir):
    row = data.load_gsm8k("train", str(data_dir))[0]
    assert "<<48/2=24>>" in row["solution"]  # the first GSM8K train row (Natalia's clips)
    example = sft.gsm8k_sft_example(row, data.load_prompt("r1_zero"))
    assert example["prompt"].endswith(f"User: {row['question']}\nAssistant: <think>")
    assert example["response"] == (" Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether "
                                   "in April and May. </think> <answer> 72 </answer>")
    assert r1_zero_reward_fn(example["response"], row["answer"]) == {"format_reward": 1.0, "answer_reward": 1.0,
                                                                     "reward": 1.0}


def test_annotation_removal_keeps_everything_else():
    row = {"question": "q", "answer": "1000",
           "solution": "He pays 2*500 = <<2*500=1000>>1000 dollars.\nSo <<1000-0=1000>>1000 in all.\n#### 1,000"}
    response = sft.gsm8k_sft_example(row, "{question}")["response"]
    assert response == " He pays 2*500 = 1000 dollars.\nSo 1000 in all. </think> <answer> 1000 </answer>"


def test_eos_appended_to_the_response_is_one_special_token(tokenizer):
    ids = tokenizer(" 72 </answer>" + tokenizer.eos_token, add_special_tokens=False).input_ids
    assert ids[-1] == tokenizer.eos_token_id and ids.count(tokenizer.eos_token_id) == 1


def test_train_file_of_prompt_response_pairs(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) + "\n" for i in range(5)))
    examples = sft.load_sft_examples(SFTArgs(train_file=str(path), max_examples=3))
    assert examples == [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(3)]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sft.load_sft_examples(SFTArgs(train_file=str(tmp_path / "nope.jsonl")))
    # a row with neither prompt nor response has no token to train on (it crashed the first step's forward)
    path.write_text('{"prompt": "p", "response": ""}\n\n{"prompt": "", "response": ""}\n')
    with pytest.raises(UserError, match=r"traces.jsonl:3: prompt and response are empty, nothing to train on"):
        sft.load_sft_examples(SFTArgs(train_file=str(path)))


def test_gsm8k_traces_are_kept_short_by_default_and_a_train_file_is_not_cut(tokenizer, data_dir, tmp_path):
    short = sft.load_sft_examples(SFTArgs(data_dir=str(data_dir), max_examples=0), tokenizer)
    every = sft.load_sft_examples(SFTArgs(data_dir=str(data_dir), max_examples=0, max_response_tokens=0), tokenizer)
    lengths = [len(tokenizer(e["response"], add_special_tokens=False).input_ids) for e in short]
    assert max(lengths) <= 100 and 0.4 * len(every) < len(short) < 0.8 * len(every)
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "p", "response": "word " * 300}) + "\n")
    assert len(sft.load_sft_examples(SFTArgs(train_file=str(path)), tokenizer)) == 1
    assert sft.load_sft_examples(SFTArgs(train_file=str(path), max_response_tokens=50), tokenizer) == []


def test_batches_cover_each_epoch_once_in_a_new_order():
    epoch0 = [sft.batch_indices(s, 10, 3, seed=0) for s in range(3)]
    epoch1 = [sft.batch_indices(s, 10, 3, seed=0) for s in range(3, 6)]
    assert len({i for b in epoch0 for i in b}) == 9 and len({i for b in epoch1 for i in b}) == 9
    assert epoch0 != epoch1 and epoch0 == [sft.batch_indices(s, 10, 3, seed=0) for s in range(3)]


def test_lr_schedule_warms_up_then_decays():
    factors = [sft.lr_factor(s, 2, 10) for s in range(10)]
    assert factors[:3] == [0.5, 1.0, 1.0] and all(a > b for a, b in zip(factors[2:], factors[3:])) and factors[-1] > 0


def test_bad_flag_combination_says_what_to_change():
    with pytest.raises(SystemExit):
        parse(SFTArgs, ["--batch_size", "6", "--microbatch_size", "4"])
    with pytest.raises(ValueError, match="multiple of --microbatch_size"):
        SFTArgs(batch_size=6, microbatch_size=4).check()


def tiny_args(model_dir, out_dir, **overrides) -> SFTArgs:
    base = dict(model=model_dir, max_examples=8, batch_size=4, microbatch_size=2, eval_limit=2,
                eval_max_tokens=4, output_dir=str(out_dir), lr=1e-3, precision="fp32")
    return SFTArgs(**{**base, **overrides})


def test_two_step_run_trains_saves_and_reloads(tiny_model_dir, tokenizer, data_dir, tmp_path):
    before = models.load_model(tiny_model_dir).state_dict()
    result = sft.main(tiny_args(tiny_model_dir, tmp_path / "sft"))
    assert result["steps"] == 2 and math.isfinite(result["last_loss"])
    after = models.load_model(str(tmp_path / "sft")).state_dict()  # the run folder alignment.evaluate --model takes
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert models.load_tokenizer(str(tmp_path / "sft")).eos_token == tokenizer.eos_token
    assert json.loads((tmp_path / "sft" / "checkpoint" / "run_config.json").read_text())["max_examples"] == 8
    assert json.loads((tmp_path / "sft" / "config.json").read_text())["start_model"] == tiny_model_dir
    lines = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2]
    assert [r["step"] for r in lines if "eval" in r] == [0, 2]
    assert all(math.isfinite(r["loss"]) for r in lines if "loss" in r)
    samples = [json.loads(line) for line in (tmp_path / "sft" / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in samples] == [0, 0, 2, 2] and all("response" in r for r in samples)
    assert not (tmp_path / "sft" / "checkpoint.tmp").exists()


def test_no_eval_before_train_evaluates_only_at_the_end(tiny_model_dir, data_dir, tmp_path):
    result = sft.main(tiny_args(tiny_model_dir, tmp_path / "sft", eval_before_train=False))
    lines = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "eval" in r] == [2] and result["first_eval"] is None


class Interrupted(Exception):
    pass


def test_resume_continues_at_the_right_step(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    # Uninterrupted: 2 epochs of 2 steps.
    sft.main(tiny_args(tiny_model_dir, tmp_path / "full", epochs=2))
    # Interrupted right after the checkpoint at step 2, then resumed to step 4.
    real_save = models.save_checkpoint

    def save_then_crash(*args, **kwargs):
        real_save(*args, **kwargs)
        raise Interrupted

    monkeypatch.setattr(models, "save_checkpoint", save_then_crash)
    with pytest.raises(Interrupted):
        sft.main(tiny_args(tiny_model_dir, tmp_path / "resumed", epochs=2, save_every=2))
    assert state_of(tmp_path / "resumed")["step"] == 2
    monkeypatch.setattr(models, "save_checkpoint", real_save)
    result = sft.main(tiny_args(tiny_model_dir, tmp_path / "resumed", epochs=2, save_every=2,
                                resume=str(tmp_path / "resumed")))
    assert result["start_step"] == 2 and result["steps"] == 4

    full_state, resumed_state = state_of(tmp_path / "full"), state_of(tmp_path / "resumed")
    assert resumed_state["step"] == full_state["step"] == 4
    assert resumed_state["examples_seen"] == full_state["examples_seen"] == 16
    full, resumed = (models.load_model(str(tmp_path / name)).state_dict() for name in ("full", "resumed"))
    for key in full:
        torch.testing.assert_close(resumed[key], full[key], rtol=1e-5, atol=1e-6)
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == [1, 2, 3, 4]
    with pytest.raises(FileNotFoundError, match="no such run folder"):
        sft.main(tiny_args(tiny_model_dir, tmp_path / "empty", resume=str(tmp_path / "empty")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="the folder holds no run of alignment.sft"):
        sft.main(tiny_args(tiny_model_dir, tmp_path / "empty", resume=str(tmp_path / "empty")))


def test_a_finished_run_resumed_with_more_epochs_follows_the_longer_schedule(tiny_model_dir, data_dir, tmp_path):
    # The old code restored the scheduler of the 2-step run: step 3 trained at lr 0 (where a cosine ends),
    # then jumped into the 4-step schedule. A step's lr is the longer schedule's at that step.
    def lrs(run_dir):
        return [json.loads(line)["lr"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                if "lr" in json.loads(line)]

    sft.main(tiny_args(tiny_model_dir, tmp_path / "long", epochs=2, eval_limit=0))
    sft.main(tiny_args(tiny_model_dir, tmp_path / "short", epochs=1, eval_limit=0))
    sft.main(tiny_args(tiny_model_dir, tmp_path / "short", epochs=2, eval_limit=0, resume=str(tmp_path / "short")))
    long, extended = lrs(tmp_path / "long"), lrs(tmp_path / "short")
    assert len(long) == len(extended) == 4 and extended[2] > 0
    assert extended[2:] == pytest.approx(long[2:], rel=1e-12)


def state_of(run_dir):
    return torch.load(run_dir / "checkpoint" / run.STATE_FILE, weights_only=False)


def test_a_used_run_folder_needs_resume_or_overwrite_and_resume_needs_the_same_flags(tiny_model_dir, data_dir, tmp_path):
    sft.main(tiny_args(tiny_model_dir, tmp_path / "sft", max_examples=4))
    with pytest.raises(UserError, match="already holds a run: continue it with --resume"):
        sft.main(tiny_args(tiny_model_dir, tmp_path / "sft", max_examples=4))
    with pytest.raises(UserError, match="these differ: --lr"):
        sft.main(tiny_args(tiny_model_dir, tmp_path / "sft", max_examples=4, lr=0.5, resume=str(tmp_path / "sft")))
    (tmp_path / "sft" / "notes.txt").write_text("the user's, not the run's")
    with pytest.raises(UserError, match=r"holds files no run writes \(notes.txt\)"):  # never deleted
        sft.main(tiny_args(tiny_model_dir, tmp_path / "sft", max_examples=4, overwrite=True))
    (tmp_path / "sft" / "notes.txt").unlink()
    result = sft.main(tiny_args(tiny_model_dir, tmp_path / "sft", max_examples=4, overwrite=True))
    assert result["start_step"] == 0
    lines = (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if "loss" in json.loads(line)] == [1]  # the new run's only


def test_a_train_file_run_needs_no_gsm8k_and_says_how_to_skip_the_evaluation(tiny_model_dir, tmp_path, monkeypatch):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i} ", "response": f"a{i} </answer>"}) + "\n" for i in range(8)))
    empty = tmp_path / "no-data"
    empty.mkdir()

    def offline(*args, **kwargs):
        raise sft.MissingFileError("could not download gsm8k test.jsonl (no network)")
    monkeypatch.setattr(sft.data, "download_gsm8k", offline)
    with pytest.raises(sft.MissingFileError, match="--eval_limit 0 or another --eval_dataset"):
        sft.main(tiny_args(tiny_model_dir, tmp_path / "a", train_file=str(path), data_dir=str(empty)))
    result = sft.main(tiny_args(tiny_model_dir, tmp_path / "b", train_file=str(path), data_dir=str(empty), eval_limit=0))
    assert result["steps"] == 2 and result["first_eval"] is None and result["last_eval"] is None
    rg = sft.main(tiny_args(tiny_model_dir, tmp_path / "c", train_file=str(path), data_dir=str(empty),
                            eval_dataset="rg:basic_arithmetic", eval_limit=2))
    assert rg["last_eval"]["count"] == 2


def test_a_short_last_microbatch_weighs_each_example_the_same(tiny_model, tokenizer):
    examples = [{"prompt": f"Question {i}:", "response": f" answer {'is ' * i}{i}"} for i in range(3)]

    def gradient(microbatch_size):
        tiny_model.zero_grad(set_to_none=True)
        accumulation = math.ceil(len(examples) / microbatch_size)
        sft.accumulate_gradients(tiny_model, tokenizer, examples, microbatch_size, accumulation, "cpu",
                                 contextlib.nullcontext())
        return torch.cat([p.grad.flatten() for p in tiny_model.parameters()])
    whole = gradient(3)  # one microbatch of 3: the mean over the 3 examples
    torch.testing.assert_close(gradient(2), whole)  # 2 + 1
    torch.testing.assert_close(gradient(1), whole)  # 1 + 1 + 1
    assert whole.abs().sum() > 0


def test_batches_may_keep_the_short_last_one():
    kept = [sft.batch_indices(s, 5, 2, seed=0, drop_last=False) for s in range(3)]
    assert [len(b) for b in kept] == [2, 2, 1] and sorted(sum(kept, [])) == list(range(5))
    assert sft.batch_indices(3, 5, 2, seed=0, drop_last=False) != kept[0]  # the next epoch, a new order
    assert sft.batch_indices(0, 3, 8, seed=0, drop_last=False) != []  # fewer examples than one batch: one step


def test_examples_longer_than_the_context_are_dropped_with_a_count_before_they_are_built(tokenizer, monkeypatch):
    """An rg: task of 100,000 terms once grew SFT to 23 GB: what cannot fit the model's context is dropped, its
    worked solution never written, and none fitting is one line."""
    built, said = [], []
    real = sft.worked_solution
    monkeypatch.setattr(sft, "worked_solution", lambda row, style: built.append(row["question"]) or real(row, style))
    args = SFTArgs(dataset="rg:chain_sum:min_terms=2,max_terms=150,max_digits=1", rg_size=100, max_examples=0)
    every = sft.load_sft_examples(args, tokenizer)
    built.clear()
    kept = sft.load_sft_examples(args, tokenizer, context=300, log=said.append)
    lengths = [len(tokenizer(e["prompt"], add_special_tokens=False).input_ids) +
               len(tokenizer(e["response"], add_special_tokens=False).input_ids) for e in every]
    assert kept == [e for e, n in zip(every, lengths) if n <= 300] and 0 < len(kept) < len(every)
    assert said == [f"[sft] dropped {len(every) - len(kept)} of {len(every)} examples whose prompt and response do "
                    f"not fit the model's context (300 tokens)"]
    prompt_lengths = {e["prompt"]: len(tokenizer(e["prompt"], add_special_tokens=False).input_ids) for e in every}
    assert all(prompt_lengths[next(e["prompt"] for e in every if q in e["prompt"])] <= 300 for q in built)
    assert len(built) < len(every)  # questions that alone overflow got no solution
    with pytest.raises(UserError, match="no training example fits the model's context"):
        sft.load_sft_examples(args, tokenizer, context=20)


def test_an_eval_file_with_its_own_columns_and_a_resume_after_the_train_file_changed(tiny_model_dir, tmp_path, capsys):
    """SFT's --eval_dataset file could only have `question`/`answer` columns (its error named --dataset and flags SFT
    lacked), and a --resume trained on an edited --train_file silently (a probe round, 2026-12-02)."""
    pairs, questions = tmp_path / "pairs.jsonl", tmp_path / "questions.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"q{i} ", "response": f"a{i} </answer>"}) + "\n" for i in range(8)))
    questions.write_text("".join(json.dumps({"problem": f"What is {i} + 1?", "gold": i + 1}) + "\n" for i in range(60)))
    flags = dict(train_file=str(pairs), eval_dataset=str(questions), eval_limit=2, save_every=1)
    with pytest.raises(UserError, match=rf"^--eval_dataset {questions} has no column question, answer .*--question_key "
                                        r"and --answer_key"):
        sft.load_eval_rows(SFTArgs(**flags))
    rows = sft.load_eval_rows(SFTArgs(question_key="problem", answer_key="gold", **flags))
    assert len(rows) == 2 and all(data.held_out(r["question"]) for r in rows)
    run = tmp_path / "sft"
    sft.main(tiny_args(tiny_model_dir, run, question_key="problem", answer_key="gold", **flags))
    config = json.loads((run / "config.json").read_text())
    assert config["train_file_sha256"] == hashlib.sha256(pairs.read_bytes()).hexdigest()
    assert config["eval_dataset_sha256"] == hashlib.sha256(questions.read_bytes()).hexdigest()
    pairs.write_text(pairs.read_text().replace("a3 ", "a different answer "))
    resume = dict(question_key="problem", answer_key="gold", resume=str(run), epochs=2, **flags)
    with pytest.raises(UserError, match=r"^--train_file .*pairs.jsonl \(sha256 \w{12} then, \w{12} now\): the file "
                                        r"changed since the run's checkpoint: restore it, or pass --accept_changed_data"):
        sft.main(tiny_args(tiny_model_dir, run, **resume))
    assert sft.main(tiny_args(tiny_model_dir, run, accept_changed_data=True, **resume))["steps"] == 4
    # the acceptance was that resume's alone: saved false, not inherited, so the next edit is refused again
    assert not json.loads((run / "checkpoint" / "run_config.json").read_text())["accept_changed_data"]
    pairs.write_text(pairs.read_text().replace("a5 ", "yet another answer "))
    argv = ["--resume", str(run), "--epochs", "3"]
    with pytest.raises(UserError, match=r"^--train_file .*pairs.jsonl \(sha256 .*: the file changed"):
        sft.main(parse(SFTArgs, argv))
    # the run's config.json is a recipe (it was refused: "unknown key train_file_sha256"); what a resume accepted
    # is no flag of a new run
    again = parse(SFTArgs, ["--config", str(run / "config.json"), "--output_dir", str(tmp_path / "again")])
    assert again.train_file == str(pairs) and again.question_key == "problem" and not again.accept_changed_data
    for argv, why in ((["--question_key", "q"], "without an --eval_dataset file"),
                      (["--train_file", str(pairs), "--accept_changed_data"], "without --resume")):
        with pytest.raises(SystemExit):
            parse(SFTArgs, argv)
        assert why in capsys.readouterr().err


def test_the_start_line_says_an_epoch_leaves_its_partial_batch_out(tiny_model_dir, tmp_path, capsys):
    """"7 examples x 1 epoch(s) = 1 steps of 4" left 3 out with no word (a probe round, 2026-12-02)."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"q{i} ", "response": f"a{i} </answer>"}) + "\n" for i in range(7)))
    sft.main(tiny_args(tiny_model_dir, tmp_path / "sft", train_file=str(pairs), eval_limit=0, max_examples=0))
    assert "7 examples x 1 epoch(s) = 1 steps of 4 (an epoch leaves out its last 3, a partial batch)" in capsys.readouterr().out
