set -u
R=/tmp/r7; rm -rf $R; mkdir -p $R
S=$(date +%s)
[ -d /tmp/app ] || (timeout 250 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
echo "install $(( $(date +%s) - S )) s"
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_copy_segments.py tests/service/test_pack_kernel_gpu.py tests/client/test_client_stripes.py tests/client/test_client_spread.py -rs > $R/final_tests.log 2>&1; echo tests rc=$?
tail -4 $R/final_tests.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call7.sh $R/command.sh
tar czf $OUT/r7.tgz -C /tmp r7
