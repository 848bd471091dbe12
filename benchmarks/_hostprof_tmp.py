import cProfile, pstats, io, time, sys, torch
sys.path.insert(0, 'benchmarks')
from common import random_list
from sparsepatch.kernels import skip
B, H, S, D = 1, 16, 4096, 128
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
lst = random_list(B, H, S, 0.05)
fn = lambda: skip.skip_attention(q, k, v, lst, -5.0)
for _ in range(5): fn()
torch.cuda.synchronize()
def host_us(f, n=300):
    torch.cuda._sleep(300_000_000)
    t0 = time.perf_counter()
    for _ in range(n): f()
    t1 = time.perf_counter(); torch.cuda.synchronize(); return (t1 - t0) / n * 1e6
print("skip_attention host us", host_us(fn))
print("dense host us", host_us(lambda: skip.attention(q, k, v)))
print("torch.empty us", host_us(lambda: torch.empty((B, S, H, D), dtype=q.dtype, device=q.device)))
torch.cuda._sleep(300_000_000)
pr = cProfile.Profile(); pr.enable()
for _ in range(300): fn()
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(s.getvalue()[-5000:])
