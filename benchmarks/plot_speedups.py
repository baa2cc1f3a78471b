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
values = [r["speedup"] for r in train] + [r["speedup"] for r in norm]
fig, ax = plt.subplots(figsize=(8, 0.32 * len(values) + 1.2))
ax.barh(range(len(values)), values, color=["tab:blue" if v >= 1 else "tab:red" for v in values])
ax.axvline(1.0, color="k", lw=0.8)
ax.axvline(1.2, color="gray", ls="--", lw=0.8, label="1.2x target (training steps)")
ax.set_yticks(range(len(values)), labels, fontsize=7)
ax.invert_yaxis()
ax.set_xlabel("speed-up over PyTorch eager (both in CUDA graphs)")
ax.legend(fontsize=7, loc="lower right")
ax.set_title("fusekit on H200: training steps and batch-norm pieces", fontsize=9)
fig.tight_layout()
fig.savefig(root / "NVIDIA-H200-train-norm-speedup.png", dpi=110)
print(root / "NVIDIA-H200-train-norm-speedup.png")
