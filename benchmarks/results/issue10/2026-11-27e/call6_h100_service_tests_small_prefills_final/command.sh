set -u
R=/tmp/r6; rm -rf $R; mkdir -p $R
[ -d /tmp/app ] || (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
timeout 330 bash benchmarks/gpu_checks.sh $R service-tests > $R/stages.log 2>&1; echo "service-tests rc=$?"; tail -3 $R/service-tests.log
for i in 1 2; do
  timeout 110 python3 benchmarks/bench_service.py --duration 8 --warmup 2 --prime 3 --clients 64 --max-len 256 --out $R/service_$i > $R/service_$i.log 2>&1
  echo "service $i rc=$?"; grep -E "clients +64:|^ +64 " $R/service_$i.log
done
cp benchmarks/_call6.sh $R/command.sh
tar czf $OUT/r6.tgz -C /tmp r6
