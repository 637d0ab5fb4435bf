"""The output head and the log-softmax fused: log pi(label) and the entropy of each position's next-token
distribution, computed straight from the decoder's hidden states in chunks of positions.

The plain path (`tokens.py`) builds the (N, V) fp32 logits, then a logsumexp, a gather and the entropy's
softmax over them, and backward adds a vocab-sized zero tensor for the gather, the softmax of the
logsumexp and their sum: about ten passes over N x V floats (8 answers x 128 tokens x 49,152 = 200 MB
each), at memory speed. Here one chunk of positions at a time goes through the head, and only the
per-position results survive: N floats each. Backward recomputes the chunk's logits from the saved
hidden states (one more head matmul, the price of never storing N x V; the "fused linear cross-entropy"
of Liger-Kernel and Apple's Cut Cross-Entropy, here in plain torch so it runs on every device).

Maths, per position with logits z = scale * (h @ W^T) (scale = 1 / temperature, times a model's own
logit scale), lse = logsumexp(z), p = softmax(z), log p = z - lse:
  log_prob = z[label] - lse                    d/dz = onehot(label) - p
  entropy  = lse - sum_j p_j z_j = -sum p log p d/dz = -p * (log p + entropy)
Under autocast the head's matmuls run in the autocast dtype with fp32 outputs kept for everything after
them, as `model(...).logits.float()` would; the log-softmax, entropy and their gradients are fp32.
"""

import torch

CHUNK_POSITIONS = 512  # positions per head matmul: 512 x 49,152 vocab = 50 MB of bf16 (100 MB fp32) logits at a time
# (on 2 AVX2 cores 512 was 14% faster than 128: fewer, larger matmuls; bench/train_phase.py)
SAVE_LOGITS_BYTES = 256 * 2**20  # the chunks' logits are kept for backward (instead of recomputed there) up to
# this size: 1,016 positions x 49,152 vocab are 100 MB in bf16; the recomputation was 3% of the train phase (one head
# matmul of three in backward; bench/train_phase.py, docs/results.md). Bigger inputs recompute: memory stays bounded.
SUB_POSITIONS = 32  # positions per pass of the log-softmax's elementwise work on CPU: 32 x 49,152 fp32 = 6 MB, in
# cache, where whole-chunk passes ran at memory speed (the head's forward + backward on 1,024 positions, 2 AVX512-BF16
# cores: 1.0 s instead of 1.4 s in bf16, 1.7 instead of 1.96 s in fp32; docs/results.md). On a GPU, where many small
# kernels cost and memory is fast, the whole chunk at once.


