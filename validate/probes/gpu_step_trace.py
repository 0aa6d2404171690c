"""Time and trace single-GPU training steps of the small GPT of ``collsim validate step``
(:func:`collsim.validate.measure.step_model.build_gpt`) at sizes where a GPU is busy, in bf16
with AdamW, and write what a run of collsim needs to compare with them: the median step time
and the allocator's peaks (``<out>/gpu_step.json``, written after each size), and a Kineto
trace of three steps per size (``<out>/trace_<name>.json.gz``, CPU and CUDA activities,
shapes), which ``collsim validate trace --scenario`` reads.

    PYTHONPATH=$PWD python validate/probes/gpu_step_trace.py --out DIR

The sizes and the scenarios that describe them: validate/data/h200/README.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from collsim.validate.measure.step_model import StepConfig, build_gpt, rank_batch  # noqa: E402

#: name -> (layers, hidden, heads, ffn, seq, vocab, micro-batch)
SIZES = {
    "h2048": (8, 2048, 16, 8192, 2048, 32768, 4),
    "h1024": (8, 1024, 8, 4096, 1024, 32768, 8),
    "tiny": (2, 64, 2, 256, 32, 256, 2),  # a check of the script on a CPU (--device cpu)
}


def run_size(torch: Any, name: str, shape: tuple[int, ...], args: argparse.Namespace) -> dict:
    """Time ``args.iters`` steps of one size after ``args.warmup``, then trace
    ``args.trace_steps`` more; the size's row of the report."""
    layers, hidden, heads, ffn, seq, vocab, mb = shape
    cfg = StepConfig(
        num_layers=layers,
        hidden=hidden,
        num_heads=heads,
        ffn_hidden=ffn,
        seq_len=seq,
        vocab=vocab,
        micro_batch=mb,
    )
    torch.manual_seed(0)
    model = build_gpt(torch, cfg).to(args.device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    idx, tgt = rank_batch(torch, cfg, 0, args.device)

    def step() -> float:
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    for _ in range(args.warmup):
        step()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    losses = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        losses.append(step())  # float(): waits for the step's kernels
        times.append(time.perf_counter() - t0)
    stats = torch.cuda.memory_stats() if cuda else {}
    prof = torch.profiler
    trace = Path(args.out) / f"trace_{name}.json"
    activities = [prof.ProfilerActivity.CPU] + ([prof.ProfilerActivity.CUDA] if cuda else [])
    with prof.profile(activities=activities, record_shapes=True) as p:
        for i in range(args.trace_steps):
            with prof.record_function(f"ProfilerStep#{i}"):
                step()  # float(loss) waits for the step's kernels inside the annotation
    p.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    params = sum(p.numel() for p in model.parameters())
    return {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "ffn_hidden": ffn,
        "seq_len": seq,
        "vocab": vocab,
        "micro_batch": mb,
        "params": params,
        "dtype": "bf16 parameters, gradients and AdamW states (no fp32 master copy)",
        "iters": args.iters,
        "warmup": args.warmup,
        "step_times_s": [round(t, 7) for t in times],
        "median_step_s": round(statistics.median(times), 7),
        "losses": [round(x, 5) for x in losses],
        "peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
        "peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0),
        "trace": trace.name + ".gz",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--trace-steps", type=int, default=3)
    ap.add_argument("--sizes", default="h2048,h1024")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    import torch

    Path(args.out).mkdir(parents=True, exist_ok=True)
    report: dict = {
        "torch": str(torch.__version__),
        "cuda": str(torch.version.cuda),
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "measured_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sizes": {},
    }
    for name in args.sizes.split(","):
        report["sizes"][name] = run_size(torch, name, SIZES[name], args)
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the size's model and states went with run_size
        row = report["sizes"][name]
        print(
            f"{name}: {row['params'] / 1e6:.1f} M params, step {row['median_step_s'] * 1e3:.2f} ms"
            f" (median of {args.iters}), peak allocated {row['peak_allocated_bytes'] / 2**30:.2f}"
            f" GiB, reserved {row['peak_reserved_bytes'] / 2**30:.2f} GiB",
            flush=True,
        )
        (Path(args.out) / "gpu_step.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
