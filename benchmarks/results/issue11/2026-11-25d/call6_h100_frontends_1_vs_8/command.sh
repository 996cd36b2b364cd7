set -u
rm -rf /tmp/r5; mkdir -p /tmp/r5
(timeout 200 bash benchmarks/gpu_checks.sh /tmp/r5 >/tmp/r5/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > /tmp/r5/gpu.txt
timeout 120 python3 benchmarks/bench_sessions.py --sides on --clients 1 --duration 2 --warmup 1 --out /tmp/r5/settle > /tmp/r5/settle.log 2>&1
for round in 1 2; do
  for fe in 1 8; do
    echo "=== frontends $fe round $round"
    timeout 150 python3 benchmarks/bench_sessions.py --frontends $fe --sides on --clients 1,64 --duration 5 --warmup 2 --out /tmp/r5/fe${fe}_$round > /tmp/r5/fe${fe}_$round.log 2>&1
    grep -E "^\| sessions|echo p50" /tmp/r5/fe${fe}_$round.log
  done
done
