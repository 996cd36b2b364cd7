set -u
R=/tmp/r8; rm -rf $R; mkdir -p $R
S=$(date +%s)
[ -d /tmp/app ] || (timeout 250 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
echo "install $(( $(date +%s) - S )) s"
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
read SCPUS CCPUS < <(lscpu -p=CPU,CORE,NODE | grep -v '^#' | sort -t, -k3,3n -k2,2n -k1,1n | awk -F, '{c[NR]=$1} END {h=NR/2; for(i=1;i<=NR;i++){ if(i<=h) s=s (s?",":"") c[i]; else t=t (t?",":"") c[i]}; print s, t}')
echo "server cpus $SCPUS; client cpus $CCPUS" | tee $R/split.txt
timeout 240 python3 benchmarks/bench_roundtrip.py --tokens 8192 --heads 16 --head-dim 128 --frontends 8 --clients 8,8,8,8 --agg-spread 1 --iters 1 --agg-seconds 5 --server-cpus "$SCPUS" --client-cpus "$CCPUS" --out $R/roundtrip_ranked_spread > $R/roundtrip_ranked_spread.log 2>&1; echo rc=$?
sed -n '/^aggregate/,$p' $R/roundtrip_ranked_spread.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call8.sh $R/command.sh
tar czf $OUT/r8.tgz -C /tmp r8
