# Session 21 check: is the tiled CPU matmul (forced) a cheaper verify? Run as: scripts/jobs/quiet.sh bash run.sh
set -e
cd /work/main
bench=$(python -c 'from draftsmith.models import llamacpp; print(llamacpp.tool("llama-bench"))')
for type in q4_k_m float32; do
gguf=$(python -c "import sys; from draftsmith.models import llamacpp, zoo
print(llamacpp.cached_gguf(zoo.resolve_model_path(sys.argv[1]), sys.argv[1], sys.argv[2]))" smollm2-135m-instruct $type)
echo $type $gguf
"$bench" -m "$gguf" -t 2 -p 1,2,3,4,8 -n 0 -r 25 -fa on -o json > /tmp/tiled/${type}_default.json
GGML_CPU_TILED_MM_FORCE=1 "$bench" -m "$gguf" -t 2 -p 1,2,3,4,8 -n 0 -r 25 -fa on -o json > /tmp/tiled/${type}_force.json
done
