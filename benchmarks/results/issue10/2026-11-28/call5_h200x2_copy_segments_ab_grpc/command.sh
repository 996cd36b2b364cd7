set -u
R=/tmp/r5; rm -rf $R; mkdir -p $R
S=$(date +%s)
[ -d /tmp/app ] || (timeout 250 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
echo "install $(( $(date +%s) - S )) s"
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
read SCPUS CCPUS < <(lscpu -p=CPU,CORE,NODE | grep -v '^#' | sort -t, -k3,3n -k2,2n -k1,1n | awk -F, '{c[NR]=$1} END {h=NR/2; for(i=1;i<=NR;i++){ if(i<=h) s=s (s?",":"") c[i]; else t=t (t?",":"") c[i]}; print s, t}')
echo "server cpus $SCPUS; client cpus $CCPUS" | tee $R/split.txt
timeout 150 python3 benchmarks/bench_copy_segments.py --jobs 2,8,32 --sizes 16K,32K,64K,128K,256K --out $R/copy_segments > $R/copy_segments.log 2>&1; echo rc=$?
cat $R/copy_segments.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_copy_segments.py tests/service/test_pack_kernel_gpu.py -rs > $R/pack_tests.log 2>&1; echo tests rc=$?
tail -3 $R/pack_tests.log
timeout $(( 585 - ($(date +%s) - S) )) bash benchmarks/ab_env.sh $R/ab_grpc ATTENTION_PACK_MAX_SEGMENT_BYTES "0 65536 1073741824" 2 \
  benchmarks/bench_service.py --batching on --clients 64 --duration 6 --warmup 2 --frontends 8 \
  --server-cpus "$SCPUS" --client-cpus "$CCPUS" > $R/ab_grpc.log 2>&1; echo ab rc=$?
for f in $R/ab_grpc/*.log; do echo "== $f"; grep -E "clients +64:" $f | tail -1; done
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call5.sh $R/command.sh
tar czf $OUT/r5.tgz -C /tmp r5
