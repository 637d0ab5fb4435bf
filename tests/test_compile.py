"""--compile_layers (models.compile_layers): the decoder layers run one compiled graph for the forwards
without a key/value cache, and give eager's numbers. The backend here is aot_eager (the graph Dynamo
captures, run without code generation), so equality is exact and the tests take seconds; a GPU run uses
inductor (bench/gpu_pass.py's qwen_compiled stage measures it)."""

import copy
import json

import pytest
import torch
import torch._dynamo

from alignment import attention, models, tokens, train_rl
from alignment.args import RLArgs
from tests.conftest import build_tiny_model


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    monkeypatch.setattr(models, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()  # compiled code is cached per function: no test sees another's
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _model(tokenizer, layers=4, seed=0):
    return attention.use_in(build_tiny_model(tokenizer, seed=seed, num_layers=layers))


def _log_probs_and_grad(model, length):
    model.zero_grad()
    prompts = [[1, 2, 3, 4]] * 3 + [[7, 8]] * 2  # two groups, packed into one forward
    responses = [[5 + i] * (length + i) for i in range(5)]
    out = tokens.rollout_log_probs(model, prompts, responses, return_token_entropy=True)
    out["log_probs"].sum().backward()
    return out["log_probs"].detach(), model.get_decoder().layers[1].mlp.up_proj.weight.grad.clone()


def test_every_layer_runs_one_graph_with_eager_numbers_over_lengths(tokenizer):
    eager, compiled = _model(tokenizer), _model(tokenizer)
    assert models.compile_layers(compiled) == 4
    for length in (3, 6, 11, 17):
        (a, grad_a), (b, grad_b) = _log_probs_and_grad(eager, length), _log_probs_and_grad(compiled, length)
        assert torch.equal(a, b) and torch.equal(grad_a, grad_b)
    stats = torch._dynamo.utils.counters["stats"]
    # one graph, lengths symbolic from the start: not one per layer, nor per length (4 layers x 4 lengths
    # would be 16, past Dynamo's recompile limit: with fullgraph, an error)
    assert stats["unique_graphs"] == 1, dict(stats)


def test_a_call_with_a_cache_runs_eagerly_and_decodes_as_before(tokenizer):
    eager, compiled = _model(tokenizer), _model(tokenizer)
    models.compile_layers(compiled)
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        ids = [eager.generate(prompt, max_new_tokens=6, do_sample=False), compiled.generate(prompt, max_new_tokens=6,
                                                                                            do_sample=False)]
    assert torch.equal(*ids)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # every call had a cache: none compiled


def test_a_deep_copy_of_a_compiled_model_runs_its_own_weights(tokenizer):
    compiled = _model(tokenizer, layers=2)
    models.compile_layers(compiled)
    twin = copy.deepcopy(compiled)
    reference = _model(tokenizer, layers=2)
    with torch.no_grad():
        for model in (twin, reference):
            for p in model.parameters():
                p.mul_(1.5)
        rows = ([[1, 2, 3, 4]] * 2, [[5, 6, 7], [8, 9, 10]])
        mine, theirs = (tokens.rollout_log_probs(m, *rows)["log_probs"] for m in (twin, compiled))
        assert torch.equal(mine, tokens.rollout_log_probs(reference, *rows)["log_probs"])
        assert not torch.allclose(mine, theirs)


def test_a_model_without_decoder_layers_is_refused_in_one_line():
    with pytest.raises(models.UserError, match="--compile_layers compiles the decoder layers"):
        models.compile_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_an_rl_run_with_compiled_layers_takes_the_eager_steps(tiny_model_dir, tmp_path):
    runs = {}
    for compiled in (False, True):
        args = RLArgs(model=tiny_model_dir, n_steps=2, group_size=4, rollout_batch_size=8, train_batch_size=8,
                      train_mini_batch_size=4, sampling_max_tokens=8, eval_every=0, rg_size=40, learning_rate=1e-3,
                      precision="fp32", compile_layers=compiled, output_dir=str(tmp_path / str(compiled)))
        args.check()
        train_rl.main(args)
        runs[compiled] = [json.loads(line) for line in open(tmp_path / str(compiled) / "metrics.jsonl")]
    for a, b in zip(runs[False], runs[True]):
        assert a["response_tokens"] == b["response_tokens"]  # the same rollouts: the sampler is not compiled
        assert b["loss"] == a["loss"] and b["grad_norm"] == a["grad_norm"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the training forwards ran compiled
    one, two = (models.load_model(str(tmp_path / str(c) / "checkpoint")) for c in (False, True))
    assert all(torch.equal(p, q) for p, q in zip(one.parameters(), two.parameters()))
