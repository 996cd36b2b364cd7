# Dev box (2 cpus, no GPU), 2026-11-28, pinned to CPU 1. "before": core.py of 0db2277 (a
# request's sources sorted by two dict comprehensions and EngineCore._span per tensor);
# "after": the same tree with EngineCore._place and the per-Params _layout memo. Interleaved:
# before_1 after_1 before_2 after_2 before_3 after_3.
for r in 1 2 3; do
  git show 0db2277:service/attention_service/engine/core.py > service/attention_service/engine/core.py
  taskset -c 1 python benchmarks/engine_request_path.py --repeats 7 > $D/before_$r.txt
  cp /tmp/core_new.py service/attention_service/engine/core.py
  taskset -c 1 python benchmarks/engine_request_path.py --repeats 7 > $D/after_$r.txt
done
