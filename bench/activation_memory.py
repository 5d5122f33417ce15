"""Activation checkpointing on the example model: the memory it saves and the time it costs, side by side.

    python bench/activation_memory.py [--size medium] [--batch 2] [--steps 3] [--rounds 2] [--device cpu|cuda]

The model is ``examples/gptlm``'s GPT (``--size``, its ``SIZES``), each ``Block`` checkpointed with the trainer's
option (:mod:`disttrain.trainer.activation`) or not. Each configuration runs in a fresh process, alternately
(``--rounds`` pairs, so both see the same machine load), one warm-up step and ``--steps`` timed steps of forward,
backward and an SGD step on the same batches. Per step it measures:

* ``peak``: the step's peak memory above the memory held before its forward (parameters and gradients), i.e. the
  activations kept for the backward plus the backward's temporaries. CPU: peak RSS (``VmHWM``, reset through
  ``/proc/self/clear_refs``) with glibc's mmap threshold at 64 KiB, so a freed tensor leaves the RSS at once;
  CUDA: ``max_memory_allocated``.
* ``saved``: the bytes the autograd graph saves for the backward outside checkpointed regions (a
  ``saved_tensors_hooks`` count; checkpointed blocks keep only their inputs, which this count does not see).
* the step time (median), and a digest of the first step's gradients, equal in both configurations.

Prints one JSON line per configuration and round, then ``peak_memory_ratio``, ``saved_bytes_ratio`` and
``step_time_ratio`` (with / without checkpointing) and ``gradients_equal``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _gptlm():
    spec = importlib.util.spec_from_file_location("gptlm_example", REPO / "examples" / "gptlm" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(args: argparse.Namespace) -> dict:
    """One configuration in this process: the per-step figures as a dict."""
    import torch

    from disttrain.trainer import activation

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    gpt = _gptlm()
    d_model, layers, heads, block = gpt.SIZES[args.size]
    device = torch.device(args.device)
    torch.manual_seed(0)
    vocab = 96
    model = gpt.GPT(vocab, d_model, layers, heads, block).to(device)
    if args.checkpointing:
        activation.apply(model, gpt.Block)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (args.batch, block + 1), generator=gen) for _ in range(args.steps + 1)]
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    peaks, times, saveds, digest = [], [], [], ""
    for i, tokens in enumerate(batches):
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            before = _rss_kib("VmRSS") * 1024
        saved = 0
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), reduction="sum")
        loss.backward()
        if i == 0:
            h = hashlib.sha256()
            for p in model.parameters():
                assert p.grad is not None
                h.update(p.grad.detach().cpu().numpy().tobytes())
            digest = h.hexdigest()[:16]
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: part of "before", not of the peak
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            peak = _rss_kib("VmHWM") * 1024 - before
        elapsed = time.perf_counter() - start
        if i > 0:  # the first step allocates the gradients and warms up
            peaks.append(peak)
            times.append(elapsed)
            saveds.append(saved)
    return {
        "checkpointing": args.checkpointing,
        "peak_mb": statistics.median(peaks) / 2**20,
        "saved_mb": statistics.median(saveds) / 2**20,
        "step_s": statistics.median(times),
        "grad_digest": digest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", help="examples/gptlm's SIZES: small, medium, large")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    env.setdefault("OMP_NUM_THREADS", "2")
    common = ["--size", args.size, "--batch", str(args.batch), "--steps", str(args.steps), "--device", args.device]
    results: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.rounds):
        for checkpointing in (False, True):
            cmd = [sys.executable, __file__, "--child", *common] + (["--checkpointing"] if checkpointing else [])
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            results[checkpointing].append(row)

    def median(checkpointing: bool, key: str) -> float:
        return statistics.median(r[key] for r in results[checkpointing])

    digests = {r["grad_digest"] for rows in results.values() for r in rows}
    print(f"peak_memory_mb: {median(False, 'peak_mb'):.1f} -> {median(True, 'peak_mb'):.1f}")
    print(f"peak_memory_ratio: {median(True, 'peak_mb') / median(False, 'peak_mb'):.3f}")
    print(f"saved_bytes_ratio: {median(True, 'saved_mb') / median(False, 'saved_mb'):.3f}")
    print(f"step_time_s: {median(False, 'step_s'):.3f} -> {median(True, 'step_s'):.3f}")
    print(f"step_time_ratio: {median(True, 'step_s') / median(False, 'step_s'):.3f}")
    print(f"gradients_equal: {len(digests) == 1}")


if __name__ == "__main__":
    main()
