import time, numpy as np, os, sys
from mori.umbp import Client
size=int(sys.argv[1]) if len(sys.argv)>1 else 4<<20
B=16; n=64
c=Client(dram_bytes=2<<30)
rng=np.random.default_rng()
base=rng.integers(0,256,size,dtype=np.uint8).tobytes()
keys=[f"k{i}".encode() for i in range(n)]
vals=[i.to_bytes(8,'little')+base[8:] for i in range(n)]
for k,v in zip(keys,vals): c.put(k,v)
def t(f, reps=5):
    best=[]
    for _ in range(reps):
        t0=time.perf_counter(); f(); best.append(time.perf_counter()-t0)
    return n*size/np.median(best)/1e9
def batch():
    for i in range(0,n,B): got=c.batch_get(keys[i:i+B])
def singles_kept():
    for i in range(0,n,B): got=[c.get(k) for k in keys[i:i+B]]
def singles():
    for k in keys: got=c.get(k)
srcs=[np.frombuffer(v,dtype=np.uint8) for v in vals]
def np_kept():
    for i in range(0,n,B): got=[s.tobytes() for s in srcs[i:i+B]]
for name,f in [("batch",batch),("singles_kept",singles_kept),("singles",singles),("numpy tobytes kept",np_kept),("batch",batch)]:
    print(f"{name:20s} {t(f):6.2f} GB/s")
