R=$OUT/r1; source benchmarks/device_env.sh
# Batching on/off, server in one NUMA half (16 vCPUs: the host size), load on the other
SERVER_CPUS="$SCPUS" LOAD_CPUS="$CCPUS" timeout 380 bash benchmarks/ab_batching_placed.sh $R/separate 3 > $R/separate.log 2>&1; echo "separate rc=$? $(( $(date +%s) - S )) s"
cat $R/separate/summary.txt
# The same host shared as a 16-vCPU host would be: server 0-10, load 11-15
SERVER_CPUS=0-10 LOAD_CPUS=11-15 timeout $(( 580 - ($(date +%s) - S) )) bash benchmarks/ab_batching_placed.sh $R/shared 1 > $R/shared.log 2>&1; echo "shared rc=$? $(( $(date +%s) - S )) s"
cat $R/shared/summary.txt
cp benchmarks/_call1.sh $R/command.sh
