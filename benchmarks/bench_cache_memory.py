"""Memory under a stream of new plan keys: 10,000 distinct keys through a small in-memory plan cache.

    python benchmarks/bench_cache_memory.py --out benchmarks/results [--keys 10000] [--cache-size 64] [--every 1000]

Each key is a 3x3 convolution (``--pattern conv``, the default: cuDNN's precompiled engines, a few ms
to build) or a one-node ReLU graph (``--pattern relu``: a runtime-compiled kernel per shape, about
25x slower to build) in float16, channels-last, (1, 8, H, W) with a new (H, W) each time, run once
and checked now and then, with FUSEKIT_CACHE_SIZE plans kept in
memory and no disk store. Every ``--every`` keys it samples host RSS (/proc/self/statm), device
memory in use (cudaMemGetInfo: PyTorch's pool plus what cuDNN and the driver hold), PyTorch's
allocated and reserved bytes, the plan cache's and the dispatch table's sizes. Writes
<out>/<GPU>-cache-memory.json and .md after every sample (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import time
from pathlib import Path

import torch

MiB = 1 << 20


def host_rss() -> int:
    """Resident set size of this process in bytes (/proc/self/statm: pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def shape_of(i: int, side: int) -> tuple[int, int, int, int]:
    """The i-th distinct (1, 8, H, W)."""
    return (1, 8, 2 + i // side, 2 + i % side)


def write(out: Path, stem: str, meta: dict, samples: list[dict]) -> None:
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "samples": samples}, indent=1))
    first = samples[1] if len(samples) > 1 else samples[0]  # after the first 1000 keys: warm allocator and cuDNN
    last = samples[-1]
    lines = [
        f"# Plan-cache memory under {last['keys']:,} distinct keys (FUSEKIT_CACHE_SIZE={meta['cache_size']})",
        "",
        (f"GPU {meta['gpu']}, cuDNN {meta['cudnn_backend']}, frontend {meta['frontend']}, torch {meta['torch']}; {meta['date']}. "
        f"Pattern `{meta['pattern']}` (float16, channels-last), one new (H, W) per key, disk store off."),
        "",
        "| keys | s | host RSS MiB | device used MiB | torch allocated MiB | torch reserved MiB | plans cached | dispatch entries | ms / key |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in samples:
        lines.append(
            f"| {s['keys']:,} | {s['seconds']:.1f} | {s['rss'] / MiB:.1f} | {s['device_used'] / MiB:.1f} | {s['torch_allocated'] / MiB:.1f} | "
            f"{s['torch_reserved'] / MiB:.1f} | {s['cached']} | {s['dispatch']} | {s['ms_per_key']:.2f} |"
        )
    lines += [
        "",
        (f"From {first['keys']:,} to {last['keys']:,} keys: host RSS {(last['rss'] - first['rss']) / MiB:+.1f} MiB, "
        f"device memory in use {(last['device_used'] - first['device_used']) / MiB:+.1f} MiB; "
        f"plans cached at most {max(s['cached'] for s in samples)} (limit {meta['cache_size']}), "
        f"{last['builds']:,} builds, {last['evictions']:,} evictions, max relative error vs float32 {meta['worst_error']:.1e}."),
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--cache-size", type=int, default=64)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--pattern", choices=("conv", "relu"), default="conv")
    args = ap.parse_args()
    os.environ["FUSEKIT_CACHE_SIZE"] = str(args.cache_size)
    os.environ["FUSEKIT_CACHE_DIR"] = "off"
    import fusekit
    from fusekit import dispatch

    cache = fusekit.default_cache()
    assert cache.maxsize == args.cache_size and cache.store is None
    side = max(1, int(args.keys**0.5) + 1)
    props = torch.cuda.get_device_properties(0)
    v = fusekit.engine.runtime.versions()
    meta = {
        "gpu": props.name, "cudnn_backend": v.cudnn_backend, "frontend": v.frontend, "torch": torch.__version__, "pattern": args.pattern,
        "cache_size": args.cache_size, "keys": args.keys, "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "worst_error": 0.0,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = props.name.replace(" ", "-") + "-cache-memory"
    samples: list[dict] = []
    worst, t0, last_t, last_i = 0.0, time.perf_counter(), time.perf_counter(), 0

    def sample(i: int) -> None:
        nonlocal last_t, last_i
        torch.cuda.synchronize()
        gc.collect()
        now = time.perf_counter()
        samples.append({
            "keys": i, "seconds": now - t0, "rss": host_rss(), "device_used": device_used(), "torch_allocated": torch.cuda.memory_allocated(),
            "torch_reserved": torch.cuda.memory_reserved(), "cached": len(cache), "dispatch": dispatch.resolved_calls(),
            "builds": cache.stats.builds, "evictions": cache.stats.evictions,
            "ms_per_key": (now - last_t) * 1e3 / max(1, i - last_i),
        })
        last_t, last_i = now, i
        meta["worst_error"] = worst
        write(out, stem, meta, samples)
        s = samples[-1]
        print(f"{i:6d} keys {s['seconds']:7.1f} s  rss {s['rss'] / MiB:8.1f} MiB  device {s['device_used'] / MiB:9.1f} MiB  "
              f"cached {s['cached']:4d}  dispatch {s['dispatch']:4d}  {s['ms_per_key']:.2f} ms/key", flush=True)

    w = (torch.randn(8, 8, 3, 3, device="cuda") / 8).half().contiguous(memory_format=torch.channels_last)
    for i in range(args.keys):
        x = torch.randn(shape_of(i, side), device="cuda").half().contiguous(memory_format=torch.channels_last)
        if args.pattern == "conv":
            y = fusekit.call("conv", x, w, padding=(1, 1), stride=(1, 1), dilation=(1, 1))
        else:
            y = fusekit.call("relu", x)
        if i % 97 == 0:  # a check now and then (each reads back to the host): relative error against float32
            want = torch.nn.functional.conv2d(x.float(), w.float(), padding=1) if args.pattern == "conv" else x.float().relu()
            worst = max(worst, float((y.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)))
        if i == 0 or (i + 1) % args.every == 0:
            sample(i + 1)
    print((out / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
