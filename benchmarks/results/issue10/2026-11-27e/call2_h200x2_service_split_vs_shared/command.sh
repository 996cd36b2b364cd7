set -u
R=/tmp/r2; rm -rf $R; mkdir -p $R
[ -d /tmp/app ] || (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
read SCPUS CCPUS < <(lscpu -p=CPU,CORE,NODE | grep -v '^#' | sort -t, -k3,3n -k2,2n -k1,1n | awk -F, '{c[NR]=$1} END {h=NR/2; for(i=1;i<=NR;i++){ if(i<=h) s=s (s?",":"") c[i]; else t=t (t?",":"") c[i]}; print s, t}')
echo "server cpus $SCPUS; client cpus $CCPUS" | tee $R/split.txt
for i in 1 2; do
  timeout 130 python3 benchmarks/bench_service.py --duration 8 --warmup 2 --prime 3 --clients 64 --max-len 256 --server-cpus "$SCPUS" --client-cpus "$CCPUS" --out $R/service_split_$i > $R/service_split_$i.log 2>&1
  echo "split $i rc=$?"; grep -E "^ +64 |clients +64" $R/service_split_$i.log
  timeout 130 python3 benchmarks/bench_service.py --duration 8 --warmup 2 --prime 3 --clients 64 --max-len 256 --server-cpus "$SCPUS" --client-cpus "$SCPUS" --out $R/service_shared_$i > $R/service_shared_$i.log 2>&1
  echo "shared $i rc=$?"; grep -E "^ +64 |clients +64" $R/service_shared_$i.log
done
cp benchmarks/_call2.sh $R/command.sh
tar czf $OUT/r2.tgz -C /tmp r2
