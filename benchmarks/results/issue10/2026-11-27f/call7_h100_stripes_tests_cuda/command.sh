set -u
R=/tmp/r7; rm -rf $R; mkdir -p $R
S=$(date +%s)
[ -d /tmp/app ] || (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
echo "install $(( $(date +%s) - S )) s"
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/client/test_client_stripes.py > $R/stripes_tests.log 2>&1; echo "tests rc=$?"
tail -4 $R/stripes_tests.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call7.sh $R/command.sh
tar czf $OUT/r7.tgz -C /tmp r7
