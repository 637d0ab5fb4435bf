"""Shared fixtures: the SmolLM2 tokenizer (read once per session) and tiny random models built from a
config, so no test downloads anything."""

import os
from pathlib import Path


def _one_core_per_worker():
    """Under pytest-xdist (CI's `-n 2`), each worker and every process it starts (a stage, a torchrun rank, a vLLM
    engine) keep to one core of their own, one thread each: two workers' torch and vLLM thread pools, each the
    machine's size, spun against each other (a driver test took 76 s alone and 143 s beside vLLM's tests).
    ALIGNMENT_TEST_CORES=all leaves the workers unpinned."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cores = sorted(os.sched_getaffinity(0))
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or os.environ.get("ALIGNMENT_TEST_CORES") == "all" or count < 2 or len(cores) < count:
        return
    core = cores[int(worker[2:]) % len(cores)]
    os.sched_setaffinity(0, {core})
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(core))


_one_core_per_worker()  # before torch loads: its thread pool is sized once

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from alignment import models

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("ALIGNMENT_DATA_DIR", REPO_ROOT.parent / "shared" / "data")).resolve()
os.environ.setdefault("ALIGNMENT_DATA_DIR", str(DATA_DIR))  # the scripts under test read the same folder


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA_DIR / "gsm8k" / "test.jsonl").exists():
        pytest.skip(f"shared data not found in {DATA_DIR}; set ALIGNMENT_DATA_DIR")
    return DATA_DIR


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """HF-format SmolLM2-135M-Instruct, converted from the packaged GGUF once and cached."""
    return models.resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    return models.load_tokenizer(smollm2_dir)


def build_tiny_model(tokenizer, seed: int = 0, num_layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    # head_dim 32: the smallest head size vLLM's CPU attention supports
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()


def build_tiny_gpt2(tokenizer, seed: int = 0, num_layers: int = 2) -> GPT2LMHeadModel:
    """A tiny random GPT-2 with the SmolLM2 vocabulary: Conv1D layers (not nn.Linear), blocks that take the cache
    positionally, and GPT2Config's dropout of 0.1 (resid, attn, embd) in its config."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=num_layers, n_head=2, n_positions=2048,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    assert config.resid_pdrop == config.attn_pdrop == config.embd_pdrop == 0.1
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tokenizer, tmp_path_factory) -> str:
    """The tiny random GPT-2 saved in HF format (dropout 0.1 in its config.json)."""
    path = tmp_path_factory.mktemp("tiny_gpt2")
    build_tiny_gpt2(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def tiny_model(tokenizer):
    """A fresh 2-layer random Llama (hidden size 64, 2 heads of 32) sharing the SmolLM2 vocabulary."""
    return build_tiny_model(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory) -> str:
    """The tiny random model saved in HF format, for code paths that take `--model <dir>`."""
    path = tmp_path_factory.mktemp("tiny_model")
    build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def parity_reward(text, ground_truth, *rest):
    """A reward the tiny random model can earn: half its answers are 'right', so groups have spread."""
    return {"reward": float(len(text) % 2), "format_reward": 1.0, "answer_reward": float(len(text) % 2)}


@pytest.fixture
def parity(monkeypatch):
    """train_rl scores with parity_reward (every prompt and the TIR reward)."""
    from alignment import train_rl
    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (parity_reward, ()))
    monkeypatch.setattr(train_rl.tir, "tir_reward_fn", parity_reward)


def hold_lock(folder):
    """Another process holding `folder`'s run lock (alignment.run.lock_folder) until killed; returns it once held."""
    import subprocess
    import sys
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from alignment.run import lock_folder
from pathlib import Path
lock_folder(Path({str(folder)!r}))
print("locked", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def pytest_terminal_summary(terminalreporter):
    """Each test module's time (setup, call and teardown of its tests, summed; under xdist each worker's share
    adds up), slowest first, and the whole: where the suite's budget goes (docs/log.md, "Test suite"). CI also
    prints the slowest tests (`--durations`)."""
    seconds, tests = {}, {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            nodeid, duration = getattr(report, "nodeid", None), getattr(report, "duration", None)
            if not nodeid or duration is None:
                continue
            module = nodeid.split("::")[0]
            seconds[module] = seconds.get(module, 0.0) + duration
            tests.setdefault(module, set()).add(nodeid)
    if not seconds:
        return
    terminalreporter.section("time per test module (s)")
    for module, total in sorted(seconds.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{total:8.1f}  {len(tests[module]):4d} tests  {module}")
    terminalreporter.write_line(f"{sum(seconds.values()):8.1f}  {sum(map(len, tests.values())):4d} tests  in all")


# The slowest modules, slowest first (each module's time in CI's summary, above): under `-n 2 --dist loadfile` a worker
# takes the next whole module when it finishes one, so the longest go out first and the short ones fill the gaps,
# instead of the alphabet leaving test_worked and test_vllm to run last on one worker while the other waits.
SLOWEST_FIRST = ("test_worked", "test_distributed", "test_gsm8k_card", "test_vllm", "test_train_rl", "test_compile",
                 "test_gpu_pass", "test_bad_input", "test_bench_drivers", "test_own_data", "test_lora", "test_sft")


def pytest_collection_modifyitems(session, config, items):
    """Modules in SLOWEST_FIRST's order, then the rest as collected; each module's own tests keep their order."""
    rank = {name: place for place, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).stem, len(rank)))
