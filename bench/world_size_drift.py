"""How far a resume at another world size drifts from the uninterrupted run (the figures of docs/trainer.md).

For W = 4 -> 3, 4 -> 2 and 2 -> 4: the reference trains 12 steps at the old size, checkpointing every step; a
second run resumes from its step-4 checkpoint at the new size. Printed: the largest absolute difference of any
model parameter over steps 5-12 and of the step loss over the global batch, first with DDP's all-reduce
(``gradientReduction: ddp``, the default), then with ``ordered`` (expected: 0). Last, the final-parameter drift
of ``tests/trainer/test_exact_resume.py``'s scenario (its AdamW model, 10 steps, resumed after step 4), which
that test holds to. The scenario code is shared with the tests: ``tests/trainer/drift.py``.

    python bench/world_size_drift.py
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.trainer import drift  # noqa: E402


def main() -> None:
    began = time.time()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="world-size-drift-"))
    figures: dict[str, float] = {}
    for reduction in ("ddp", "ordered"):
        scenario = drift.Scenario(reduction=reduction)
        print(
            f"recorder MLP + SGD, gradientReduction {reduction}, {scenario.steps} steps, resumed after step "
            f"{scenario.resume_after}:",
            flush=True,
        )
        for old, new in drift.TRANSITIONS:
            d = drift.measure(scenario, old, new, workdir)
            print(
                f"  W={old} -> {new}: max |param diff| {d.max_param_diff:.3g}, max |loss diff| {d.max_loss_diff:.3g}",
                flush=True,
            )
            prefix = "" if reduction == "ddp" else "ordered_"
            figures[f"{prefix}max_param_diff_{old}_to_{new}"] = d.max_param_diff
            figures[f"{prefix}max_loss_diff_{old}_to_{new}"] = d.max_loss_diff or 0.0
    toy = drift.Scenario(worker="toy", steps=10)
    print("toy MLP + AdamW (tests/trainer/test_exact_resume.py), 10 steps, resumed after step 4:", flush=True)
    for old, new in ((4, 3), (4, 2)):
        d = drift.measure(toy, old, new, workdir)
        print(f"  W={old} -> {new}: max |param diff| {d.max_param_diff:.3g}", flush=True)
        figures[f"adamw_max_param_diff_{old}_to_{new}"] = d.max_param_diff
    print(f"bench wall time {time.time() - began:.0f}s; runs kept in {workdir}")
    for key, value in figures.items():
        print(f"{key}: {value:.3g}")


if __name__ == "__main__":
    main()
