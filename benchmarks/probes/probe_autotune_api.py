"""Probe of the frontend 1.32 plan APIs fusekit's autotuner and disk cache use (run on the GPU)."""
import time, statistics, traceback
import torch, cudnn
import fusekit
from fusekit.engine import lower
from fusekit import tensors
from fusekit.engine.runtime import RUNTIME

def cl(t): return t.contiguous(memory_format=torch.channels_last)
x = cl(torch.randn(32, 64, 56, 56, device="cuda", dtype=torch.float16))
w = cl(torch.randn(256, 64, 1, 1, device="cuda", dtype=torch.float16) * 0.1)
b = torch.randn(256, device="cuda", dtype=torch.float16)
y = cl(torch.empty(32, 256, 56, 56, device="cuda", dtype=torch.float16))
pat = fusekit.get_pattern("conv_bias_relu")
S = tensors.TensorSpec.build
specs = {"x": S(tuple(x.shape), "float16", 0, "NHWC"), "w": S(tuple(w.shape), "float16", 0, "NHWC"),
         "b": S((1, 256, 1, 1), "float16", 0, "NCHW"), "y": S(tuple(y.shape), "float16", 0, "NHWC")}
attrs = dict(pat.normalize_attrs({}))
ad = tensors.library("torch")
stream = ad.stream(0)
h = RUNTIME.handle(ad, 0, stream)
L = lower.lower(pat, specs, attrs, handle=h)
g = L.graph
t0 = time.perf_counter()
g.validate(); g.build_operation_graph()
g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
print("plans A+B+FALLBACK:", g.get_execution_plan_count(), f"{(time.perf_counter()-t0)*1e3:.1f} ms")
try:
    g.check_support()
except Exception as e:
    print("check_support:", e)
t0 = time.perf_counter()
try:
    g.build_plans(cudnn.build_plan_policy.ALL)
except Exception as e:
    print("build_plans ALL error", repr(e))
print(f"build ALL {(time.perf_counter()-t0)*1e3:.1f} ms")
n = g.get_execution_plan_count()
ws_max = 0
bufs = [x, w, b, y]
ws = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
res = []
for i in range(n):
    try:
        name = g.get_plan_name_at_index(i)
        wsz = g.get_workspace_size_plan_at_index(i)
        eng = g.get_engine_and_knobs_at_index(i)
        y.fill_(float("nan"))
        g.execute_plan_at_index(bufs, ws, i, h, tensor_uids=L.uids)
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(y).all())
        ts = []
        for r in range(7):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(); 
            for _ in range(5): g.execute_plan_at_index(bufs, ws, i, h, tensor_uids=L.uids)
            e1.record(); e1.synchronize(); ts.append(e0.elapsed_time(e1) / 5 * 1e3)
        res.append((statistics.median(ts), i, name, wsz, eng, ok))
    except Exception as e:
        res.append((float("inf"), i, repr(e)[:120], -1, None, False))
res.sort()
for r in res[:6] + res[-3:]:
    print("  %.1f us idx %d %s ws=%s eng=%s finite=%s" % r)
try:
    print("notes idx0", g.get_behavior_notes_for_plan_at_index(0))
except Exception as e:
    print("notes err", e)
# select best, serialize, deserialize into fresh graph
best = res[0][1]
g.build_plan_at_index(best)
t0 = time.perf_counter(); blob = g.serialize(as_bytes=True); print("serialize", len(blob), "bytes", f"{(time.perf_counter()-t0)*1e3:.2f} ms", type(blob))
g.execute(bufs, ws, handle=h, tensor_uids=L.uids); torch.cuda.synchronize(); ref = y.clone()
t0 = time.perf_counter()
g2 = cudnn.pygraph(handle=h)
g2.deserialize(h, blob)
print(f"deserialize {(time.perf_counter()-t0)*1e3:.2f} ms")
try:
    print("g2 workspace", g2.get_workspace_size())
except Exception as e:
    print("g2 ws err", repr(e))
y.fill_(float("nan"))
try:
    g2.execute(bufs, ws, handle=h, tensor_uids=L.uids); torch.cuda.synchronize()
    print("g2 ordered exec equal:", bool(torch.equal(y, ref)))
except Exception as e:
    traceback.print_exc()
# replay engine+knobs on a fresh lowered graph
eng_id, knobs = res[0][4]
L3 = lower.lower(pat, specs, attrs, handle=h)
g3 = L3.graph
t0 = time.perf_counter()
try:
    g3.validate(); g3.build_operation_graph()
    g3.create_execution_plan(eng_id, knobs)
    k = g3.get_execution_plan_count() - 1
    g3.build_plan_at_index(k)
    print(f"replay engine {eng_id} knobs {knobs}: {(time.perf_counter()-t0)*1e3:.1f} ms, name {g3.get_plan_name_at_index(k)}")
    y.fill_(float("nan")); g3.execute(bufs, ws, handle=h, tensor_uids=L3.uids); torch.cuda.synchronize()
    print("g3 equal:", bool(torch.equal(y, ref)))
except Exception as e:
    traceback.print_exc()
# filters
L4 = lower.lower(pat, specs, attrs, handle=h); g4 = L4.graph
g4.validate(); g4.build_operation_graph(); g4.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
try:
    g4.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC]); g4.deselect_workspace_greater_than(0)
    g4.build_plans(cudnn.build_plan_policy.ALL)
    print("filtered count", g4.get_execution_plan_count())
    ok=[]
    for i in range(g4.get_execution_plan_count()):
        try: ok.append((i, g4.get_workspace_size_plan_at_index(i)))
        except Exception as e: ok.append((i, repr(e)[:60]))
    print("filtered ws", ok[:8])
except Exception as e:
    traceback.print_exc()
