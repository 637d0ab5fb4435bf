"""Token-level helpers shared by the SFT and RL scripts: everything that sees a tokenizer or logits.

`tokenize_prompt_and_output` builds (input_ids, labels, response_mask) (`tokenize_prompt_and_segments` for a
response whose tool output takes no loss); `get_response_log_probs` runs the model and returns the log-prob of
each label (and optionally the entropy of each next-token distribution). Everything after log-probs is pure
maths in `alignment/grpo.py`.

Memory: the logits (B, T, V) are by far the largest tensor in a step (V = 49,152 for SmolLM2, 151,936
for Qwen). The helpers here never build a second tensor of that size: log-probs are a gather minus a
logsumexp, and entropy is computed over chunks of positions.
"""

import copy
import functools
import weakref
from collections import Counter

import torch

from alignment import attention
from alignment.errors import UserError
from alignment.head import fused_log_probs

ENTROPY_CHUNK_POSITIONS = 1024  # positions per entropy chunk: 1024 x 152k vocab x 4 bytes = 0.6 GB
# a group whose prompt and responses fit in this many tokens runs as one packed row (see _packed_log_probs):
# one forward for all such groups of a microbatch instead of two per group; above it, the attention over the
# packed row (computed in full, mask and all) costs more than the forward it saves (docs/results.md,
# "Packed groups"). On CUDA a launch costs more than the attention a larger packed row adds, so the cap is
# larger there: CUDA_PACK_TOKENS packs a group of 8 answers of 256 tokens and its prompt (the 1.5B pass's shape,
# ~2,200 tokens); not yet measured on a GPU
PACK_TOKENS = 512
CUDA_PACK_TOKENS = 4096


def tokenize_prompt_and_output(prompt_strs: list[str], output_strs: list[str],
                               tokenizer) -> dict[str, torch.Tensor]:
    """Tokenize prompts and outputs separately (no special tokens added), concatenate each pair and
    right-pad with the pad id to the longest, L. Returns `input_ids` (all but the last token),
    `labels` (all but the first) and `response_mask` (1 where the label is an output token), each
    (B, L - 1) int64."""
    if len(prompt_strs) != len(output_strs):
        raise ValueError(f"got {len(prompt_strs)} prompts but {len(output_strs)} outputs")
    return tokenize_prompt_and_segments(prompt_strs, [[(output, True)] for output in output_strs], tokenizer)


def tokenize_prompt_and_segments(prompt_strs: list[str], segment_lists: list[list[tuple[str, bool]]],
                                 tokenizer) -> dict[str, torch.Tensor]:
    """`tokenize_prompt_and_output` for outputs written as (text, trained) segments: each segment is tokenized
    on its own and the ids concatenated, as the TIR rollout appends a tool's output (tokenized on its own) to
    the ids the model sampled, so SFT on a tool-using solution sees the ids a rollout of it would hold.
    `response_mask` is 1 only on the tokens of trained segments: the tool's output, which the model never
    writes, gets loss 0 (alignment/tir.py's loss mask)."""
    if len(prompt_strs) != len(segment_lists):
        raise ValueError(f"got {len(prompt_strs)} prompts but {len(segment_lists)} outputs")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = tokenizer(prompt_strs, add_special_tokens=False)["input_ids"]
    texts = [text for segments in segment_lists for text, _ in segments]
    pieces = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    outputs, trained = [], []  # per row: the output's ids, and 1/0 per id
    for segments in segment_lists:
        ids, mask = [], []
        for _, train in segments:
            piece = next(pieces)
            ids += piece
            mask += [int(train)] * len(piece)
        outputs.append(ids)
        trained.append(mask)
    length = max(len(p) + len(o) for p, o in zip(prompts, outputs))
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)  # (B, L)
    is_output = torch.zeros((len(prompts), length), dtype=torch.long)  # (B, L)
    for row, (prompt, output, mask) in enumerate(zip(prompts, outputs, trained)):
        ids[row, :len(prompt) + len(output)] = torch.tensor(prompt + output, dtype=torch.long)
        is_output[row, len(prompt):len(prompt) + len(output)] = torch.tensor(mask, dtype=torch.long)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "response_mask": is_output[:, 1:]}


