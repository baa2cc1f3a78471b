import time, torch, fusekit, statistics
x = torch.randn(32,64,56,56, device='cuda', dtype=torch.float16).contiguous(memory_format=torch.channels_last)
w = torch.randn(64,64,3,3, device='cuda', dtype=torch.float16).contiguous(memory_format=torch.channels_last)
b = torch.randn(64, device='cuda', dtype=torch.float16)
out = torch.empty_like(x)
fusekit.conv_bias_relu(x,w,b,padding=1,out=out); torch.cuda.synchronize()
p = fusekit.plan_for("conv_bias_relu", x,w,b,padding=1, out=out)
print("engine", p.engine, "cands", p.candidates, "ws", p.workspace_size, "build_ms", p.build_ms)
from fusekit.ops import _FAST
c = next(iter(_FAST.values()))
ptrs=[x.data_ptr(), w.data_ptr(), b.data_ptr(), out.data_ptr()]
def t(f, n=2000):
    for _ in range(50): f()
    torch.cuda.synchronize()
    ts=[]
    for r in range(5):
        t0=time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter()-t0)/n*1e6)
        torch.cuda.synchronize()
    return statistics.median(ts)
raw = lambda: c.graph.execute(ptrs, c.workspace.ptr, handle=c.handle, tensor_uids=c.uids)
fk = lambda: fusekit.conv_bias_relu(x,w,b,padding=1,out=out)
fk2 = lambda: fusekit.conv_bias_relu(x,w,b,padding=1)
xs = x[:1]; 
small = [torch.randn(1,8,8,8,device='cuda',dtype=torch.float16).contiguous(memory_format=torch.channels_last), torch.randn(8,8,3,3,device='cuda',dtype=torch.float16).contiguous(memory_format=torch.channels_last), torch.randn(8,device='cuda',dtype=torch.float16)]
so = torch.empty_like(small[0])
fusekit.conv_bias_relu(*small, padding=1, out=so)
c2 = [v for v in _FAST.values()][-1]
sp=[a.data_ptr() for a in small]+[so.data_ptr()]
print("small raw us", t(lambda: c2.graph.execute(sp, c2.workspace.ptr, handle=c2.handle, tensor_uids=c2.uids)))
print("small fusekit out us", t(lambda: fusekit.conv_bias_relu(*small, padding=1, out=so)))
print("small fusekit alloc us", t(lambda: fusekit.conv_bias_relu(*small, padding=1)))
import cProfile, pstats
cProfile.run("for _ in range(3000): fusekit.conv_bias_relu(*small, padding=1, out=so)", "/tmp/prof")
pstats.Stats("/tmp/prof").sort_stats("tottime").print_stats(12)
