"""Bar chart of the training and batch-norm speed-ups over PyTorch eager, from the committed JSON.

    python benchmarks/plot_speedups.py [benchmarks/results]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

root = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
train = json.loads((root / "NVIDIA-H200-train.json").read_text())["rows"]
norm = json.loads((root / "NVIDIA-H200-norm.json").read_text())["rows"]
labels = [r["case"].replace("conv+bias+relu block ", "block ") for r in train]
labels += [f"{r['case']} C={r['C']} {r['H']}x{r['H']}" for r in norm]
# training steps: fusekit's heuristic plans against eager's default (cudnn.benchmark off; upper bar) and
# fusekit autotuned against eager with cudnn.benchmark (lower bar)
values = [r.get("default_speedup", r["speedup"]) for r in train] + [r["speedup"] for r in norm]
tuned = [r.get("autotuned_speedup") for r in train]
fig, ax = plt.subplots(figsize=(8, 0.32 * len(values) + 1.2))
colors = ["tab:blue" if v >= 1 else "tab:red" for v in values]
ax.barh([i - (0.2 if i < len(tuned) and tuned[i] else 0) for i in range(len(values))], values, color=colors,
        height=[0.4 if i < len(tuned) and tuned[i] else 0.8 for i in range(len(values))], label="heuristic plans (training steps: vs eager with cudnn.benchmark off)")
at = [(i, v) for i, v in enumerate(tuned) if v]
ax.barh([i + 0.2 for i, _ in at], [v for _, v in at], height=0.4, color=["tab:cyan" if v >= 1 else "tab:orange" for _, v in at],
        label="autotuned (training steps: vs eager with cudnn.benchmark on)")
ax.axvline(1.0, color="k", lw=0.8)
ax.axvline(1.2, color="gray", ls="--", lw=0.8, label="1.2x target (training steps)")
ax.set_yticks(range(len(values)), labels, fontsize=7)
for i, v in at:
    ax.text(v + 0.02, i + 0.2, f"{v:.2f}", va="center", fontsize=6)
ax.invert_yaxis()
ax.set_xlabel("speed-up over PyTorch eager (both in CUDA graphs)")
ax.legend(fontsize=7, loc="lower right")
ax.set_title("fusekit on H200: training steps and batch-norm pieces", fontsize=9)
fig.tight_layout()
fig.savefig(root / "NVIDIA-H200-train-norm-speedup.png", dpi=110)
print(root / "NVIDIA-H200-train-norm-speedup.png")
