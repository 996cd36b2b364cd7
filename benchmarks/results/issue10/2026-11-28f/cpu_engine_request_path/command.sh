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
# Then Params.tokens / budget_tokens / kv_bytes as cached properties (params.py), against
# f515000's params.py, interleaved: cached_before_1 cached_after_1 cached_before_2 cached_after_2.
for r in 1 2; do
  git show HEAD:service/attention_service/params.py > service/attention_service/params.py
  taskset -c 1 python benchmarks/engine_request_path.py --repeats 7 > $D/cached_before_$r.txt
  cp /tmp/params_new.py service/attention_service/params.py
  taskset -c 1 python benchmarks/engine_request_path.py --repeats 7 > $D/cached_after_$r.txt
done
