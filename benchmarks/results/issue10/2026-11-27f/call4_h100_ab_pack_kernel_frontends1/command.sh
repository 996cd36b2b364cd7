set -u
R=/tmp/r4; rm -rf $R; mkdir -p $R
S=$(date +%s)
[ -d /tmp/app ] || (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
echo "install $(( $(date +%s) - S )) s"
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
timeout 540 bash benchmarks/ab_env.sh $R/ab_frontends1 ATTENTION_PACK_KERNEL "0 1" 2 benchmarks/bench_service.py --frontends 1 --batching on --clients 64 --max-len 256 --duration 6 --warmup 2 --prime 3 > $R/ab.log 2>&1; echo "ab rc=$?"
for f in $R/ab_frontends1/*.log; do echo "== $f"; grep -E "^\|" $f | head -6; done
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call4.sh $R/command.sh
tar czf $OUT/r4.tgz -C /tmp r4
