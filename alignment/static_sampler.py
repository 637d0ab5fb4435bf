"""The HF sampler with static shapes: what a GPU needs to decode at its own pace rather than Python's.

`HFSampler` (alignment/sampling.py) is the reference loop: its cache and mask grow by concatenation, finished
rows leave the batch, each row draws from its own `torch.Generator` (one launch per row per token), and the
host reads every token to check EOS and stop strings. On an H200 that loop took ~31-40 ms per decode step
whatever the model's size (docs/results.md, "The GPU pass"): the GPU was waiting on Python.

`StaticSampler` keeps the reference's semantics (prompts left-padded, each distinct prompt prefilled once,
EOS, stop strings, `min_tokens`, greedy at temperature 0, nucleus sampling, a request's tokens independent of
its batch-mates) with shapes that never change during a batch:

- a key/value cache allocated once for the batch's prompt width plus `max_tokens` (transformers'
  `StaticCache`), an attention mask of that full width whose next column is set in place, positions
  advanced in place; finished rows keep decoding (masked out of the result) instead of leaving the batch;
- draws on the device: request r's uniform at token t is a counter-based hash of (its seed, t)
  (`counter_uniforms`, SplitMix64), computed for the whole batch in one operation, so no per-row generator
  remains and a request's draws still depend on nothing but its own seed;
- the host reads the new tokens once every `check_every` steps, finds EOS and stop strings in them exactly
  as the reference does token by token, and stops the batch once every row has finished;
- on CUDA the decode step (sample a token, run the model on it) is compiled into one graph
  (`torch.compile(mode="reduce-overhead", fullgraph=True)`), with shapes bucketed so that a new batch does not
  recompile: prompt widths rounded up to WIDTH_BUCKET, the cache's room for new tokens to TOKENS_BUCKET
  (Delethink and TIR rounds ask for ever other budgets), every batch padded to the sampler's batch size;
  `min_tokens` is a tensor of the state, not a constant of the graph.

The draws differ from the reference's (a hash instead of torch's Philox stream per row), so sampled
completions differ for the same seed; given the same uniforms both give the same tokens (tests/test_sampling.py).
"""

import time

import torch
from torch._dynamo.exc import BackendCompilerFailed
from transformers import StaticCache

from alignment.errors import UserError
from alignment.sampling import Completion, HFSampler, draw_tokens

WIDTH_BUCKET = 64  # compiled decoding: prompt widths rounded up to a multiple of this (fewer shapes, fewer graphs)
TOKENS_BUCKET = 256  # compiled decoding: room for new tokens rounded up to a multiple of this
CHECK_EVERY = 8  # tokens decoded between two host reads
KEPT_SHAPES = 4  # decoding buffers kept for this many batch shapes (each holds a whole key/value cache)