class FusedHeadLogProbs(torch.autograd.Function):
    """(hidden (N, d), weight (V, d), labels (N,)) -> (log_probs (N,), entropy (N,)), fp32. The entropy's
    gradient flows only when the caller uses it (an entropy bonus); unused, it costs nothing in backward.
    Each chunk's logits come from one matmul in the compute dtype; the fp32 log-softmax then runs over them
    SUB_POSITIONS rows at a time on CPU, and backward writes each sub-chunk's d/dz back into the logits buffer.
    Up to SAVE_LOGITS_BYTES the chunks are rows of one (N, V) buffer kept for backward, whose two matmuls then
    see all N positions at once; above it backward recomputes each chunk and multiplies chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, scale: float, compute_dtype, chunk: int, with_entropy: bool):
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)  # (V, d): one cast per call, as autocast's weight cache does
            log_probs, entropy, log_norm = (hidden.new_zeros(len(hidden), dtype=torch.float32) for _ in range(3))
            keep = len(hidden) * len(weight) * w.element_size() <= SAVE_LOGITS_BYTES
            kept = hidden.new_empty(len(hidden), len(weight), dtype=compute_dtype) if keep else None
            for start, logits in _chunk_logits(hidden, w, chunk, out=kept):
                for rows, z, _ in _sub_chunks(logits, start, scale):  # z: (n, V) fp32, scaled
                    log_norm[rows] = torch.logsumexp(z, dim=-1)
                    log_p = z.sub_(log_norm[rows, None])  # in place: log p (into the logits themselves if fp32)
                    log_probs[rows] = log_p.gather(1, labels[rows, None]).squeeze(1)
                    if with_entropy:
                        entropy[rows] = -torch.linalg.vecdot(torch.exp(log_p), log_p)
        ctx.save_for_backward(hidden, weight, labels, log_norm, entropy)
        ctx.scale, ctx.compute_dtype, ctx.chunk = scale, compute_dtype, chunk
        ctx.kept = (kept, w) if keep else None  # not saved tensors: backward consumes (overwrites) them, once
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, labels, log_norm, entropy = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None  # a second backward (retain_graph) recomputes
        if grad_log_probs is None and grad_entropy is None:
            return (None,) * 7
        grads = (grad_log_probs, grad_entropy, labels, log_norm, entropy, ctx.scale)
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        with torch.autocast(hidden.device.type, enabled=False):
            if kept:  # the forward's logits (fp32: already log p), all positions at once
                grad_z, w = kept
                for start in range(0, len(grad_z), ctx.chunk):  # chunk by chunk: on a GPU each is one fp32 pass
                    _grad_logits_(grad_z[start:start + ctx.chunk], start, *grads,
                                  log_p_done=grad_z.dtype == torch.float32)
                grad_hidden = (grad_z @ w).to(hidden.dtype) if want_hidden else None
                grad_weight = grad_z.T @ hidden.to(w.dtype) if want_weight else None
                return grad_hidden, _as(grad_weight, weight), None, None, None, None, None
            w = weight.to(ctx.compute_dtype)
            grad_hidden = torch.empty_like(hidden) if want_hidden else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
            for start, logits in _chunk_logits(hidden, w, ctx.chunk):  # the chunk's logits, recomputed
                _grad_logits_(logits, start, *grads)
                grad_z, h = logits, hidden[start:start + len(logits)].to(ctx.compute_dtype)  # the chunk's d/dz
                if grad_hidden is not None:
                    grad_hidden[start:start + len(logits)] = grad_z @ w
                if grad_weight is not None and grad_z.dtype == grad_weight.dtype:
                    grad_weight.addmm_(grad_z.T, h)  # in place: no (V, d) temporary
                elif grad_weight is not None:  # bf16 products, accumulated in fp32
                    grad_weight += grad_z.T @ h
        return grad_hidden, _as(grad_weight, weight), None, None, None, None, None


def _grad_logits_(logits, start, grad_log_probs, grad_entropy, labels, log_norm, entropy, scale, log_p_done=False):
    """Overwrite a chunk's logits (rows start.. of the input) with d(loss)/d(h @ W^T), sub-chunk by sub-chunk:
    grad_z = -p * (g_logp + g_H * (log p + H)) + g_logp * onehot(label), built in place in an fp32 log p.
    `log_p_done`: the (fp32) chunk already holds the scaled log p."""
    for rows, log_p, part in _sub_chunks(logits, start, scale, done=log_p_done):
        if not log_p_done:
            log_p = log_p.sub_(log_norm[rows, None])  # (n, V) log p
        p = torch.exp(log_p)
        if grad_entropy is not None:
            grad_z = log_p.add_(entropy[rows, None]).mul_(grad_entropy[rows, None])
            if grad_log_probs is not None:
                grad_z.add_(grad_log_probs[rows, None])
            grad_z.mul_(p).neg_()
        else:
            grad_z = p.mul_(-grad_log_probs[rows, None])
        if grad_log_probs is not None:
            grad_z.scatter_add_(1, labels[rows, None], grad_log_probs[rows, None].float())
        if scale != 1.0:
            grad_z.mul_(scale)  # d/d(h @ W^T)
        if grad_z.data_ptr() != part.data_ptr():  # not built in place in the chunk's fp32 logits
            part.copy_(grad_z)


def _as(grad_weight, weight):
    return grad_weight.to(weight.dtype) if grad_weight is not None else None


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, chunk: int, out: torch.Tensor | None = None):
    """(start, hidden[start:start + chunk] @ weight^T) in weight's dtype, chunk by chunk; into rows of `out`
    when given."""
    for start in range(0, len(hidden), chunk):
        h = hidden[start:start + chunk].to(weight.dtype)
        yield start, (h @ weight.T if out is None else torch.matmul(h, weight.T, out=out[start:start + len(h)]))


def _sub_chunks(logits: torch.Tensor, start: int, scale: float, done: bool = False):
    """(rows of the whole input, scale * logits of those rows in fp32, the chunk's own rows), SUB_POSITIONS rows
    at a time on CPU (the whole chunk elsewhere); fp32 logits are handed out as views, to be worked on in place.
    `done`: fp32 logits were already scaled (and turned into log p) in forward: handed out as they are."""
    sub = SUB_POSITIONS if logits.device.type == "cpu" else len(logits)
    for s in range(0, len(logits), sub):
        part = logits[s:s + sub]
        z = part.float()
        scaled = scale == 1.0 or done  # (done: fp32 logits, so z is the part itself)
        yield slice(start + s, start + s + len(z)), (z if scaled else z.mul_(scale)), part


def fused_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scale: float = 1.0,
                    with_entropy: bool = False, chunk: int = CHUNK_POSITIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(scale * hidden @ weight^T)[label] and (`with_entropy`, else zeros) the entropy of that
    softmax, for hidden (..., d) and labels (...): two fp32 tensors of labels' shape. The matmuls run in the autocast dtype where autocast is
    on (as the head would), else in the hidden states' dtype."""
    device = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    log_probs, entropy = FusedHeadLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                 labels.reshape(-1), scale, compute_dtype, chunk,
                                                 with_entropy)
    return log_probs.view(labels.shape), entropy.view(labels.shape)
