"""Generation backends behind one interface: `sampler.generate(prompt_token_ids, params)`.

Both backends take token ids (never re-tokenise a prompt), return `params.n` completions per prompt and
share the same semantics: EOS ends a completion (its id is kept in `token_ids`, not in `text`); a stop
string ends it too and is kept in the text; `min_tokens` suppresses both until that many tokens exist;
temperature 0 is greedy; the same seed gives the same output.

- `HFSampler`: a plain transformers decoding loop on CPU or GPU: prompts sorted by length and
  left-padded, each prompt prefilled once and its KV cache copied for the n samples of its group,
  finished rows dropped from the batch so the tail of a batch does not pay for the finished.
- `VLLMSampler`: vLLM on one GPU (`uv sync --extra vllm`); weights are pushed into the running engine.
"""

import os
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    max_tokens: int = 256
    min_tokens: int = 0
    stop: tuple[str, ...] = ()  # stop strings, kept at the end of the text
    seed: int | None = None


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stop_reason: str | None = None  # the stop string that ended it, if any
    extra: dict = field(default_factory=dict)


def pick_backend(backend: str, device: str) -> str:
    """Resolve `--backend auto|hf|vllm` and say which one was picked."""
    has_vllm = _vllm_installed()
    on_gpu = torch.device(device).type == "cuda"
    if backend == "auto":
        backend = "vllm" if has_vllm and on_gpu else "hf"
        why = "vLLM installed and CUDA present" if backend == "vllm" else (
            "no CUDA device" if not on_gpu else "vLLM not installed; `uv sync --extra vllm` adds it")
        print(f"[sampling] backend auto -> {backend} ({why})")
    elif backend == "vllm" and not (has_vllm and on_gpu):
        raise ValueError("--backend vllm needs a CUDA device and `uv sync --extra vllm`; use --backend hf.")
    elif backend not in ("hf", "vllm"):
        raise ValueError(f"unknown backend {backend!r}; choose auto, hf or vllm.")
    return backend


def _vllm_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


