"""LoRA policies (Hu et al. 2021) with peft: train low-rank adapters instead of every weight.

    uv run -m alignment.train_rl --lora_rank 8 --learning_rate 3e-4    # ~10x full fine-tuning's rate
    uv run -m alignment.sft --lora_rank 16 --lr 1e-3

peft does the adapters: `get_peft_model` wraps each target layer's weight W (frozen) with A (r x in) and B
(out x r, zero at the start), so the layer computes W x + (alpha / r) B A x, and freezes every other
weight. This module does the rest of what a run needs, each in one place:
- only the adapters train: the optimizer is built over `trainable_parameters` (the same list as
  `parameters()` in full fine-tuning), so AdamW keeps state for the adapters only;
- the KL reference is the policy itself with its adapters off (`frozen`): the run's start model, with no
  second copy of its weights;
- samplers with weights of their own (vLLM, an HF copy on another device) and checkpoints get the merged
  weights W + (alpha / r) B A under the base model's names (`export_items`), so they need nothing of peft;
  an HF sampler that shares the policy runs the peft model itself;
- a checkpoint holds that merged model (what `evaluate --model <run>` and another run's `--model` read)
  and the adapters in adapter/ (what `--resume` reads, on top of the run's start model: exact).

LoRA Without Regret (Schulman & Thinking Machines, 2025): with adapters on every linear layer (peft's
"all-linear", the default here), even rank 1 matches full fine-tuning in RL, at a learning rate about 10x
the full one; with alpha fixed (32) the best rate barely moves with the rank.
"""

import contextlib

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers.pytorch_utils import Conv1D

from alignment import distributed
from alignment.args import LORA_UNDER_TORCHRUN
from alignment.errors import UserError

ADAPTER_DIR = "adapter"  # inside a checkpoint: peft's adapter_config.json and adapter_model.safetensors


def add_lora(model, args, adapter_dir=None):
    """`model` with LoRA adapters on `args.lora_target_modules`, everything else frozen; `model` itself when
    `args.lora_rank` is 0. From `adapter_dir` (a checkpoint's adapter/): those adapters, trainable; else fresh
    ones, whose B = 0 makes the wrapped model compute exactly what `model` did."""
    if not args.lora_rank:
        return model
    refuse_under_torchrun(args)
    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    targets = args.lora_target_modules.strip()
    names = targets if targets == "all-linear" else [name.strip() for name in targets.split(",") if name.strip()]
    # GPT-2's layers are Conv1D (a linear layer with its weight stored in x out): peft adapts them with fan_in_fan_out
    conv1d = any(isinstance(module, Conv1D) for module in model.modules())
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=names, task_type="CAUSAL_LM", fan_in_fan_out=conv1d)
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # a target module the model does not have
        raise UserError(f"--lora_target_modules {targets}: {str(e).strip().splitlines()[0]}") from None


def check_against_config(args, config):
    """Before any weight loads: every module named in --lora_target_modules is a linear layer of this
    architecture (nn.Linear, or GPT-2's Conv1D; peft would silently skip a missing name while another matches),
    and --lora_rank is below the width of the narrowest layer it adapts. Checked on the config's skeleton on the
    meta device."""
    if not args.lora_rank:
        return
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    linear = {name: module for name, module in skeleton.get_decoder().named_modules()
              if isinstance(module, (torch.nn.Linear, Conv1D))}
    kinds = sorted({name.rsplit(".", 1)[-1] for name in linear})
    if not kinds:
        raise UserError(f"--lora_rank adapts linear layers, and {type(skeleton).__name__}'s decoder has none that "
                        f"peft adapts (nn.Linear or Conv1D): train every weight (--lora_rank 0).")
    targets = args.lora_target_modules.strip()
    wanted = kinds if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    missing = [t for t in wanted if t not in kinds]
    if missing:
        head = " (the output head is never adapted)" if "lm_head" in missing else ""
        raise UserError(f"--lora_target_modules {targets}: {', '.join(missing)} is not a linear layer of "
                        f"{type(skeleton).__name__}'s decoder{head}; its layers are {', '.join(kinds)}.")
    width = min(min(m.weight.shape) for name, m in linear.items() if name.rsplit(".", 1)[-1] in wanted)  # either layout
    if args.lora_rank >= width:
        raise UserError(f"--lora_rank {args.lora_rank} is not below the width {width} of the narrowest layer it "
                        f"adapts, so the adapters would be no low-rank update: use a rank below {width}.")


def refuse_under_torchrun(args):
    """A library call's check (the scripts refuse it when they parse their flags, before the process group)."""
    if args.lora_rank and distributed.launched():
        raise UserError(LORA_UNDER_TORCHRUN)


def is_lora(model) -> bool:
    return isinstance(model, PeftModel)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """What the optimizer holds: the adapters of a LoRA policy, every parameter of a fully trained one."""
    return [p for p in model.parameters() if p.requires_grad]


def describe(model, args) -> str:
    """For the start line: what trains, and how many of the parameters."""
    trained, total = sum(p.numel() for p in trainable_parameters(model)), sum(p.numel() for p in model.parameters())
    what = (f"LoRA rank {args.lora_rank}, alpha {args.lora_alpha}, on {args.lora_target_modules}" if is_lora(model)
            else "full fine-tuning")
    return f"{what}: {trained:,} of {total:,} parameters trained"


def adapter_switch(module) -> str | None:
    """The name of a LoRA layer inside `module` (None: it has none), for `adapters_off`: peft turns the adapters
    of a model off and on together (`frozen`), so one layer tells for all of them."""
    return next((name for name, sub in module.named_modules() if isinstance(sub, LoraLayer)), None)


def adapters_off(module, switch: str | None) -> bool:
    """Whether the adapters inside `module` are off (`switch`: its `adapter_switch`)."""
    return switch is not None and module.get_submodule(switch).disable_adapters


def frozen(model):
    """The context in which `model` computes as its frozen base: a LoRA policy with its adapters off (the
    run's start model: the KL reference for free); any other model as it is."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


@torch.no_grad()
def export_items(model):
    """(name, tensor) for every entry of the full model's state dict, one at a time: for a LoRA policy the
    merged weights W + (alpha / r) B A under the base model's own names (peft's delta, computed beside the
    policy, which is not touched); otherwise the state dict itself (gathered under FSDP)."""
    if not is_lora(model):
        yield from distributed.full_state_items(model)
        return
    base = model.get_base_model()
    adapted = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    for name, tensor in base.state_dict().items():
        if any(part.startswith("lora_") for part in name.split(".")):  # the adapters: lora_A.default.weight, ...
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer"):
            owner = owner.removesuffix(".base_layer")
            layer = adapted[owner]
            if leaf == "weight":
                tensor = tensor + sum(layer.get_delta_weight(a) for a in layer.active_adapters).to(tensor.dtype)
            name = f"{owner}.{leaf}"
        yield name, tensor


def save(model, folder):
    """A LoRA policy's checkpoint: the merged model in HF format (what `--model` and evaluation read) and the
    adapters in `ADAPTER_DIR` (what `--resume` reads)."""
    model.get_base_model().save_pretrained(folder, state_dict=dict(export_items(model)))
    model.save_pretrained(folder / ADAPTER_DIR)
