#!/usr/bin/env bash
# The variable-length GPU rows on a machine of 4 GPUs, one part per invocation (each within its 10
# minutes): ../shared/GPU.md's GPT with 22 layers (`--decoder-last-pipeline-num-layers 4`:
# 6/6/6/4, the output layer and loss weighing about two), PP=4, CUDA graphs per length
# bucket, through profiling/bench_gpt.py (30 iterations, the first 4 left out), after
# `bash prerequisite.sh` on the same machine.
#
#   tools/variable_lengths_check.sh OUT PART
#
#   cv      `--seq-length-cv 0.5 --microbatch-tokens 2048 --group-by-length`: --use-dpp,
#           megatron-core 1F1B fed the same order and in natural order, fixed 1,024-token
#           microbatches
#   corpus  the documents of tools/build_length_corpus.py (built and tokenized into
#           /tmp/varlen first, about a minute) at the same token budget: --use-dpp, 1F1B fed
#           the same order, packed fixed-length training of the same documents
#   memory  the first steps of --use-dpp and 1F1B fed the same order under PART cv's flags,
#           every rank's allocator history (`--memory-snapshots`): OUT/memory-memory.txt
#           names what each stage holds at its peak beyond 1F1B, by call site
#   trace   under PART cv's flags: --use-dpp, 1F1B fed the same order and the ZB-H1
#           placement fed it (`--dpp-defer-weights`), each with its last iteration traced;
#           OUT/trace-bound.txt: profiling/sim_compare.py on each (the runtime against the
#           replay of its measured tasks, and the lower bound on any schedule of them)
#
# CONFIGS: the bench configurations instead of the part's; GPUS (default 4) stages and GPUs,
# 24 / GPUS layers a stage and two fewer on the last (GPUS=2: 12 / 10).
# OUT gets flat files, few enough for the device tool (it brings back 8): PART-table.txt,
# PART-results.json, PART-logs.tar.gz (the runs' logs), PART-memory.txt (memory),
# PART-bound.txt and PART-traces.tar.gz (trace), PART-bench.log.
set -uo pipefail

if [ $# -ne 2 ]; then
  sed -n '2,29p' "$0" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "$1")
PART=$2
GPUS=${GPUS:-4}
PY=${PYTHON:-python3}
case $GPUS in
  2|3|4|6|8) ;;
  *) echo "GPUS must divide 24 layers into stages of at least 3: 2, 3, 4, 6 or 8, not $GPUS" >&2
     exit 2 ;;
esac
LAYERS="--num-layers 22 --decoder-last-pipeline-num-layers $((24 / GPUS - 2))"
mkdir -p "$OUT"
cd "$ROOT" || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
RUNS=$(mktemp -d)  # the bench's folder: its snapshots and logs stay here, summaries go to OUT
trap 'rm -rf "$RUNS"' EXIT

BENCH=(--gpus "$GPUS" --pp "$GPUS" --microbatches 16 --warmup 4 --iters 26 --timeout 140
       "--extra=$LAYERS")
case $PART in
  cv)
    configs=cv-dpp-tokens-graphs,cv-1f1b-cost-tokens-graphs,cv-1f1b-tokens-graphs,fixed-1024-graphs ;;
  corpus)
    configs=docs-dpp-tokens-graphs,docs-1f1b-cost-tokens-graphs,docs-packed-graphs
    if [ ! -e /tmp/varlen/corpus_text_document.idx ]; then
      mkdir -p /tmp/varlen
      { "$PY" tools/build_length_corpus.py --output /tmp/varlen/corpus.json --documents 2000 \
          --seed 1 &&
        "$PY" tools/preprocess_data.py --input /tmp/varlen/corpus.json \
          --output-prefix /tmp/varlen/corpus --tokenizer-type GPT2BPETokenizer \
          --vocab-file datasets_gpt/vocab.json --merge-file datasets_gpt/merges.txt \
          --append-eod --workers 8; } > "$OUT/$PART-corpus.log" 2>&1 ||
        { echo "building the corpus failed: $OUT/$PART-corpus.log" >&2; exit 1; }
    fi
    BENCH+=(--corpus /tmp/varlen/corpus_text_document) ;;
  memory)
    configs=cv-dpp-tokens-graphs,cv-1f1b-cost-tokens-graphs
    BENCH=(--gpus "$GPUS" --pp "$GPUS" --microbatches 16 --warmup 0 --iters 2 --timeout 240
           "--extra=$LAYERS" --memory-snapshots) ;;
  trace)
    configs=cv-dpp-tokens-graphs,cv-1f1b-cost-tokens-graphs,cv-dpp-tokens-deferred-graphs
    BENCH+=(--trace) ;;
  *)
    echo "PART must be cv, corpus, memory or trace, not $PART" >&2
    exit 2 ;;
esac

"$PY" profiling/bench_gpt.py "${BENCH[@]}" --configs "${CONFIGS:-$configs}" --out "$RUNS" \
  > "$OUT/$PART-bench.log" 2>&1
status=$?
for file in table.txt results.json memory.txt; do
  [ -e "$RUNS/$file" ] && cp "$RUNS/$file" "$OUT/$PART-${file}"
done
(cd "$RUNS" && tar -czf "$OUT/$PART-logs.tar.gz" ./*.log)
traces=$(cd "$RUNS" && ls -d trace-* 2>/dev/null)
if [ -n "$traces" ]; then
  (cd "$RUNS" && tar -czf "$OUT/$PART-traces.tar.gz" $traces)
  for trace in $traces; do
    echo "== ${trace#trace-}"
    "$PY" profiling/sim_compare.py "$RUNS/$trace" || status=1
  done > "$OUT/$PART-bound.txt" 2>&1
  cat "$OUT/$PART-bound.txt"
fi
cat "$OUT/$PART-table.txt" 2>/dev/null
grep -h "DPP transport\|GPU path" "$RUNS"/*.log | sed 's/^\[[^]]*\] //' | sort | uniq -c
exit $status
