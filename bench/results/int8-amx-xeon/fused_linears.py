"""Measured 2026-12-07, 2 cores of an Intel Xeon (AMX), nothing else running: each of 28 layers' prepacked
weights (random, the 1.5B's shapes) in a 512-row pass, q/k/v as three matmuls against one, gate/up as two against
one; three rounds printed. `.venv/bin/python bench/results/int8-amx-xeon/fused_linears.py`
Result: sep_attn 52-55 ms, fus_attn 48-49 ms; sep_mlp 317-359 ms, fus_mlp 326-344 ms."""
import torch,time
torch.set_num_threads(2)
torch.manual_seed(0)
L=28; n=512; H=1536; I=8960; KV=256
def pack(w): return torch.ops.mkldnn._reorder_linear_weight(w, n)
def lin(x,p,b=None): return torch.ops.mkldnn._linear_pointwise(x,p,b,"none",[],"")
ws=[]
for l in range(L):
    q=torch.randn(H,H,dtype=torch.bfloat16)*.02; k=torch.randn(KV,H,dtype=torch.bfloat16)*.02; v=torch.randn(KV,H,dtype=torch.bfloat16)*.02
    g=torch.randn(I,H,dtype=torch.bfloat16)*.02; u=torch.randn(I,H,dtype=torch.bfloat16)*.02
    ws.append(dict(q=pack(q),k=pack(k),v=pack(v),g=pack(g),u=pack(u),qkv=pack(torch.cat([q,k,v])),gu=pack(torch.cat([g,u]))))
    del q,k,v,g,u
x=torch.randn(n,H,dtype=torch.bfloat16)
def sep_attn():
    for w in ws: lin(x,w["q"]);lin(x,w["k"]);lin(x,w["v"])
def fus_attn():
    for w in ws: lin(x,w["qkv"])
def sep_mlp():
    for w in ws: lin(x,w["g"]);lin(x,w["u"])
def fus_mlp():
    for w in ws: lin(x,w["gu"])
for rep in range(3):
    for f,fl in ((sep_attn,H*(H+2*KV)),(fus_attn,H*(H+2*KV)),(sep_mlp,2*H*I),(fus_mlp,2*H*I)):
        f(); t=time.perf_counter(); f(); dt=time.perf_counter()-t
        print(rep,f.__name__, f"{dt*1000:.1f} ms", f"{2*n*fl*L/dt/1e9:.0f} GFLOP/s")
