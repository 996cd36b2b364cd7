"""Dump the PTX and register counts of the decode split kernels that contiguous and paged decode
(64-token pages, bench_paged's shuffled pool) compile at 8 x 8K keys, 32q/8kv x 128 bf16.
Kept as the record of call 3 (run from benchmarks/, OUT_DIR as the only argument)."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paged import cu, paged_copy

from attention_kernels import decode, paged_decode
from attention_kernels import decode_kernel as dk

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
b, n, d = 8, 8192, 128
q = torch.randn(b, 32, d, dtype=torch.bfloat16, device="cuda")
k = torch.randn(b * n, 8, d, dtype=torch.bfloat16, device="cuda")
v = torch.randn_like(k)
kp, vp, table, lens = paged_copy(k, v, [n] * b, 64, torch.Generator().manual_seed(0))
decode(q, k, v, cu([n] * b, q.device), max_seqlen_k=n)  # compiles split_0 (contiguous)
paged_decode(q, kp, vp, table, lens, max_seqlen_k=n)  # compiles split_1 (paged)
torch.cuda.synchronize()
info = []
for caches in dk._decode_split_kernel.device_caches.values():
    for kern in caches[0].values():
        name = f"split_{len(info)}"
        (out / f"{name}.ptx").write_text(kern.asm["ptx"])
        info.append({"name": name, "n_regs": kern.n_regs, "n_spills": kern.n_spills,
                     "shared": kern.metadata.shared})
(out / "kernels.json").write_text(json.dumps(info, indent=1))
print(json.dumps([(i["name"], i["n_regs"], i["n_spills"], i["shared"]) for i in info]))
