"""Why ``bench_kernels.py --only dense`` read D128 causal N=1K at 0.50x cuDNN (214 TFLOP/s)
while ``tune_hopper_prefill.py`` read the same launch at 335: time prefill() and the direct
Gluon launch on the same inputs, in alternation, with and without a fresh compile before."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench_kernels import bench, dense_inputs, flops  # noqa: E402

from attention_kernels import prefill  # noqa: E402
from attention_kernels.configs import num_sms  # noqa: E402
from attention_kernels.prefill_hopper import hopper_prefill_ws  # noqa: E402

LOG2E = 1.4426950408889634
for n, causal in ((1024, True), (1024, False), (2048, True)):
    b, heads, d = 16384 // n, 16, 128
    _, (qp, kp, vp), cus = dense_inputs(b, heads, n, d)
    fl = flops([n] * b, [n] * b, heads, d, causal)
    out = torch.empty_like(qp)

    def direct():
        hopper_prefill_ws(qp, kp, vp, cus, cus, out, None, causal, LOG2E / d ** 0.5,
                          block_n=128, stages=2, consumers=2, programs=num_sms(0),
                          dynamic=True)

    def served():
        return prefill(qp, kp, vp, cus, max_seqlen_q=n, max_seqlen_k=n, causal=causal)

    def served_nomax():
        return prefill(qp, kp, vp, cus, causal=causal)

    for rnd in range(3):
        for name, fn in (("prefill", served), ("prefill-no-max", served_nomax),
                         ("direct", direct)):
            fn()
            print(f"N={n} causal={causal} round {rnd} {name:15s} "
                  f"{fl / bench(fn) / 1e9:7.1f} TFLOP/s", flush=True)
