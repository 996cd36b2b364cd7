set -u
R=/tmp/r8; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_copy_segments.py tests/service/test_pack_kernel_gpu.py tests/service/test_process_group_gpu.py > $R/tests.log 2>&1; echo "tests rc=$?"; tail -3 $R/tests.log
cp benchmarks/_call8.sh $R/command.sh
tar czf $OUT/r8.tgz -C /tmp r8
