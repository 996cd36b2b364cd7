# What every one-off device call starts with, to source instead of writing it again:
#
#   R=/tmp/r1; source benchmarks/device_env.sh   # then run into $R; tar it into $OUT at the end
#
# Makes $R afresh, sets S (the start, for "total ... s" lines), installs this tree on every
# call (gpu_checks.sh: /tmp/app afresh, the .whl wheels into /tmp/site once per machine: a
# warm machine keeps /tmp, and installing once per machine had later calls measure an
# earlier call's code), exports the paths and the
# shared Triton cache, writes $R/gpu.txt and $R/host.txt, and splits the host's CPUs in two
# halves by NUMA node and core: SCPUS for servers, CCPUS for clients and load
# (bench_*.py --server-cpus "$SCPUS" --client-cpus "$CCPUS").
rm -rf "$R"; mkdir -p "$R"
S=$(date +%s)
(lscpu; nproc) > "$R/host.txt" 2>&1
(timeout 250 bash benchmarks/gpu_checks.sh "$R" > "$R/install.log" 2>&1)
echo "install $(( $(date +%s) - S )) s"
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 \
  TRITON_CACHE_DIR=/tmp/triton-cache CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/gpu.txt"
nproc >> "$R/gpu.txt"
read -r SCPUS CCPUS < <(lscpu -p=CPU,CORE,NODE | grep -v '^#' | sort -t, -k3,3n -k2,2n -k1,1n \
  | awk -F, '{c[NR]=$1} END {h=NR/2; for (i=1; i<=NR; i++) { if (i<=h) s=s (s?",":"") c[i];
                                                              else t=t (t?",":"") c[i] };
                               print s, t}')
echo "server cpus $SCPUS; client cpus $CCPUS" | tee "$R/split.txt"
