set -u
rm -rf /tmp/r8; mkdir -p /tmp/r8
(timeout 200 bash benchmarks/gpu_checks.sh /tmp/r8 >/tmp/r8/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > /tmp/r8/gpu.txt
rm -rf /tmp/baseline-tree && mkdir -p /tmp/baseline-tree && git archive 8091d8f | tar x -C /tmp/baseline-tree
timeout 520 python3 benchmarks/bench_roundtrip.py --tokens 8192 --heads 16 --head-dim 128 --frontends 8 --clients 8,16 --iters 5 --agg-seconds 6 --baseline-tree /tmp/baseline-tree --out /tmp/r8 > /tmp/r8/roundtrip_baseline.log 2>&1
echo rc=$?
grep -iE "aggregate|baseline|GB/s|x " /tmp/r8/roundtrip_baseline.log | tail -40
