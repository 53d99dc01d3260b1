#!/bin/bash
# stallfree beside llama.cpp's server on this machine: `stallfree bench engine --url ... --launch ...` for each,
# one server alive at a time, in alternating rounds (A B A B A B: a shared machine's load drifts between them),
# then the table of per-server medians (`--compare`). Both get the same threads and the same KV capacity.
#
#   LLAMA_SERVER=/tmp/peers/llama-server bench/side_by_side.sh        # a llama.cpp llama-server binary
#   THREADS=2 ROUNDS=3 KV_TOKENS=32768 OUT=runs/peers                   # the defaults
#   STALLFREE_CPU_TIER=avx2                                            # stallfree at a forced tier (beside an AVX2
#                                                                      # build of llama.cpp on an AVX-512 CPU)
#   GGUF=runs/llama-3.2-1b-shape-q4_0.gguf OUT=runs/peers-1b            # both serve this file instead of SmolLM2
#   SERVING_REQUESTS=20                                                # a shorter serving-load row (default 60)
#                                                  (`stallfree bench write-gguf --type q4_0`: Llama-3.2-1B's shape)
set -euo pipefail
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama.cpp server binary (built or downloaded from the llama.cpp project, kept outside the repository)}"
STALLFREE=${STALLFREE:-stallfree}
T=${THREADS:-2}; R=${ROUNDS:-3}; KV=${KV_TOKENS:-32768}; OUT=${OUT:-runs/peers}
# The serving-load row sends SERVING_REQUESTS (60) at 2/s: fewer for a model the machine cannot serve at that rate.
SERVE_N=${SERVING_REQUESTS:-60}
PYTHON=${PYTHON:-$(dirname "$(command -v "$STALLFREE")")/python}  # the one stallfree runs on
# What stallfree serves: the embedded model by its name, or the file given (both servers serve the same file).
if [ -n "${GGUF:-}" ]; then SF_MODEL=$GGUF; else SF_MODEL=smollm2-135m
  GGUF=$("$PYTHON" -c "from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path as p; print(p())"); fi
mkdir -p "$OUT"
rm -f "$OUT"/stallfree-*.json "$OUT"/llama.cpp-*.json
echo "model $SF_MODEL; stallfree's CPU tier: $("$PYTHON" -c "from stallfree.node_daemon.models.cpu_tier import cpu_tier; print(cpu_tier().describe())")"
echo "load before: $(cat /proc/loadavg)"
for r in $(seq 1 "$R"); do
  "$STALLFREE" bench engine --url http://127.0.0.1:18102 --model smollm2-135m --label stallfree --repeats 1 \
    --startup-repeats 1 --serving-requests "$SERVE_N" --output "$OUT/stallfree-$r.json" --keep-logs "$OUT/logs/stallfree-$r" \
    --launch "$STALLFREE" serve --model "$SF_MODEL" --served-model-name smollm2-135m --port 18102 --threads "$T" \
    --num-kv-blocks $((KV / 16))
  STALLFREE_CPU_TIER= "$STALLFREE" bench engine --url http://127.0.0.1:18101 --model smollm2 --label llama.cpp --repeats 1 \
    --startup-repeats 1 --serving-requests "$SERVE_N" --output "$OUT/llama.cpp-$r.json" --keep-logs "$OUT/logs/llama.cpp-$r" \
    --launch "$LLAMA_SERVER" -m "$GGUF" -a smollm2 --host 127.0.0.1 --port 18101 -t "$T" -np 16 -c "$KV" \
    --cont-batching --no-webui --chat-template chatml
  echo "load after round $r: $(cat /proc/loadavg)"
done
"$STALLFREE" bench engine --compare "$OUT"/stallfree-*.json "$OUT"/llama.cpp-*.json
