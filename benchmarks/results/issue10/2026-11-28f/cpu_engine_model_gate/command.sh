# Dev box (2 cpus, no GPU), 2026-11-28: the engine pinned to CPU 0, the load process to CPU 1.
for r in 1 2 3; do
  taskset -c 0 python benchmarks/bench_engine_prefill.py --load-cpus 1 --gates off,readers,all \
    --batching on,off --seconds 4 --warmup 1 --out $D/round$r.json | tee $D/round$r.txt
done