class HFSampler:
    def __init__(self, model, tokenizer, batch_size: int = 32, progress: bool = False):
        self.model, self.tokenizer, self.batch_size, self.progress = model, tokenizer, batch_size, progress
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = sorted(set(eos) | {tokenizer.eos_token_id})
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    def load_weights(self, state_dict):
        self.model.load_state_dict(state_dict)

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Return, for each prompt, a list of `params.n` completions."""
        device = self.model.device
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed if params.seed is not None else torch.seed() % 2**63)
        order = sorted(range(len(prompt_token_ids)), key=lambda i: len(prompt_token_ids[i]))
        per_chunk = max(1, self.batch_size // params.n)  # prompts per forward batch
        results: dict[int, list[Completion]] = {}
        bar = tqdm(total=len(order), desc="generating", unit="prompt", disable=not self.progress, leave=False)
        for start in range(0, len(order), per_chunk):
            chunk = order[start:start + per_chunk]
            outs = self._generate_batch([prompt_token_ids[i] for i in chunk], params, generator)
            for k, i in enumerate(chunk):
                results[i] = outs[k * params.n:(k + 1) * params.n]
            bar.update(len(chunk))
        bar.close()
        return [results[i] for i in range(len(prompt_token_ids))]

    def _generate_batch(self, prompts, params, generator) -> list[Completion]:
        device, n = self.model.device, params.n
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        # Prefill each distinct prompt once, then copy its cache for the n samples of the group.
        logits = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits, attention = logits.repeat_interleave(n, 0), attention.repeat_interleave(n, 0)
            positions = positions.repeat_interleave(n, 0)
        next_pos = positions[:, -1] + 1
        rows = list(range(len(prompts) * n))  # active row -> output slot
        generated = [[] for _ in rows]
        finish: list[tuple[str, str | None] | None] = [None] * len(rows)
        eos = torch.tensor(self.eos_ids, device=device)
        max_stop_chars = max((len(s) for s in params.stop), default=0)
        for step in range(params.max_tokens):
            if step < params.min_tokens:
                logits[:, eos] = float("-inf")
            tokens = sample_next(logits, params.temperature, params.top_p, generator)
            keep = []
            for r, token in enumerate(tokens.tolist()):
                slot = rows[r]
                generated[slot].append(token)
                if step + 1 > params.min_tokens and token in self.eos_ids:
                    finish[slot] = ("stop", None)
                elif params.stop and step + 1 > params.min_tokens:
                    hit = self._stop_hit(generated[slot], params.stop, max_stop_chars)
                    if hit:
                        finish[slot] = ("stop", hit)
                if finish[slot] is None:
                    keep.append(r)
            if not keep or step + 1 == params.max_tokens:
                break
            if len(keep) < len(rows):  # finished rows leave the batch
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                tokens, attention, next_pos = tokens[index], attention[index], next_pos[index]
                rows = [rows[r] for r in keep]
            attention = torch.cat([attention, attention.new_ones(len(rows), 1)], dim=1)
            logits = self.model(input_ids=tokens[:, None], attention_mask=attention,
                                position_ids=next_pos[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
            next_pos = next_pos + 1
        return [self._completion(ids, f or ("length", None)) for ids, f in zip(generated, finish)]

    def _stop_hit(self, ids, stops, max_stop_chars) -> str | None:
        # A stop string of c characters spans at most c tokens; look only at the newest ones and only
        # for matches that the newest token completed.
        window = ids[-(max_stop_chars + 1):]
        tail = self.tokenizer.decode(window, skip_special_tokens=True)
        before = self.tokenizer.decode(window[:-1], skip_special_tokens=True)
        for stop in stops:
            if stop in tail and tail.count(stop) > before.count(stop):
                return stop
        return None

    def _completion(self, ids, finish) -> Completion:
        reason, stop = finish
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if stop is not None:  # the last token may run past the stop string; the text ends with it
            text = text[:text.rfind(stop) + len(stop)]
        return Completion(token_ids=ids, text=text, finish_reason=reason, stop_reason=stop)


def sample_next(logits, temperature: float, top_p: float, generator) -> torch.Tensor:
    """One token per row: greedy at temperature 0, else nucleus sampling (Holtzman et al. 2020)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    if top_p < 1.0:
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        # drop a token when the tokens strictly more likely than it already cover top_p
        drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return sorted_ids.gather(-1, choice).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class VLLMSampler:
    """vLLM on one GPU. Needs `uv sync --extra vllm`; not exercised on the CPU-only CI machines."""

    def __init__(self, model_path: str, device: str = "cuda", gpu_memory_utilization: float = 0.85,
                 max_model_len: int | None = None, seed: int = 0, dtype: str = "bfloat16", progress: bool = False):
        # The engine runs in this process so that weights can be pushed into it without an RPC layer,
        # and is pinned to its GPU by making that GPU the current device before it starts.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.progress = progress
        from vllm import LLM
        torch.cuda.set_device(torch.device(device))
        self.llm = LLM(model=model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, seed=seed, enable_prefix_caching=True)

    def load_weights(self, state_dict):
        """Copy new policy weights into the running engine (no restart)."""
        executor = self.llm.llm_engine.model_executor
        worker = getattr(executor, "driver_worker", None)
        worker = getattr(worker, "worker", worker)
        if worker is None:
            raise RuntimeError("this vLLM version hides its worker; run with VLLM_ENABLE_V1_MULTIPROCESSING=0.")
        worker.model_runner.model.load_weights(state_dict.items())
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights

    def generate(self, prompt_token_ids, params: SamplingParams):
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt
        vparams = VParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                          max_tokens=params.max_tokens, min_tokens=params.min_tokens, stop=list(params.stop),
                          include_stop_str_in_output=True, seed=params.seed)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_token_ids],
                                    vparams, use_tqdm=self.progress)
        return [[Completion(token_ids=list(o.token_ids), text=o.text, finish_reason=o.finish_reason,
                            stop_reason=o.stop_reason if isinstance(o.stop_reason, str) else None)
                 for o in out.outputs] for out in outputs]


def make_sampler(backend: str, model, tokenizer, model_path: str | None = None, device: str = "cpu",
                 batch_size: int = 32, seed: int = 0, gpu_memory_utilization: float = 0.85, progress: bool = False):
    """`backend` is already resolved by pick_backend (hf or vllm)."""
    if backend == "vllm":
        return VLLMSampler(model_path, device, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                           progress=progress)
    return HFSampler(model, tokenizer, batch_size=batch_size, progress=progress)
