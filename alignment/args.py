"""Flat config dataclasses for each script, and the one helper that turns them into `--flags`.

Each field has a default and a one-line `help`; cross-field checks live in `check()` and run right after
parsing, so a bad combination fails before any model is loaded. transformers' HfArgumentParser does the
dataclass -> argparse work (bools become `--flag` / `--no_flag`).
"""

from dataclasses import asdict, dataclass, field

from transformers import HfArgumentParser


def arg(default, help: str):
    return field(default=default, metadata={"help": help})


def parse(cls, argv=None):
    """Parse argv into `cls`, run its cross-field check, and exit with one clear sentence if it fails."""
    parser = HfArgumentParser(cls)
    parser.description = cls.__doc__
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    try:
        args.check()
    except ValueError as e:
        parser.error(str(e))
    return args


def to_dict(args) -> dict:
    return asdict(args)


@dataclass
class RolloutArgs:
    """Options of the rollout modes, shared by evaluation and RL (each mode reads only its own)."""

    rollout_mode: str = arg("standard", "standard (one long chain of thought), delethink (chunked, Markovian) or tir (tool-integrated)")
    delethink_chunk_size: int = arg(8192, "delethink: new tokens in the first chunk (C)")
    delethink_carryover: int | None = arg(None, "delethink: tokens carried into the next chunk (m; default C/2); later chunks get C - m new tokens")
    delethink_keep_head: int = arg(100, "delethink: tokens from the start of the first chunk kept in every carryover")
    delethink_max_turns: int = arg(5, "delethink: most chunks per trace (I)")
    max_tool_calls: int = arg(1, "tir: most code executions per response (C; ToRL uses 1)")
    tool_timeout: float = arg(5.0, "tir: seconds one code execution may run")
    mask_observations: bool = arg(True, "tir: give tool output tokens loss mask 0 (--no_mask_observations for the ablation)")
    tir_reward_scheme: str = arg("plus_minus_one", "tir: plus_minus_one (+1 right, -1 wrong, as ToRL) or zero_one")
    exec_penalty: float = arg(0.0, "tir: reward subtracted from a response whose code failed to run (ToRL ablation: 0.5)")

    def check_rollout(self):
        if self.rollout_mode not in ("standard", "delethink", "tir"):
            raise ValueError(f"--rollout_mode {self.rollout_mode!r} is not one of standard, delethink, tir.")
        carryover = self.delethink_carryover if self.delethink_carryover is not None else self.delethink_chunk_size // 2
        if not self.delethink_keep_head <= carryover < self.delethink_chunk_size:
            raise ValueError("delethink needs keep_head <= carryover < chunk_size; lower --delethink_keep_head "
                             "or --delethink_carryover, or raise --delethink_chunk_size.")


@dataclass
class EvalArgs(RolloutArgs):
    """Measure a model on GSM8K or a MATH-style set: format, answer and overall reward; pass@k, maj@k."""

    model: str = arg("smollm2-135m", "hub id, local HF folder (e.g. checkpoints/math_sft) or smollm2-135m (packaged, offline)")
    dataset: str = arg("gsm8k", "gsm8k, math500, aime24, aime25, amc23 or olympiadbench")
    split: str = arg("test", "dataset split (MATH-style sets only have test)")
    data_dir: str | None = arg(None, "data folder (default $ALIGNMENT_DATA_DIR, else dataset/)")
    prompt: str = arg("r1_zero", "prompt template in alignment/prompts: r1_zero or question_only")
    chat_template: bool = arg(False, "wrap the filled prompt in the tokenizer's chat template (instruct models)")
    limit: int | None = arg(None, "evaluate the first N problems (default: all on GPU, 100 on CPU); 0 means all")
    n_samples: int = arg(1, "completions per problem; k > 1 adds pass@k and maj@k")
    temperature: float = arg(0.0, "sampling temperature; 0 is greedy")
    top_p: float = arg(1.0, "nucleus sampling mass")
    max_tokens: int = arg(256, "maximum generated tokens per completion (the reference setup uses 1024)")
    batch_size: int = arg(32, "sequences per forward batch (HF backend)")
    backend: str = arg("auto", "auto (vLLM if installed and CUDA present, else HF), hf or vllm")
    device: str | None = arg(None, "device for the model (default cuda if available, else cpu)")
    seed: int = arg(0, "sampling seed")
    output_dir: str | None = arg(None, "where to write results.jsonl and summary.json (default outputs/eval/<model>-<dataset>-<time>)")

    def check(self):
        self.check_rollout()
        if self.n_samples < 1:
            raise ValueError("--n_samples must be at least 1.")
        if self.n_samples > 1 and self.temperature == 0:
            raise ValueError("--n_samples > 1 with --temperature 0 draws the same greedy answer k times; "
                             "set --temperature (e.g. 0.6) or --n_samples 1.")
        if self.limit is not None and self.limit < 0:
            raise ValueError("--limit must be 0 (all) or a positive number of problems.")
        if not 0 < self.top_p <= 1:
            raise ValueError("--top_p must be in (0, 1].")
        if self.max_tokens < 1:
            raise ValueError("--max_tokens must be positive.")