# SplitMix64 (Steele, Lea and Flood 2014), in int64 arithmetic: products and sums wrap modulo 2^64 as the
# original's uint64 ones, right shifts are made logical by masking the sign's copies off
_GAMMA, _MIX1, _MIX2 = (c - 2**64 for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function of the int64 tensor `x` (its state plus one gamma): every bit of the
    input mixes into every bit of the output."""
    x = x + _GAMMA
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def counter_uniforms(seeds: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
    """(B,) float64 uniforms in [0, 1), one per request: a pure function of the request's seed and the token
    index `step`, on the seeds' device, for the whole batch in one pass."""
    bits = splitmix64(splitmix64(seeds) + step)
    return _shift_right(bits, 11).double() * 2.0**-53  # the top 53 bits: every double in [0, 1) this fine


def request_seeds(seeds: list[int], device) -> torch.Tensor:
    """The requests' 63-bit seeds (sampling.derive_seed) as an int64 tensor."""
    return torch.tensor(seeds, dtype=torch.int64, device=device)


def counter_draws(seeds: list[int], device):
    """`HFSampler._uniforms`'s interface over the counter-based draws: the reference loop drawing what the
    static one draws (the tests compare the two on equal uniforms)."""
    table = request_seeds(seeds, device)
    return lambda slots, step: counter_uniforms(table[torch.tensor(slots, device=device)], step)


class StaticSampler(HFSampler):
    """`HFSampler`'s interface and semantics on static shapes (see the module docstring). `compile`: run the
    decode step as one compiled graph (default: on CUDA); `check_every`: tokens between two host reads."""

    def __init__(self, model, tokenizer, batch_size: int = 32, progress: bool = False, compile: bool | None = None,
                 check_every: int = CHECK_EVERY):
        super().__init__(model, tokenizer, batch_size, progress)
        self.compile = model.device.type == "cuda" if compile is None else compile
        self.check_every = check_every
        self.compile_seconds = 0.0  # the first call of each compiled shape (tracing, compiling, capturing)
        self._compiled, self._states = {}, {}

    @torch.no_grad()
    def _generate_batch(self, prompts, params, seeds, bar) -> list[Completion]:
        device, n, real = self.model.device, params.n, len(prompts) * params.n
        width = max(len(p) for p in prompts)
        if self.compile:  # the same shapes for every batch of this call: pad the batch, bucket the width
            width = -(-width // WIDTH_BUCKET) * WIDTH_BUCKET
            fill = max(1, self.batch_size // n) - len(prompts)
            prompts, seeds = prompts + [prompts[0]] * fill, seeds + seeds[:n] * fill
        # Prefill each distinct prompt once (as the reference does), then copy its cache into the static one,
        # once for each of the n samples of its group
        prefill, logits, attention, positions = self._prefill(prompts, width)
        room = -(-params.max_tokens // TOKENS_BUCKET) * TOKENS_BUCKET if self.compile else params.max_tokens
        state = self._state(len(seeds), width, width + room, logits.shape[-1], prefill, device)
        for layer, prompt_layer in zip(state.cache.layers, prefill.layers):
            layer.keys[:, :, :width].copy_(prompt_layer.keys.repeat_interleave(n, 0))
            layer.values[:, :, :width].copy_(prompt_layer.values.repeat_interleave(n, 0))
            layer.cumulative_length.fill_(width)  # the next token's slot (every row: prompts are left-padded)
        state.attention.zero_()[:, :width].copy_(attention.repeat_interleave(n, 0))
        state.positions.copy_(positions[:, -1].repeat_interleave(n, 0))
        state.seeds.copy_(request_seeds(seeds, device))
        state.logits.copy_(logits.repeat_interleave(n, 0))
        state.step.zero_()
        state.min_tokens.fill_(params.min_tokens)
        state.params = params
        advance = self._advance_fn(state)
        finish, generated, checked = [None] * real, [[] for _ in range(real)], 0
        max_stop_chars = max((len(s) for s in params.stop), default=0)
        for t in range(params.max_tokens):
            last = t + 1 == params.max_tokens
            _sample(state) if last else advance(state)  # the last token needs no forward after it
            if last or (t + 1) % self.check_every == 0:
                new = state.tokens[:real, checked:t + 1].tolist()  # the host's one read per check_every tokens
                for row in range(real):
                    if finish[row] is None:
                        finish[row] = self._scan(generated[row], new[row], checked, params, max_stop_chars)
                        if finish[row] is not None:
                            bar.update(1)
                checked = t + 1
                if all(f is not None for f in finish):
                    break
        bar.update(sum(f is None for f in finish))
        logprobs = state.logprobs[:real].tolist() if params.logprobs else [None] * real
        return [self._completion(ids, f or ("length", None), lp[:len(ids)] if lp else None)
                for ids, f, lp in zip(generated, finish, logprobs)]

    def _state(self, rows: int, width: int, total: int, vocab: int, prefill, device) -> "_State":
        """The decoding buffers for `rows` rows of `total` tokens (`width` of prompt), made once per shape and
        reused, so that a compiled step keeps its graph (CUDA graphs read and write fixed addresses)."""
        key = (rows, width, total, torch.is_autocast_enabled(device.type))  # autocast decides the values' dtype
        if key not in self._states:
            if len(self._states) >= KEPT_SHAPES:  # without compiling (the CPU) every batch has its own shape
                self._states.pop(next(iter(self._states)))
            cache = StaticCache(config=self.model.config, max_cache_len=total)
            for layer, prompt_layer in zip(cache.layers, prefill.layers):  # allocate: (rows, heads, total, dim)
                layer.lazy_initialization(prompt_layer.keys[:1].expand(rows, -1, -1, -1),
                                          prompt_layer.values[:1].expand(rows, -1, -1, -1))
                # transformers sizes both by the keys' dtype. Under autocast the keys leave the rotary embedding in
                # fp32 but the values leave their projection in the autocast dtype, as every decode step writes them
                # (the reference's growing cache holds them promoted to fp32: the same numbers)
                if torch.is_autocast_enabled(device.type):
                    layer.values = layer.values.to(torch.get_autocast_dtype(device.type))
            banned = torch.zeros(vocab, dtype=torch.bool, device=device)
            banned[self.eos_ids] = True
            self._states[key] = _State(
                cache=cache, model=self.model, width=width, banned=banned,
                seeds=torch.zeros(rows, dtype=torch.long, device=device),
                attention=torch.zeros(rows, total, dtype=torch.long, device=device),
                positions=torch.zeros(rows, dtype=torch.long, device=device),
                step=torch.zeros((), dtype=torch.long, device=device), min_tokens=torch.zeros((), dtype=torch.long, device=device),
                tokens=torch.zeros(rows, total - width, dtype=torch.long, device=device),
                logprobs=torch.zeros(rows, total - width, device=device),
                logits=torch.zeros(rows, vocab, device=device))
            if self.compile:  # the graph reads and writes these in place: their addresses must not change
                for tensor in (*self._states[key].tensors(), *(t for l in cache.layers for t in (l.keys, l.values))):
                    torch._dynamo.mark_static_address(tensor)
        return self._states[key]

    def _scan(self, ids: list[int], new: list[int], start: int, params, max_stop_chars: int):
        """Append the row's tokens `new` (token indices start, start + 1, ...) to `ids` up to the first that
        ends it, as the reference checks them one by one; its finish, or None if the row goes on."""
        window = ids[-(max_stop_chars + 1):] + new  # stop strings: decode only if the new text may hold one
        maybe_stop = params.stop and any(s in self.tokenizer.decode(window, skip_special_tokens=True)
                                         for s in params.stop)
        for j, token in enumerate(new, start):
            ids.append(token)
            if j + 1 <= params.min_tokens:
                continue
            if token in self.eos_ids:
                return ("stop", None)
            if maybe_stop:
                hit = self._stop_hit(ids, params.stop, max_stop_chars)
                if hit:
                    return ("stop", hit)
        return None

    def _advance_fn(self, state: "_State"):
        if not self.compile:
            return _advance
        key = (state.tokens.shape, state.attention.shape, state.params.temperature, state.params.top_p)
        if key not in self._compiled:  # one graph per shape and sampling setting, reused by later batches
            compiled = torch.compile(_advance, mode="reduce-overhead", fullgraph=True)
            first = [True]

            def timed(state):  # the first call compiles and captures: timed apart from the decode rate
                start = time.perf_counter()
                try:
                    compiled(state)
                except BackendCompilerFailed as e:  # e.g. torch 2.11's inductor on an H200 (docs/log.md); any call
                    # may compile (the first, or a recompile when a guard fails)
                    inner = getattr(e, "inner_exception", None) or e.__cause__ or e  # the compiler's own error
                    said = (str(inner).strip().splitlines() or [""])[0][:200]
                    raise UserError(f"the static sampler's decode step did not compile with torch {torch.__version__} "
                                    f"({type(inner).__name__}: {said}): use --hf_decoding loop.") from e
                if first[0]:
                    torch.cuda.synchronize() if state.logits.is_cuda else None
                    self.compile_seconds += time.perf_counter() - start
                    first[0] = False
            self._compiled[key] = timed
        return self._compiled[key]


class _State:
    """A batch's decoding state: tensors of fixed shape, changed in place, so the step can be one graph."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def tensors(self):
        return [v for v in self.__dict__.values() if isinstance(v, torch.Tensor)]


def _sample(s: _State) -> torch.Tensor:
    """Draw token `s.step` of every row from `s.logits` (B, V) and record it and its log-prob."""
    params = s.params
    banned = s.banned & (s.step < s.min_tokens)  # EOS cannot end a row before min_tokens
    logits = s.logits.masked_fill(banned, float("-inf"))
    tokens, logprobs = draw_tokens(logits, params.temperature, params.top_p, counter_uniforms(s.seeds, s.step))
    s.tokens.index_copy_(1, s.step[None], tokens[:, None])
    s.logprobs.index_copy_(1, s.step[None], logprobs[:, None].float())
    return tokens


def _advance(s: _State):
    """One decode step, all in place: draw each row's next token, run the model on it, keep its logits."""
    tokens = _sample(s)
    s.attention.index_fill_(1, s.step[None] + s.width, 1)  # the new token's cache slot, width + step
    s.positions.add_(1)
    s.step.add_(1)
    s.logits.copy_(s.model(input_ids=tokens[:, None], attention_mask=s.attention, position_ids=s.positions[:, None],
                           past_key_values=s.cache, use_cache=True).logits[:, -1])
