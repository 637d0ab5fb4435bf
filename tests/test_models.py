import pytest
import torch

from alignment import models


def test_two_processes_converting_at_once_keep_the_copy_that_landed_first(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "CHECKPOINTS", tmp_path)
    save = models.LlamaForCausalLM.save_pretrained

    def landed_meanwhile(self, folder, **kwargs):  # the other process's copy lands while this one saves
        (tmp_path / "smollm2-135m").mkdir()
        (tmp_path / "smollm2-135m" / "config.json").write_text("{}")
        return save(self, folder, **kwargs)

    monkeypatch.setattr(models.LlamaForCausalLM, "save_pretrained", landed_meanwhile)
    assert models.convert_packaged_model("smollm2-135m") == tmp_path / "smollm2-135m"
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m"]  # its own copy removed, the other's kept
    assert (tmp_path / "smollm2-135m" / "config.json").read_text() == "{}"

def test_packaged_model_converts_once_and_generates(smollm2_dir, tokenizer):
    assert models.resolve_model("smollm2-135m") == smollm2_dir  # cached: second call reuses the folder
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    model = models.load_model(smollm2_dir)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        next_id = model(ids).logits[0, -1].argmax().item()
    assert tokenizer.decode([next_id]).strip() == "Paris"


def test_checkpoint_round_trip(tiny_model, tokenizer, tmp_path):
    out = models.save_checkpoint(tiny_model, tokenizer, tmp_path / "ckpt", config={"lr": 1e-5})
    assert (out / "run_config.json").exists() and not (tmp_path / "ckpt.tmp").exists()
    loaded = models.load_model(str(out))
    for (name, p), q in zip(tiny_model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name


def test_missing_local_model_is_a_clear_error(tmp_path):
    import pytest
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.resolve_model("checkpoints/nope")


def test_a_save_cut_off_between_its_renames_is_completed(tmp_path):
    out = tmp_path / "checkpoint"
    (tmp_path / "checkpoint.old").mkdir()
    (tmp_path / "checkpoint.old" / "step").write_text("1")
    (tmp_path / "checkpoint.tmp").mkdir()
    (tmp_path / "checkpoint.tmp" / "step").write_text("2")
    assert (models.finish_interrupted_save(out) / "step").read_text() == "2"  # the finished new copy
    assert models.finish_interrupted_save(out) == out and (out / "step").read_text() == "2"  # then a no-op


def test_precision_auto_follows_what_the_cpu_reports(monkeypatch):
    amd_avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    sapphire = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    assert not models.cpu_has_fast_bf16(amd_avx2) and models.cpu_has_fast_bf16(sapphire)
    for cpuinfo, picked in ((amd_avx2, "fp32"), (sapphire, "bf16")):
        monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda info=None, cpuinfo=cpuinfo: "avx512_bf16" in cpuinfo)
        assert models.resolve_precision("auto", "cpu") == picked
        assert models.resolve_precision("fp32", "cpu") == "fp32" and models.resolve_precision("bf16", "cpu") == "bf16"
        assert models.default_dtype("cpu", "auto") == (torch.bfloat16 if picked == "bf16" else torch.float32)
        assert models.default_dtype("cpu") == torch.float32  # a library call without --precision: any CPU alike
    dtype, autocast = models.train_precision("cpu", "bf16")
    assert dtype == torch.float32 and autocast.device == "cpu" and autocast.fast_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="--precision 'half' is not one of auto, fp32, bf16"):
        models.resolve_precision("half", "cpu")


def test_a_run_folder_without_a_checkpoint_is_not_taken_for_a_model(tmp_path):
    import json
    from alignment.errors import MissingFileError
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"output_dir": str(tmp_path / "run"), "script": "train_rl"}))
    with pytest.raises(MissingFileError, match="is a run folder without a checkpoint yet"):
        models.resolve_model(str(tmp_path / "run"))


def test_adamw_is_fused_on_plain_tensors_and_takes_the_same_steps_as_the_default(tiny_model):
    import copy
    fused_model, loop_model = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    fused = models.adamw(fused_model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    loop = torch.optim.AdamW(loop_model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    assert fused.defaults["fused"] and not loop.defaults["fused"]
    ids = torch.randint(0, 100, (2, 6))
    for _ in range(2):  # the second step reads the moments; later ones amplify last-bit differences in the grads
        for model, optimizer in ((fused_model, fused), (loop_model, loop)):
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), b in zip(fused_model.named_parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)  # lr 1e-2: within 0.1% of a step


def test_a_policy_trains_without_its_configs_dropout_so_learner_and_sampler_agree(tiny_gpt2_dir, tmp_path, parity):
    """GPT-2's config asks for dropout 0.1 (resid, attn, embd). The policy's training forwards run in train mode,
    and their log-probs must be of what the sampler drew from (no dropout): with it on, sampler and learner
    differed by 4.8e-2 a token. LoRA's own dropout is still what --lora_dropout says."""
    from alignment import lora, train_rl
    from alignment.args import LoraArgs
    from tests.test_train_rl import read_jsonl, tiny_args
    model = models.load_model(tiny_gpt2_dir)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        eval_logits = model(ids).logits
        assert torch.equal(model.train()(ids).logits, eval_logits)
        policy = lora.add_lora(model, LoraArgs(lora_rank=4, lora_dropout=0.5))
        for name, p in policy.named_parameters():  # nonzero adapters, so their input's dropout shows
            if "lora_B" in name:
                p.normal_(0, 0.1)
        assert not torch.equal(policy.train()(ids).logits, policy.eval()(ids).logits)
    train_rl.main(tiny_args(tiny_gpt2_dir, tmp_path / "run"))
    steps = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(steps) == 2 and all(m["sampler_logprob_diff"] < 1e-5 for m in steps), steps