def pack_tokens(device) -> int:
    """The largest group (prompt and responses) that runs as one packed row on `device`."""
    return CUDA_PACK_TOKENS if torch.device(device).type == "cuda" else PACK_TOKENS


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`. To CUDA through pinned memory, without blocking: a copy from pageable memory
    makes the host wait for it (a sync), one from pinned memory is queued on the stream like a kernel (torch
    keeps the pinned block until the copy is done). Elsewhere a plain `.to`."""
    on_cuda = torch.device(device).type == "cuda"
    return (tensor.pin_memory() if on_cuda else tensor).to(device, non_blocking=on_cuda)


def compute_entropy(logits: torch.Tensor, chunk_positions: int = ENTROPY_CHUNK_POSITIONS) -> torch.Tensor:
    """Entropy of softmax(logits) over the last (vocab) axis: logsumexp(z) - sum softmax(z) * z, which
    is stable for any logit scale. Works over chunks of `chunk_positions` positions, so only one chunk's
    probabilities exist at a time besides the logits. Returns logits.shape[:-1], in float32."""
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    pieces = []
    for chunk in flat.split(chunk_positions):
        chunk = chunk.float()  # (n, V)
        log_norm = torch.logsumexp(chunk, dim=-1)  # (n,)
        probs = torch.softmax(chunk, dim=-1)  # (n, V)
        pieces.append(log_norm - (probs * chunk).sum(-1))
    return torch.cat(pieces).reshape(logits.shape[:-1])


def get_response_log_probs(model, input_ids: torch.Tensor, labels: torch.Tensor,
                           return_token_entropy: bool = False, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """log pi(label_t | input_ids_<=t) for every position, (B, T), differentiable; with
    `return_token_entropy`, also `token_entropy` (B, T), the entropy of each next-token distribution.
    The entropy is for logging, so it is computed without gradient (no graph over a second vocab-sized
    tensor). Padding sits to the right of every real token, so no attention mask is needed.

    `temperature` T: the distribution is softmax(logits / T), the one a sampler at temperature T draws
    from. RL must score samples under the distribution that produced them (see `rollout_log_probs`)."""
    if _fused_scale(model) is not None:  # the head and log-softmax fused: no (B, T, V) tensor (alignment/head.py)
        hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state  # (B, T, d)
        log_probs, entropy = head_log_probs(model, hidden, labels, temperature, return_token_entropy)
        return {"log_probs": log_probs, **({"token_entropy": entropy} if return_token_entropy else {})}
    # float32 so that log-ratios against old log-probs are not bf16 noise; the bf16 logits are freed
    # right away (autograd does not keep them), so one vocab-sized tensor stays alive.
    logits = _tempered(model(input_ids).logits, temperature)  # (B, T, V)
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    result = {"log_probs": picked - torch.logsumexp(logits, dim=-1)}
    if return_token_entropy:
        with torch.no_grad():
            result["token_entropy"] = compute_entropy(logits.detach())
    return result


def head_log_probs(model, hidden: torch.Tensor, labels: torch.Tensor, temperature: float,
                   return_token_entropy: bool = False, entropy_grad: bool = False):
    """log pi(label) at each of the decoder's last hidden states (..., d), and the entropy of pi there (None
    unless asked; without gradient unless `entropy_grad`), both fp32 of labels' shape; pi = softmax(logits /
    temperature) with the model's own post-head step. Fused with the head where the head is a plain linear
    layer (alignment/head.py), else through the (..., V) logits."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score samples, got {temperature}")
    scale = _fused_scale(model)
    if scale is not None:
        log_probs, entropy = fused_log_probs(hidden, model.get_output_embeddings().weight, labels,
                                             scale / temperature, with_entropy=return_token_entropy)
        return log_probs, (entropy if entropy_grad else entropy.detach()) if return_token_entropy else None
    logits = _tempered(output_logits(model, hidden), temperature)  # (..., V)
    log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    entropy = compute_entropy(logits if entropy_grad else logits.detach()) if return_token_entropy else None
    return log_probs, entropy


def rollout_log_probs(model, prompts: list[list[int]], responses: list[list[int]],
                      return_token_entropy: bool = False, temperature: float = 1.0,
                      entropy_grad: bool = False, one_forward: bool = False,
                      shared: "SharedPrompts | None" = None) -> dict[str, torch.Tensor]:
    """log pi(response_t | prompt, response_<t) for rows given as token ids, (B, T) right-padded to the
    longest response (padding reads 0), differentiable; optionally `token_entropy` (B, T), no gradient.
    pi is softmax(logits / temperature): pass the sampling temperature, so that the current, old and
    reference log-probs are all of the distribution the responses were drawn from. With logits at T = 1
    instead, the on-policy ratio is still 1 but the gradient estimates E_q[A grad log pi] for q != pi.
    `entropy_grad`: the entropy keeps its graph (for an entropy bonus in the loss; costs memory).

    Same numbers as `get_response_log_probs` on the concatenated rows, computed with less work: rows that
    share a prompt (the group_size responses to one question) run that prompt through the model once,
    with gradient, and attend to copies of its KV cache; and the vocab projection is applied only at
    response positions, never over the prompt. Small groups (a prompt and its responses within
    `pack_tokens(device)`) go further: each is one packed row, and all of them one forward (`_packed_log_probs`).

    `shared`: the prompts that several microbatches of one optimizer step share run once for all of them
    (see `SharedPrompts`).

    `one_forward`: instead, exactly one call of the whole model over the right-padded prompt + response
    rows. FSDP needs it: every rank must make the same number of calls of the sharded root (the number
    of distinct prompts in a microbatch differs between ranks), and the root's own parameters (embeddings,
    head) are gathered only when the root itself is called.
    """
    if one_forward:
        return _one_forward_log_probs(model, prompts, responses, return_token_entropy, temperature, entropy_grad)
    device = next(model.parameters()).device
    decoder = model.get_decoder()
    by_prompt: dict[tuple, list[int]] = {}
    for row, prompt in enumerate(prompts):
        by_prompt.setdefault(tuple(prompt), []).append(row)
    row_log_probs, row_entropy = [None] * len(prompts), [None] * len(prompts)
    packed = {prompt: rows for prompt, rows in by_prompt.items()
              if (shared is None or prompt not in shared.prompts)
              and _packed_length(prompt, rows, responses) <= pack_tokens(device)} if packs(model) else {}
    if packed:
        _packed_log_probs(model, packed, responses, temperature, return_token_entropy, entropy_grad, row_log_probs,
                          row_entropy)
        by_prompt = {prompt: rows for prompt, rows in by_prompt.items() if prompt not in packed}
    for prompt, rows in by_prompt.items():
        group = [responses[r] for r in rows]
        width = max(len(r) for r in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)  # (G, T), padded with 0; built on the host
        for i, response in enumerate(group):
            ids[i, :len(response)] = torch.tensor(response, dtype=torch.long)
        ids = to_device(ids, device)
        if shared is not None and prompt in shared.prompts:
            cache, last = shared.forward(decoder, prompt, device)
        else:
            out = decoder(input_ids=to_device(torch.tensor([prompt]), device), use_cache=True)
            cache, last = out.past_key_values, out.last_hidden_state[:, -1:]
        hidden = last.expand(len(group), 1, -1)  # (G, 1, d): predicts token 0
        if width > 1:
            cache.batch_repeat_interleave(len(group))  # differentiable copies of the prompt's keys/values
            positions = torch.arange(len(prompt), len(prompt) + width - 1, device=device).expand(len(group), -1)
            rest = decoder(input_ids=ids[:, :-1], position_ids=positions, past_key_values=cache, use_cache=True)
            hidden = torch.cat([hidden, rest.last_hidden_state], dim=1)  # (G, T, d)
        lengths = [len(r) for r in group]
        # the real response positions only, row by row, as indices from the host (a boolean mask syncs on a GPU)
        real = to_device(torch.cat([torch.arange(n) + i * width for i, n in enumerate(lengths)]), device)  # (n,)
        labels = to_device(torch.tensor([t for response in group for t in response], dtype=torch.long), device)
        log_probs, entropy = head_log_probs(model, hidden.flatten(0, 1)[real], labels, temperature,
                                            return_token_entropy, entropy_grad)  # (n,)
        for row, piece in zip(rows, log_probs.split(lengths)):
            row_log_probs[row] = piece
        for row, piece in zip(rows, entropy.split(lengths) if entropy is not None else ()):
            row_entropy[row] = piece
    pad = torch.nn.utils.rnn.pad_sequence
    result = {"log_probs": pad(row_log_probs, batch_first=True)}
    if return_token_entropy:
        result["token_entropy"] = pad(row_entropy, batch_first=True)
    return result


def _packed_length(prompt: tuple, rows: list[int], responses: list[list[int]]) -> int:
    """The tokens of a group's packed row: its prompt, then each response but its last token."""
    return len(prompt) + sum(_inputs(responses[r]) for r in rows)


def _inputs(response: list[int]) -> int:
    """A response's tokens in a packed row: all but its last (they predict the next one)."""
    return max(len(response) - 1, 0)


def packs(model) -> bool:
    """Whether `model` can run packed groups: its attention takes a custom boolean (B, 1, L, L) mask as is
    (transformers' SDPA attention or this project's) and every layer attends to every earlier position
    (no sliding windows), so the mask alone says what each token sees and the positions what it is."""
    config = getattr(model.config, "text_config", None) or model.config
    if config._attn_implementation not in ("sdpa", attention.NAME):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False


def _packed_log_probs(model, groups: dict[tuple, list[int]], responses, temperature, return_token_entropy,
                      entropy_grad, row_log_probs: list, row_entropy: list):
    """The log-probs (and entropies) of the rows of `groups` (prompt -> its rows) from one forward, into
    row_log_probs / row_entropy. Each group is one packed row: its prompt once, then each response but its
    last token, every response at the positions it has after the prompt; a (B, 1, L, L) mask lets a response
    token see its prompt and its own earlier tokens only, and a prompt token its own prompt, causally. So
    every position computes what the prompt-cache path computes, the prompt once per group as there, in one
    call for all the groups (rows right-padded; a pad sees pads and its prompt, and is never read)."""
    device = next(model.parameters()).device
    width = max(_packed_length(prompt, rows, responses) for prompt, rows in groups.items())
    ids = torch.zeros(len(groups), width, dtype=torch.long)
    positions = torch.zeros(len(groups), width, dtype=torch.long)
    block = torch.full((len(groups), width), -1)  # 0: the prompt; k: the group's k-th response; -1: padding
    picks, order = [], []  # (packed row, position) of each label, row by row; the rows in that order
    for g, (prompt, rows) in enumerate(groups.items()):
        ids[g, :len(prompt)] = torch.tensor(prompt)
        positions[g, :len(prompt)] = torch.arange(len(prompt))
        block[g, :len(prompt)] = 0
        start = len(prompt)
        for k, row in enumerate(rows, 1):
            response = responses[row]
            rest = _inputs(response)
            ids[g, start:start + rest] = torch.tensor(response[:rest], dtype=torch.long)
            positions[g, start:start + rest] = torch.arange(len(prompt), len(prompt) + rest)
            block[g, start:start + rest] = k
            # the prompt's last position predicts token 0, the response's own positions the rest
            picks += [(g, len(prompt) - 1)][:len(response)] + [(g, start + t) for t in range(rest)]
            order.append(row)
            start += rest
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = causal & ((block[:, :, None] == block[:, None, :]) | (block[:, None, :] == 0))  # (G, L, L)
    hidden = model.get_decoder()(input_ids=to_device(ids, device), position_ids=to_device(positions, device),
                                 attention_mask=to_device(mask[:, None], device), use_cache=False).last_hidden_state
    where = to_device(torch.tensor(picks, dtype=torch.long).reshape(-1, 2), device)
    labels = to_device(torch.tensor([t for row in order for t in responses[row]], dtype=torch.long), device)
    log_probs, entropy = head_log_probs(model, hidden[where[:, 0], where[:, 1]], labels, temperature,
                                        return_token_entropy, entropy_grad)  # (n,)
    lengths = [len(responses[row]) for row in order]
    for row, piece in zip(order, log_probs.split(lengths)):
        row_log_probs[row] = piece
    for row, piece in zip(order, entropy.split(lengths) if entropy is not None else ()):
        row_entropy[row] = piece


class SharedPrompts:
    """The forwards of the prompts that rows in more than one microbatch of an optimizer step share (a group
    larger than the microbatch), run once per step instead of once per microbatch.

    The first microbatch with a prompt runs it; every microbatch gets a cache whose keys and values (and the
    prompt's last hidden state) are detached leaves of that forward's outputs, so each microbatch's backward
    leaves its part of their gradient on them, summed over the microbatches (in fp32). `done(prompts)` after
    each microbatch's backward sends a prompt's sum through its forward once its last microbatch is done: by
    linearity the same gradient as a backward per microbatch, up to the order of the sums. A prompt's graph
    lives from its first microbatch to its last (rows come group by group, so about one at a time); prompts
    seen by one microbatch only run there, as without sharing. Without gradient the outputs are reused."""

    def __init__(self, prompts_per_microbatch: list[list[list[int]]]):
        counts = Counter(prompt for prompts in prompts_per_microbatch for prompt in {tuple(p) for p in prompts})
        self.prompts = {prompt for prompt, count in counts.items() if count > 1}
        self._uses_left = {prompt: counts[prompt] for prompt in self.prompts}
        self._runs: dict[tuple, tuple] = {}  # prompt -> (its cache, with leaves; its last hidden state, a leaf)
        self._graphs: dict[tuple, tuple[list, list]] = {}  # prompt -> (its forward's outputs, their fp32 sums)

    def forward(self, decoder, prompt: tuple, device) -> tuple:
        """(a cache of its own, the last hidden state) of `prompt`, run on its first use."""
        if prompt not in self._runs:
            out = decoder(input_ids=to_device(torch.tensor([prompt]), device), use_cache=True)
            cache = out.past_key_values
            outputs = [out.last_hidden_state[:, -1:]] + [t for layer in cache.layers for t in (layer.keys, layer.values)]
            leaves = outputs
            if torch.is_grad_enabled():
                leaves = [t.detach().requires_grad_() for t in outputs]
                sums = [torch.zeros_like(t, dtype=torch.float32) for t in outputs]
                for leaf, total in zip(leaves, sums):
                    leaf.register_post_accumulate_grad_hook(functools.partial(_add_grad_to, total))
                self._graphs[prompt] = outputs, sums
            for i, layer in enumerate(cache.layers):
                layer.keys, layer.values = leaves[1 + 2 * i], leaves[2 + 2 * i]
            self._runs[prompt] = cache, leaves[0]
        cache, last = self._runs[prompt]
        own = copy.copy(cache)  # batch_repeat_interleave replaces a layer's keys and values: the shared ones stay
        own.layers = [copy.copy(layer) for layer in cache.layers]
        return own, last

    def done(self, prompts: list[list[int]]):
        """A microbatch with these prompts is done (its backward run): a shared prompt whose last microbatch
        this was sends its summed gradient through its forward, and its graph is freed."""
        for prompt in {tuple(p) for p in prompts} & self.prompts:
            self._uses_left[prompt] -= 1
            if self._uses_left[prompt] == 0:
                self._send(prompt)

    def _send(self, prompt: tuple):
        self._runs.pop(prompt, None)
        outputs, sums = self._graphs.pop(prompt, ((), ()))
        if outputs:
            torch.autograd.backward(list(outputs), [total.to(out.dtype) for out, total in zip(outputs, sums)])


def _add_grad_to(total: torch.Tensor, leaf: torch.Tensor):
    total += leaf.grad  # in fp32
    leaf.grad = None


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits from its decoder's last hidden states: the output head, then what the model's own
    forward does after it (transformers 5: Gemma-2/3's final-logit softcapping, Cohere's logit_scale,
    Granite's and HyperCLOVAX's logits_scaling, FalconH1's lm_head_multiplier), so the shared-prompt and fused
    paths score the distribution the sampler draws from. Proven against the model's forward (`_post_head`)."""
    scale, cap = _post_head(model)
    logits = model.get_output_embeddings()(hidden)
    if scale != 1.0:
        logits = logits * scale
    if cap:  # Gemma-2/3
        logits = torch.tanh(logits / cap) * cap
    return logits


_PROVEN = weakref.WeakKeyDictionary()  # model -> its post-head (factor, cap), once proven against its forward


def _post_head(model) -> tuple[float, float | None]:
    """The model's forward after its head: a factor on the logits, then a softcap (None: none). Read from the
    config, then proven once per model against the model's own forward (`check_output_head`): every path that
    calls the head itself (the fused head in SFT, expert iteration and RL; the shared-prompt path) goes
    through here, so a family that scales its logits another way is refused, never silently mis-scored."""
    if model not in _PROVEN:
        _PROVEN[model] = _prove_post_head(model, *_declared_post_head(model))
    return _PROVEN[model]


def _declared_post_head(model) -> tuple[float, float | None]:
    config = getattr(model.config, "text_config", None) or model.config
    scale = getattr(model, "logit_scale", None) or getattr(config, "logit_scale", None)
    factor = scale if scale is not None and not isinstance(scale, torch.nn.Module) else 1.0  # Cohere
    if getattr(config, "logits_scaling", None):  # Granite divides (HF GraniteForCausalLM), HyperCLOVAX multiplies
        multiplies = getattr(config, "model_type", "") == "hyperclovax"
        factor = factor * config.logits_scaling if multiplies else factor / config.logits_scaling
    if getattr(config, "lm_head_multiplier", None):  # FalconH1
        factor = factor * config.lm_head_multiplier
    return float(factor), getattr(config, "final_logit_softcapping", None)


@torch.no_grad()
def _prove_post_head(model, scale: float, cap: float | None) -> tuple[float, float | None]:
    """(scale, cap) if the head followed by them gives the model's own logits on a few tokens, else a UserError."""
    device, training = next(model.parameters()).device, model.training
    ids = torch.tensor([[1, 2, 3, 4]], device=device)
    model.eval()  # no dropout (LoRA's included): both sides must see the same computation
    try:
        with torch.autocast(device.type, enabled=False):  # both in the weights' dtype, not a caller's autocast
            full = model(input_ids=ids).logits[:, -1].float()
            hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, -1]
            logits = model.get_output_embeddings()(hidden).float()
    finally:
        model.train(training)
    logits = logits * scale
    if cap:
        logits = torch.tanh(logits / cap) * cap
    if not torch.allclose(full, logits, rtol=1e-3, atol=1e-3 * max(1.0, full.abs().max().item())):
        raise UserError(f"{type(model).__name__}'s forward changes its logits after the output head in a way this "
                        f"project does not reproduce (alignment/tokens.py _declared_post_head): its log-probs would "
                        f"not be the sampler's; use a model of another family, or add its post-head step there.")
    return scale, cap


def _fused_scale(model) -> float | None:
    """The logits' factor when the head can be fused with the log-softmax (a bias-free linear head, no
    softcap, not FSDP-sharded: a sharded root gathers its head only when called itself), else None."""
    from torch.distributed.fsdp import FSDPModule
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or isinstance(model, FSDPModule):
        return None
    scale, cap = _post_head(model)
    return None if cap else scale


def check_output_head(model):
    """Refuse, in one sentence, a model whose forward changes its logits in a way `output_logits` does not
    reproduce (its fused or shared-prompt log-probs would score another distribution than the sampler's).
    Every path that needs it runs it itself; scripts call it up front so a refusal comes before any work."""
    _post_head(model)


def _one_forward_log_probs(model, prompts, responses, return_token_entropy, temperature, entropy_grad) -> dict:
    device = next(model.parameters()).device
    logits = model(input_ids=_right_padded(prompts, responses, device), use_cache=False).logits  # (B, L, V)
    logits = torch.nn.utils.rnn.pad_sequence(
        [logits[i, len(p) - 1:len(p) - 1 + len(r)] for i, (p, r) in enumerate(zip(prompts, responses))],
        batch_first=True)  # (B, T, V): the positions that predict response tokens
    logits = _tempered(logits, temperature)
    labels = to_device(torch.nn.utils.rnn.pad_sequence([torch.tensor(r, dtype=torch.long) for r in responses],
                                                       batch_first=True), device)
    valid = to_device(torch.arange(labels.shape[1]) < torch.tensor([len(r) for r in responses])[:, None], device)
    log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    result = {"log_probs": torch.where(valid, log_probs, 0.0)}
    if return_token_entropy:
        entropy = compute_entropy(logits if entropy_grad else logits.detach())
        result["token_entropy"] = torch.where(valid, entropy, 0.0)
    return result


def rollout_values(critic, prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
    """The critic's value of the state before each response token, V(prompt, response_<t), (B, T)
    right-padded to the longest response (padding reads 0), differentiable: the same positions as the
    log-probs, so values[:, t] is the value of the state in which response token t was chosen."""
    ids = _right_padded(prompts, responses, next(critic.parameters()).device)
    scores = critic(input_ids=ids).logits[..., 0].float()  # (B, L)
    values = [scores[i, len(p) - 1:len(p) - 1 + len(r)] for i, (p, r) in enumerate(zip(prompts, responses))]
    return torch.nn.utils.rnn.pad_sequence(values, batch_first=True)


def _right_padded(prompts, responses, device) -> torch.Tensor:
    """Each row's prompt and response but its last token, right-padded with 0 (causal attention never looks
    right, so no mask is needed), (B, L) on `device`: built on the host, copied once."""
    rows = [list(p) + list(r[:-1]) for p, r in zip(prompts, responses)]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return to_device(ids, device)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits / T (no copy at T = 1 beyond the float cast)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score samples, got {temperature}")
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature
