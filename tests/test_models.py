import torch

from alignment import models


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
