#!/usr/bin/env bash
# The H200 benchmark driver, in steps that each fit one GPU job (<= 10 minutes):
#   STEPS="reference pipeline speculative" bash benchmarks/h200.sh   # job 1: target -> pipeline -> engine bench
#   STEPS="random capture train" bash benchmarks/h200.sh             # job 2: capture and training throughput
#   STEPS="fasttests random fast" bash benchmarks/h200.sh            # job 3: fast-path tests on the GPU, plain decode vs bandwidth
#   STEPS="fp8 humaneval ksweep gputests fasttests" bash benchmarks/h200.sh  # after `reference pipeline` on the same machine:
#       fp8: the same pipeline on fp8 captures (tau only) -> fp8_tau_loss_pct; humaneval: the pipeline's drafter on
#       HumanEval; ksweep: chain k = 3 and 7; gputests: pytest -m gpu; regen: the target rewrites the answers
#       of a subset (REGEN_SAMPLES conversations, local batched generate) in its own run dir
# reference: trains the DeepSeek-V3-architecture reference target (deterministic, seed 0) into /tmp/ref;
# random: the same architecture with random weights (speed figures only). Needs build/gpu
# (python benchmarks/pack_gpu_data.py). Each step is time-bounded and leaves its log and JSON
# under $OUT, so a failed or overrun step keeps the others' figures.
set -u
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"reference pipeline speculative"}
export PYTHONUNBUFFERED=1 PYTHONPATH="src:${PYTHONPATH:-}"
step() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "[$name] rc=$rc $(( $(date +%s) - t0 ))s"; grep -v "it/s\]" "$OUT/$name.log" | tail -n 4; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
for s in $STEPS; do case $s in
  reference) step reference 200 python3 benchmarks/reference_target.py train --corpus_dir build/gpu --preset dsv3 \
               --out /tmp/ref --max_minutes "${REF_MINUTES:-2.5}" --batch_size 32 --lr 1.5e-3 --max_val_tokens 100000
             cp /tmp/ref/training.json "$OUT/reference_training.json" ;;
  random)    step random 80 python3 benchmarks/reference_target.py train --corpus_dir build/gpu --preset dsv3 \
               --out /tmp/ref --max_minutes 0 --max_val_tokens 20000 ;;
  pipeline)  step pipeline "${PIPELINE_LIMIT:-300}" python3 -m draftsmith.cli run benchmarks/recipes/h200.yaml ${PIPELINE_ARGS:-}
             for f in eval/results.json eval/report.md eval/acceptance.png train/metrics.jsonl; do
               cp "/tmp/runs/h200/$f" "$OUT/$(echo "$f" | tr / _)" 2>/dev/null; done
             python3 -m draftsmith.cli status /tmp/runs/h200 --json > "$OUT/status.json" 2>&1
             python3 -m draftsmith.cli plan --run_dir /tmp/runs/h200 --batch_sizes '[1,4,16]' > "$OUT/plan.txt" 2>&1 ;;
  speculative) step speculative "${SPEC_LIMIT:-150}" python3 benchmarks/bench_speculative.py --run_dir /tmp/runs/h200 \
               --benchmark build/gpu/mtbench_question.jsonl --num_prompts 8 --max_new_tokens 128 --batch_sizes 1 4 16 \
               --out "$OUT/bench_speculative.json" ;;
  fp8)       step fp8 "${FP8_LIMIT:-300}" python3 -m draftsmith.cli run benchmarks/recipes/h200.yaml --run_dir /tmp/runs/h200-fp8 \
               --capture.storage_dtype float8_e4m3 ${PIPELINE_ARGS:-} --evaluate.methods '[eagle3_chain,eagle3_tree]' \
               --evaluate.batch_sizes '[1]' --evaluate.check_lossless false --evaluate.step_costs false --export.formats '[sglang]'
             cp /tmp/runs/h200-fp8/eval/results.json "$OUT/fp8_eval_results.json" 2>/dev/null
             cp /tmp/runs/h200-fp8/train/metrics.jsonl "$OUT/fp8_train_metrics.jsonl" 2>/dev/null ;;
  humaneval) step humaneval "${HE_LIMIT:-120}" python3 -m draftsmith.cli evaluate benchmarks/recipes/h200.yaml ${PIPELINE_ARGS:-} \
               --evaluate.benchmarks '[build/gpu/HumanEval.jsonl.gz]' --evaluate.batch_sizes '[1]' --force true
             cp /tmp/runs/h200/eval/results.json "$OUT/humaneval_eval_results.json" 2>/dev/null ;;
  ksweep)    for k in 3 7; do step "k$k" "${K_LIMIT:-75}" python3 -m draftsmith.cli evaluate benchmarks/recipes/h200.yaml \
               ${PIPELINE_ARGS:-} --evaluate.draft_steps $k --evaluate.methods '[eagle3_chain,plain]' \
               --evaluate.batch_sizes '[1]' --evaluate.step_costs false --force true
             cp /tmp/runs/h200/eval/results.json "$OUT/k${k}_eval_results.json" 2>/dev/null; done ;;
  regen)     R="--run_dir /tmp/runs/h200-regen --prepare.max_samples ${REGEN_SAMPLES:-64}"
             step regen "${REGEN_LIMIT:-150}" bash -c "python3 -m draftsmith.cli prepare benchmarks/recipes/h200.yaml $R && \
               python3 -m draftsmith.cli regenerate benchmarks/recipes/h200.yaml $R --regenerate.enabled true \
               --regenerate.max_new_tokens 128 --regenerate.keep_truncated true --regenerate.batch_size 32"
             python3 -m draftsmith.cli status /tmp/runs/h200-regen --json > "$OUT/regen_status.json" 2>&1 ;;
  gputests)  step gputests "${GPUTESTS_LIMIT:-90}" python3 -m pytest -q -m gpu tests/ -p no:cacheprovider ;;
  fasttests) step fasttests "${FASTTESTS_LIMIT:-240}" python3 -m pytest -q tests/test_fast.py -p no:cacheprovider -k "${FASTTESTS_K:-}" ;;
  fast)      step fast "${FAST_LIMIT:-330}" python3 benchmarks/bench_fast.py --moe_target /tmp/ref --out "$OUT/bench_fast.json" ;;
  capture)   step capture 110 python3 benchmarks/bench_capture.py --target /tmp/ref --batch 8 --seq-len 1024 \
               --out "$OUT/bench_capture.json" ;;
  train)     step train 230 python3 benchmarks/bench_train.py --out "$OUT/bench_train.json" ;;
  *) echo "unknown step $s" ;;
esac; done
ls -la "$OUT"
