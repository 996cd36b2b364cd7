set -u
R=/tmp/r9; rm -rf $R; mkdir -p $R
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
rm -rf /tmp/app; timeout 560 bash benchmarks/gpu_checks.sh $R sessions > $R/stage.log 2>&1; echo "stage rc=$?"; grep -E "^\| (sessions|resend|p50|batching|steps)" $R/sessions.log | tail -20
cp benchmarks/_call9.sh $R/command.sh
tar czf $OUT/r9.tgz -C /tmp r9
