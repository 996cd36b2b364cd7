set -u
R=/tmp/r8; rm -rf $R; mkdir -p $R
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
rm -rf /tmp/app; timeout 560 bash benchmarks/gpu_checks.sh $R service-tests > $R/stage.log 2>&1; echo "stage rc=$?"; tail -3 $R/stage.log
cp benchmarks/_call8.sh $R/command.sh
tar czf $OUT/r8.tgz -C /tmp r8
