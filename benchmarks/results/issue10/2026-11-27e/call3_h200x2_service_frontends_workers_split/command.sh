set -u
R=/tmp/r3; rm -rf $R; mkdir -p $R
(timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
read SCPUS CCPUS < <(lscpu -p=CPU,CORE,NODE | grep -v '^#' | sort -t, -k3,3n -k2,2n -k1,1n | awk -F, '{c[NR]=$1} END {h=NR/2; for(i=1;i<=NR;i++){ if(i<=h) s=s (s?",":"") c[i]; else t=t (t?",":"") c[i]}; print s, t}')
echo "server cpus $SCPUS; client cpus $CCPUS" | tee $R/split.txt
S="python3 benchmarks/bench_service.py --duration 8 --warmup 2 --prime 3 --clients 64 --max-len 256 --server-cpus $SCPUS --client-cpus $CCPUS"
run() { name=$1; shift; timeout 150 $S "$@" --out $R/$name > $R/$name.log 2>&1; echo "$name rc=$?"; grep -E "clients +64:" $R/$name.log; }
run default_1
run fe12_on --frontends 12 --batching on
run fe16_on --frontends 16 --batching on
run workers16_on --workers 16 --batching on
run default_2
timeout 150 python3 benchmarks/bench_roundtrip.py --tokens 2048 --heads 16 --head-dim 128 --frontends 8 --clients 8,16 --iters 3 --agg-seconds 5 --server-cpus "$SCPUS" --client-cpus "$CCPUS" --out $R/agg > $R/agg.log 2>&1; echo "agg rc=$?"; grep -E "N=8 .*clients" $R/agg.log
cp benchmarks/_call3.sh $R/command.sh
tar czf $OUT/r3.tgz -C /tmp r3
