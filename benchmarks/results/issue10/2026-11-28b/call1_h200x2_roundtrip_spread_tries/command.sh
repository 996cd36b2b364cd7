R=/tmp/r1; source benchmarks/device_env.sh
rm -rf /tmp/baseline-tree && mkdir -p /tmp/baseline-tree && git archive 8091d8f | tar x -C /tmp/baseline-tree
timeout $(( 585 - ($(date +%s) - S) )) python3 benchmarks/bench_roundtrip.py --tokens 8192 --heads 16 --head-dim 128 --frontends 8 --clients 8,8,8,8 --agg-spread 1 --iters 3 --agg-seconds 5 --baseline-tree /tmp/baseline-tree --server-cpus "$SCPUS" --client-cpus "$CCPUS" --out $R/roundtrip_spread_tries > $R/roundtrip_spread_tries.log 2>&1; echo rc=$?
sed -n '/^aggregate/,$p' $R/roundtrip_spread_tries.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call1.sh $R/command.sh
tar czf $OUT/r1.tgz -C /tmp r1
