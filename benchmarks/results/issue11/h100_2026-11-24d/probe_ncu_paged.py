"""Diagnostic (kept as the record of what ran): the split kernels of a contiguous and a paged
(64-token pages, identity table) decode at 1 x 4K, 32q/8kv x 128 bf16, as CUDA-graph callers
launch them (``for_cuda_graphs``: PDL merge), for ``ncu``:

    ncu --kernel-name _decode_split_kernel --launch-skip 4 --launch-count 2 --set full \
        --cache-control none python probe_ncu_paged.py
"""
import torch

from attention_kernels import decode, for_cuda_graphs, paged_decode

H, HK, D, CTX, PAGE = 32, 8, 128, 4096, 64
q = torch.randn(1, H, D, dtype=torch.bfloat16, device="cuda")
k = torch.randn(CTX, HK, D, dtype=torch.bfloat16, device="cuda")
v = torch.randn_like(k)
cu = torch.tensor([0, CTX], dtype=torch.int32, device="cuda")
lens = torch.tensor([CTX], dtype=torch.int32, device="cuda")
table = torch.arange(CTX // PAGE, dtype=torch.int32, device="cuda").view(1, -1)
kp, vp = k.view(-1, PAGE, HK, D), v.view(-1, PAGE, HK, D)
with for_cuda_graphs():
    for _ in range(3):  # launches 0-3 compile and warm; 4 (contiguous) and 5 (paged) profiled
        decode(q, k, v, cu)
        paged_decode(q, kp, vp, table, lens)
torch.cuda.synchronize()
