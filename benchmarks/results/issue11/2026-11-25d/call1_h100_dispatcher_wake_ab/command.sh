set -u
rm -rf /tmp/r; mkdir -p /tmp/r
bash benchmarks/gpu_checks.sh /tmp/r > /tmp/r/install.log 2>&1
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > /tmp/r/gpu.txt; nproc >> /tmp/r/gpu.txt
for v in 0 1 0 1; do echo "== AB_WAKE_ALWAYS=$v"; AB_WAKE_ALWAYS=$v python3 benchmarks/bench_engine_steps.py --clients 1,8 --seconds 3 2>&1 | tail -3; done > /tmp/r/engine_steps.txt
python3 benchmarks/bench_sessions.py --sides on --clients 1 --duration 2 --warmup 1 --out /tmp/r/throwaway > /tmp/r/throwaway.log 2>&1
bash benchmarks/ab_env.sh /tmp/r/ab AB_WAKE_ALWAYS "0 1" 3 benchmarks/bench_sessions.py --sides on --clients 1 --duration 5 --warmup 2 > /tmp/r/ab.txt 2>&1
