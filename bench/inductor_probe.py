"""Which settings let the static sampler's decode step compile on this GPU (a diagnosis, one process each).

On the H200 pass of 2026-12-04 (torch 2.11) the compiled decode step failed in inductor's Triton code generation
(`get_block_shape`: `TypeError: list indices must be integers or slices, not NoneType`) on a SplitScan: the CDF's
float64 cumsum over the vocabulary, which inductor splits on CUDA. A compiled draw_tokens now sums in scans of at
most 32 (`sampling.prefix_sum`), never split. This script compiles the static sampler on a tiny random Llama once per
candidate, each in its own process and all at once: `default` (today's code), `one_scan` (the CDF as one cumsum
again: the failure of 2026-12-04, the control), inductor settings, SDPA's math path, eager attention. For each: ok
(its tokens equal to the reference loop's) or the error, and for a failure the Triton kernel being generated.

    python3 bench/inductor_probe.py --tokenizer .gpu_pass/smollm2-135m
"""

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = {
    "default": {},
    "no_persistent_reductions": {"triton.persistent_reductions": False},
    "no_split_reductions": {"split_reductions": False},
    "no_mix_order_reduction": {"triton.mix_order_reduction": False},
    "no_fusion": {"max_fusion_size": 1},
    # not inductor settings: the CDF as one scan (the control), the attention the graph holds
    "one_scan": {"cdf": "one_scan"},
    "sdpa_math": {"sdpa": "math"},
    "eager_attention": {"attention": "eager"},
}


def kernel_report(error: BaseException) -> dict:
    """The Triton kernel and the nodes being generated when `error` was raised, read off the traceback's frames."""
    found = {}
    tb = error.__traceback__
    while tb is not None:
        frame, code = tb.tb_frame, tb.tb_frame.f_code
        me = frame.f_locals.get("self")
        if me is not None and isinstance(getattr(me, "range_trees", None), list) and "kernel" not in found:
            numels = getattr(me, "numels", None)
            found["kernel"] = {
                "class": type(me).__name__,
                "numels": {k: str(v) for k, v in numels.items()} if isinstance(numels, dict) else str(numels),
                "persistent_reduction": getattr(me, "persistent_reduction", None),
                "no_x_dim": getattr(me, "no_x_dim", None), "inside_reduction": getattr(me, "inside_reduction", None),
                "trees": [(getattr(t, "prefix", "?"), getattr(t, "tensor_dim", "?"), getattr(t, "is_reduction", "?"),
                           str(getattr(t, "numel", "?"))) for t in me.range_trees]}
        if code.co_name == "codegen_node_schedule" and "node_schedule" in frame.f_locals:
            found["nodes"] = [str(getattr(n, "get_name", lambda: n)()) for n in frame.f_locals["node_schedule"]][:20]
            found["origins"] = sorted({str(o) for n in frame.f_locals["node_schedule"] if hasattr(n, "node")
                                       for o in getattr(n.node, "origins", ())})[:40]
        if code.co_name == "load" and "index" in frame.f_locals and "name" in frame.f_locals:
            found.setdefault("load", f"{frame.f_locals['name']}[{frame.f_locals['index']}]")
        tb = tb.tb_next
    return found


def one(name: str, tokenizer_dir: str, device: str) -> dict:
    import torch
    sys.path.insert(0, str(ROOT))
    from alignment import models
    from alignment import static_sampler
    from alignment.sampling import HFSampler, SamplingParams
    from tests.conftest import build_tiny_model
    import torch._inductor.config as inductor_config
    settings = dict(CANDIDATES[name])
    sdpa, attention, cdf = settings.pop("sdpa", None), settings.pop("attention", None), settings.pop("cdf", None)
    if cdf == "one_scan":  # the draw as before 2026-12-04: one cumsum over the vocabulary
        from alignment import sampling
        sampling.prefix_sum = lambda x, block=32: x.cumsum(-1)
    if sdpa == "math":  # SDPA's fused kernels off: the math path, decomposed by inductor
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    for key, value in settings.items():  # this process's inductor settings (each candidate has its own)
        *path, last = key.split(".")
        target = inductor_config
        for part in path:
            target = getattr(target, part)
        setattr(target, last, value)
    tokenizer = models.load_tokenizer(tokenizer_dir)
    model = build_tiny_model(tokenizer).to(device)
    if attention:
        model.set_attn_implementation(attention)
    sampler = static_sampler.StaticSampler(model, tokenizer, batch_size=8, compile=True)

    class CounterReference(HFSampler):
        def _uniforms(self, seeds, device):
            return static_sampler.counter_draws(seeds, device)
    prompts, params = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16], [17]], SamplingParams(n=2, temperature=1.0,
                                                                                                max_tokens=24, seed=5)
    try:
        ours = sampler.generate(prompts, params)
    except Exception as e:
        cause = e.__cause__ or e  # the sampler's UserError wraps inductor's error
        try:
            report = kernel_report(cause)
        except Exception as broken:  # the diagnosis must not hide the error it diagnoses
            report = {"report_failed": f"{type(broken).__name__}: {broken}"}
        return {"ok": False, "error": f"{type(cause).__name__}: {str(cause)[:300]}", **report,
                "where": "".join(traceback.format_exception(cause))[-600:]}
    theirs = CounterReference(model, tokenizer, batch_size=8).generate(prompts, params)
    same = [[c.token_ids for c in g] for g in ours] == [[c.token_ids for c in g] for g in theirs]
    return {"ok": same, "compile_seconds": round(sampler.compile_seconds, 1), "same_tokens": same}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a folder with SmolLM2's tokenizer")
    parser.add_argument("--device", default="cuda", help="cuda (the diagnosis) or cpu (a dry run of this script)")
    parser.add_argument("--one", choices=sorted(CANDIDATES), help="(internal) run one option set in this process")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--timeout", type=float, default=240, help="seconds for all candidates together")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.tokenizer, args.device)))
        return
    child = [sys.executable, __file__, "--tokenizer", args.tokenizer, "--device", args.device, "--one"]
    runs = {name: subprocess.Popen([*child, name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name in CANDIDATES}
    results, deadline = {}, time.monotonic() + args.timeout
    for name, proc in runs.items():
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err = f"not done after --timeout {args.timeout:.0f}s\n{err}"
        lines = [line for line in out.splitlines() if line.startswith("{")]
        results[name] = json.loads(lines[-1]) if lines else {"ok": False, "error": err[-800:]}
        print(f"[inductor_probe] {name} {json.dumps(CANDIDATES[name])}: {json.dumps(results[name])}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
