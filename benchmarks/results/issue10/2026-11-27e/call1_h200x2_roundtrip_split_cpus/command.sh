set -u
R=/tmp/r1; rm -rf $R; mkdir -p $R
(lscpu; nproc; numactl -H 2>/dev/null; nvidia-smi) > $R/host.txt 2>&1
(timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
# Half of the cores (all their hardware threads, one NUMA node first) for the servers.
read SCPUS CCPUS < <(lscpu -p=CPU,CORE,NODE | grep -v '^#' | sort -t, -k3,3n -k2,2n -k1,1n | awk -F, '{c[NR]=$1} END {h=NR/2; for(i=1;i<=NR;i++){ if(i<=h) s=s (s?",":"") c[i]; else t=t (t?",":"") c[i]}; print s, t}')
echo "server cpus $SCPUS; client cpus $CCPUS" | tee $R/split.txt
rm -rf /tmp/baseline-tree && mkdir -p /tmp/baseline-tree && git archive 8091d8f | tar x -C /tmp/baseline-tree
timeout 450 python3 benchmarks/bench_roundtrip.py --tokens 8192 --heads 16 --head-dim 128 --frontends 8,16 --clients 8,16 --iters 10 --agg-seconds 6 --baseline-tree /tmp/baseline-tree --server-cpus "$SCPUS" --client-cpus "$CCPUS" --out $R/roundtrip_split > $R/roundtrip_split.log 2>&1
echo rc=$?
sed -n '/^prefill/,$p' $R/roundtrip_split.log
cp benchmarks/_call1.sh $R/command.sh
tar czf $OUT/r1.tgz -C /tmp r1
