"""The models' attention: transformers' SDPA attention, with two changes on CPU that measured faster there.

transformers hands torch's `scaled_dot_product_attention` key/value heads repeated to the query heads'
count whenever a mask is given (every answer's attention to a shared prompt has one), and calls it in the
activations' dtype. On CPU, torch's flash kernel takes grouped heads itself (`enable_gqa`: no copies), and
its backward ran faster in fp32 than in bf16 for short query blocks: one layer of SmolLM2 (9 query heads,
3 key/value heads) for 8 answers of 127 tokens on a 162-token prompt, forward and backward on 2 cores,
31.9 ms as transformers calls it, 28.5 ms with grouped heads, 23.9 ms grouped in fp32; a decode step (one
query token over 300 keys) 7.5, 5.7 and 1.8 ms; from 255 query tokens up, fp32 was 3-7% slower than bf16
(docs/results.md, "The train phase, lever by lever"). So on CPU the grouped kernel, in fp32 up to
FP32_QUERIES query tokens. The maths is the same attention; fp32 is the more precise of the two. Anything
else (a GPU, a paged cache, position biases) goes to transformers' own.
"""

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "alignment_sdpa"  # the attn_implementation models.load_model switches transformers' "sdpa" to
FP32_QUERIES = 128  # on CPU, attention over at most this many query tokens runs in fp32


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs):
    """query (B, H, L, D), key and value (B, H_kv, S, D) -> ((B, L, H, D), None), as transformers' SDPA attention."""
    if (query.device.type != "cpu" or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    length = query.shape[2]
    # as transformers decides it: the kernel's own causal mask when no mask is given (the prompt's forward)
    causal = length > 1 and attention_mask is None and (getattr(module, "is_causal", True) if is_causal is None
                                                         else is_causal)
    if causal and key.shape[2] > length:  # an empty static cache's prefill: the kernel's mask is top-left aligned
        key, value = key[:, :, :length], value[:, :, :length]
    # the dtype transformers' call would compute and return in: under autocast the autocast dtype (rotary embeddings
    # leave queries and keys in fp32), else the model's
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    compute = torch.float32 if length <= FP32_QUERIES else dtype
    with torch.autocast("cpu", enabled=False):
        out = torch.nn.functional.scaled_dot_product_attention(
            query.to(compute), key.to(compute), value.to(compute), attn_mask=attention_mask, dropout_p=dropout,
            scale=scaling, is_causal=causal, enable_gqa=query.shape[1] != key.shape[1])
    return out.to(dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as transformers builds for "sdpa"


def use_in(model):
    """`model` (loaded with transformers' SDPA attention) runs this one from now on; a model that runs another
    attention (eager, flash) or does not take its attention from transformers' interface keeps its own."""
    if model.config._attn_implementation == "sdpa" and model.is_backend_compatible():
        model.set_attn_implementation(NAME)
    return model
