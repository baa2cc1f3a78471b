"""What a fresh process pays on its first training step, and what the stored plans and fused-or-split
decisions save: the converted torchvision model (amp-fp16, channels-last, SGD momentum) takes its first
and second uncaptured steps in three child processes sharing one new cache directory:
cold (nothing stored), warm (plans and decisions from disk), and warm plans with the decisions
deleted (each fused-or-split pair timed again). Prediction: warm reads every decision (none timed)
and its first step is several times faster than cold's.

    python benchmarks/probes/probe_warm_start.py [--model resnet50] [--batch 64]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, os
sys.path.insert(0, os.path.join(sys.argv[3], "benchmarks", "probes"))
import torch, torch.nn.functional as F
from common import converted
import fusekit
from fusekit import dispatch
from fusekit.tensors import library

timed = []
ad = type(library("torch"))
orig = ad.device_ms
def counting(self, fn, reps=5):
    timed.append(1)
    return orig(self, fn, reps)
ad.device_ms = counting
_, model, data = converted(sys.argv[1], int(sys.argv[2]))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
gs = torch.amp.GradScaler("cuda", init_scale=2.0**10)
ms = []
for _ in range(3):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.cross_entropy(model(data.x), data.y)
    opt.zero_grad(set_to_none=True)
    gs.scale(loss).backward()
    gs.step(opt)
    gs.update()
    torch.cuda.synchronize()
    ms.append((time.perf_counter() - t0) * 1e3)
st = fusekit.default_cache().stats
print(json.dumps(dict(ms=ms, decisions=len(dispatch.FUSION_TIMES), device_ms_calls=len(timed), builds=st.builds, disk_hits=st.disk_hits)))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=None, help="(ignored; device_run.sh passes it to benchmarks)")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cache = tempfile.mkdtemp(prefix="fk-warm-")
    env = dict(os.environ, FUSEKIT_CACHE_DIR=cache)
    rows = []
    for name in ("cold", "warm", "warm plans, decisions deleted"):
        if name.startswith("warm plans"):
            shutil.rmtree(os.path.join(cache, "fusion"), ignore_errors=True)
        r = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.batch), root], env=env, capture_output=True, text=True, timeout=400)
        if r.returncode != 0:
            print(f"{name}: failed\n{r.stderr[-2000:]}")
            return
        d = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append((name, d))
        print(f"{args.model} b{args.batch} amp-fp16, {name}: first step {d['ms'][0]:.0f} ms, second {d['ms'][1]:.1f}, third {d['ms'][2]:.1f}; "
              f"{d['decisions']} decisions in memory, device_ms calls {d['device_ms_calls']}, plan builds {d['builds']}, disk hits {d['disk_hits']}", flush=True)
    n = sum(1 for _ in os.scandir(os.path.join(cache, "fusion")) if True) if os.path.isdir(os.path.join(cache, "fusion")) else 0
    print(f"stored decision directories: {n}")
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
