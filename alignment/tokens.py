"""Token-level helpers shared by the SFT and RL scripts: everything that sees a tokenizer or logits.

`tokenize_prompt_and_output` builds (input_ids, labels, response_mask); `get_response_log_probs` runs
the model and returns the log-prob of each label (and optionally the entropy of each next-token
distribution). Everything after log-probs is pure maths in `alignment/grpo.py`.

Memory: the logits (B, T, V) are by far the largest tensor in a step (V = 49,152 for SmolLM2, 151,936
for Qwen). The helpers here never build a second tensor of that size: log-probs are a gather minus a
logsumexp, and entropy is computed over chunks of positions.
"""

import torch

ENTROPY_CHUNK_POSITIONS = 1024  # positions per entropy chunk: 1024 x 152k vocab x 4 bytes = 0.6 GB


def tokenize_prompt_and_output(prompt_strs: list[str], output_strs: list[str],
                               tokenizer) -> dict[str, torch.Tensor]:
    """Tokenize prompts and outputs separately (no special tokens added), concatenate each pair and
    right-pad with the pad id to the longest, L. Returns `input_ids` (all but the last token),
    `labels` (all but the first) and `response_mask` (1 where the label is an output token), each
    (B, L - 1) int64."""
    if len(prompt_strs) != len(output_strs):
        raise ValueError(f"got {len(prompt_strs)} prompts but {len(output_strs)} outputs")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = tokenizer(prompt_strs, add_special_tokens=False)["input_ids"]
    outputs = tokenizer(output_strs, add_special_tokens=False)["input_ids"]
    length = max(len(p) + len(o) for p, o in zip(prompts, outputs))
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)  # (B, L)
    is_output = torch.zeros((len(prompts), length), dtype=torch.long)  # (B, L)
    for row, (prompt, output) in enumerate(zip(prompts, outputs)):
        ids[row, :len(prompt) + len(output)] = torch.tensor(prompt + output, dtype=torch.long)
        is_output[row, len(prompt):len(prompt) + len(output)] = 1
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "response_mask": is_output[:, 1:]}


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
                           return_token_entropy: bool = False) -> dict[str, torch.Tensor]:
    """log pi(label_t | input_ids_<=t) for every position, (B, T), differentiable; with
    `return_token_entropy`, also `token_entropy` (B, T), the entropy of each next-token distribution.
    The entropy is for logging, so it is computed without gradient (no graph over a second vocab-sized
    tensor). Padding sits to the right of every real token, so no attention mask is needed."""
    # float32 so that log-ratios against old log-probs are not bf16 noise; the bf16 logits are freed
    # right away (autograd does not keep them), so one vocab-sized tensor stays alive.
    logits = model(input_ids).logits.float()  # (B, T, V)
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    result = {"log_probs": picked - torch.logsumexp(logits, dim=-1)}
    if return_token_entropy:
        with torch.no_grad():
            result["token_entropy"] = compute_entropy(logits.detach())
    return result
