R=/tmp/r5; source benchmarks/device_env.sh
# Decode steps through server-side KV caches, the server in CPUs 0-10 (auto places the engine
# on 0-2) against --engine-cpus none in the same cpuset, load on 11-15, interleaved
timeout $(( 560 - ($(date +%s) - S) )) bash benchmarks/ab_env.sh $R/decode_placement ATTENTION_ENGINE_CPUS "auto none" 2 \
  benchmarks/bench_sessions.py --sides on --clients 1,8,64 --duration 6 --warmup 2 --server-cpus 0-10 --client-cpus 11-15 > $R/decode_placement.log 2>&1; echo "rc=$?"
cat $R/decode_placement.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call5.sh $R/command.sh
tar czf $OUT/r5.tgz -C /tmp r5
