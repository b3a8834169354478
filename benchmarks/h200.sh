#!/usr/bin/env bash
# The H200 benchmark driver, in steps that each fit one GPU job (<= 10 minutes). The full run is
# three calls one after another on one machine (they share /tmp/ref and /tmp/runs; the seconds are
# what they took in the third driver run of 2026-12-03, BENCHMARKS.md):
#   A="--prepare.max_samples 2000 --evaluate.max_prompts 16 --evaluate.check_lossless false"
#   STEPS="reference pipeline" REF_MINUTES=2 REF_STEPS=260 PIPELINE_LIMIT=400 PIPELINE_ARGS="$A" \
#     bash benchmarks/h200.sh                                                  # call A, 426 s
#   STEPS="fp8 humaneval ksweep profile" FP8_LIMIT=250 PIPELINE_ARGS="$A" bash benchmarks/h200.sh  # call B, 444 s
#   STEPS="regen capture train gputests" REGEN_SAMPLES=32 TRAIN_LIMIT=300 TRAIN_BUDGET=230 \
#     bash benchmarks/h200.sh                                                  # call C, 414 s
# (`train` sweeps the drafter shapes, then probes the Kimi shape; `kimi` runs the probe alone, 149 s)
#   STEPS="engine consistency" bash benchmarks/h200.sh     # issue 20/19: needs nothing from the calls above;
#                                                          # engine ~200 s (ENGINE_BUDGET=170), consistency ~1-2 min
# then `python benchmarks/collect_h200.py DIR --out benchmarks/results/h200.json` on their outputs.
# Steps: reference -> pipeline (prepare, capture, vocab, train, evaluate at batch 1/4/16 with plain,
# chain, tree and n-gram, export; then status and plan) -> regen (the target rewrites REGEN_SAMPLES
# conversations' answers, its own run dir) -> humaneval -> ksweep (chain k = 3, 7) -> profile (where a
# round's time goes) -> bigtree (evaluate a wider tree: TREE_DEPTH/TREE_TOPK/TREE_BUDGET) -> capture (capture / forward throughput) -> fp8 (the pipeline on fp8 captures)
# -> train (drafter training MFU at fixed shapes, then the Kimi-shaped probe) -> kimi (the probe alone)
# -> trainreal (per width in TRAIN_WIDTHS: wide_target.py + prepare/capture/vocab, then bench_train.py --capture:
# drafter training tokens/s and MFU on that capture, eager then with train.compile's default) -> gputests (pytest -m gpu) -> resident (bench_resident.py: resident rounds vs the host loop, one process;
# RESIDENT_ARGS=--compile_round adds resident rounds with evaluate.compile_round: on, docs/fast-paths.md)
# -> residenttests (test_resident.py and test_fast.py, graphs included) -> write (bench_write.py: shard
# write throughput on this host's disk) -> engine (bench_engine.py: speedup ÷ τ with τ fixed by an oracle on an
# 8B-shaped random-weight target and an H 4096 drafter, batch 1/4/16, chain and tree, host and resident loops;
# ENGINE_BUDGET seconds of measuring, ~200 s in all; engine2: another configuration, ENGINE2_ARGS) -> consistency (tests/test_consistency.py -m gpu: every
# round's accepted count equals the drafter's teacher-forced prediction, graphs and resident paths, float32) -> verifyattn
# (bench_verify_attention.py: one layer's attention at N verify rows against one row, per kernel, 8B shapes) -> verifyrows
# (bench_verify_rows.py: whole verify forwards of 1..16 rows per matmul and attention setting, VR_ARGS) -> explain (after
# peer: explain_turns.py on its run folders, engine tau against teacher-forced tau per turn) -> peersweep (after peer:
# ours at each of PEER_VARIANTS' settings against the same peer, its checkpoints and measurements reused). Also: random (random weights, speed only), speculative
# (bench_speculative.py), fasttests, fast (plain decode vs bandwidth).
# reference: trains the DeepSeek-V3-architecture reference target (seed 0) into /tmp/ref for REF_MINUTES;
# with REF_STEPS (e.g. 260, below what 2 minutes reach) the step count and schedule are fixed, so every run
# trains the same target (the time limit only caps it). Without it the time cut varies the steps (264/266/271);
# random: the same architecture with random weights (speed figures only). Needs build/gpu
# (bash benchmarks/gpu_inputs.sh makes it and .whl in a new checkout). Each step is time-bounded and leaves its log and JSON
# under $OUT, so a failed or overrun step keeps the others' figures.
set -u
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"reference pipeline speculative"}
export PYTHONUNBUFFERED=1 PYTHONPATH="src:${PYTHONPATH:-}"
step() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  echo "=== $name $(date -u +%FT%TZ): $*" >> "$OUT/$name.log"  # a step run again in one call adds to its log
  timeout "$limit" "$@" >> "$OUT/$name.log" 2>&1; local rc=$?
  echo "[$name] rc=$rc $(( $(date +%s) - t0 ))s"; grep -v "it/s\]" "$OUT/$name.log" | tail -n 4; }
# The device has no network: the packages the GPU image lacks travel unpacked in .whl/site (carry
# .whl; benchmarks/gpu_inputs.sh makes it: jsonargparse, docstring_parser and ijson; typeshed_client,
# 5 MB the CLI does without, is left out so that .whl, build/gpu and the tree fit the 64 MiB a call
# carries). .whl/peer holds speculators' wheels for the `peer` step.
[ -d .whl/site ] && export PYTHONPATH="$PWD/.whl/site:$PYTHONPATH"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
peer() { local name=$1 flags=$2 limit=$3  # bench_peer.py: speculators' trainer and ours (its folder `name`, extra `flags`)
  local site=${PEER_SITE-/tmp/peer-site}
  [ -z "$site" ] || [ -d "$site" ] || for w in .whl/peer/*.whl; do python3 -m zipfile -e "$w" "$site"; done
  step peer "$limit" env PYTHONPATH="${site:+$site:}$PYTHONPATH" python3 benchmarks/bench_peer.py \
    --recipe "${PEER_RECIPE:-benchmarks/recipes/h200.yaml}" --base /tmp/runs/peer/base --heldout /tmp/runs/peer/heldout \
    --work /tmp/runs/peer/work --seeds "${PEER_SEEDS:-0}" ${PEER_NGRAM---ngram} --depth 6 --sim-depth 5 --eval-prompts "${PEER_PROMPTS:-16}" \
    --max-new-tokens 128 --benchmark build/gpu/mtbench_question.jsonl --ours "--train.online false ${PEER_ARGS:-} $flags" \
    --ours-name "$name" ${PEER_TEMPS:+--temperatures $PEER_TEMPS} ${PEER_SERVES:+--serves $PEER_SERVES} --out "$OUT/$name-s$(echo "${PEER_SEEDS:-0}" | tr , _)-bench_peer.json"; }  # partial while cut: bench_peer.py
# A new checkout lacks the gitignored inputs: one line and no step run, not a traceback per step
fix="run bash benchmarks/gpu_inputs.sh here, then carry .whl and build/gpu"
python3 -c "import jsonargparse" 2>/dev/null || { echo "h200.sh: jsonargparse is not importable and .whl/site is missing: $fix"
  exit 2; }
for s in $STEPS; do case " engine engine2 verifyattn verifyrows consistency gputests fasttests residenttests write train kimi " in
  *" $s "*) ;; *) [ -f build/gpu/corpus.json ] || { echo "h200.sh: step $s needs build/gpu, which is missing: $fix"; exit 2; } ;;
esac; done
for s in $STEPS; do case $s in
  reference) step reference 200 python3 benchmarks/reference_target.py train --corpus_dir build/gpu --preset dsv3 \
               --out /tmp/ref --max_minutes "${REF_MINUTES:-2.5}" --max_steps "${REF_STEPS:-100000}" --batch_size 32 --lr 1.5e-3 --max_val_tokens 100000
             cp /tmp/ref/training.json "$OUT/reference_training.json" ;;
  random)    step random 80 python3 benchmarks/reference_target.py train --corpus_dir build/gpu --preset dsv3 \
               --out /tmp/ref --max_minutes 0 --max_val_tokens 20000 ;;
  pipeline)  step pipeline "${PIPELINE_LIMIT:-300}" python3 -m draftsmith.cli run benchmarks/recipes/h200.yaml ${PIPELINE_ARGS:-}
             for f in eval/results.json eval/report.md eval/acceptance.png train/metrics.jsonl train/manifest.json \
                      capture/manifest.json; do
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
  bigtree)   step bigtree "${BIGTREE_LIMIT:-120}" python3 -m draftsmith.cli evaluate benchmarks/recipes/h200.yaml ${PIPELINE_ARGS:-} \
               --evaluate.methods '[eagle3_tree,plain]' --evaluate.batch_sizes '[1]' --evaluate.step_costs false \
               --evaluate.tree_depth "${TREE_DEPTH:-6}" --evaluate.tree_topk "${TREE_TOPK:-8}" --evaluate.tree_budget "${TREE_BUDGET:-64}" \
               --force true  # a wider tree than the recipe's (depth 5, top-k 4, 16 tokens): verifying 64 rows costs ~1 at batch 1
             cp /tmp/runs/h200/eval/results.json "$OUT/bigtree_eval_results.json" 2>/dev/null ;;
  ksweep)    for k in 3 7; do step "k$k" "${K_LIMIT:-75}" python3 -m draftsmith.cli evaluate benchmarks/recipes/h200.yaml \
               ${PIPELINE_ARGS:-} --evaluate.draft_steps $k --evaluate.methods '[eagle3_chain,plain]' \
               --evaluate.batch_sizes '[1]' --evaluate.step_costs false --force true
             cp /tmp/runs/h200/eval/results.json "$OUT/k${k}_eval_results.json" 2>/dev/null; done ;;
  regen)     R="--run_dir /tmp/runs/h200-regen --prepare.max_samples ${REGEN_SAMPLES:-64}"
             step regen "${REGEN_LIMIT:-150}" bash -c "python3 -m draftsmith.cli prepare benchmarks/recipes/h200.yaml $R && \
               python3 -m draftsmith.cli regenerate benchmarks/recipes/h200.yaml $R --regenerate.enabled true \
               --regenerate.max_new_tokens 128 --regenerate.keep_truncated true --regenerate.batch_size 32"
             cp /tmp/runs/h200-regen/regen/manifest.json "$OUT/regen_manifest.json" 2>/dev/null
             python3 -m draftsmith.cli status /tmp/runs/h200-regen --json > "$OUT/regen_status.json" 2>&1 ;;
  data)      step data "${DATA_LIMIT:-400}" bash -c "python3 -m draftsmith.cli prepare benchmarks/recipes/h200.yaml ${PIPELINE_ARGS:-} && \
               python3 -m draftsmith.cli regenerate benchmarks/recipes/h200.yaml ${PIPELINE_ARGS:-}"  # resumes by chunk: rerun to go on
             cp /tmp/runs/h200/regen/manifest.json "$OUT/regen_manifest.json" 2>/dev/null
             cp /tmp/runs/h200/data/manifest.json "$OUT/data_manifest.json" 2>/dev/null ;;
  peerdata)  # issue 19's peer at equal data: PEER_SAMPLES conversations (answers regenerated) captured for both trainers,
             # and a held-out capture of 200 others (records 5,400+ of the file; the base takes the first ones).
             # PEER_RECIPE / PEER_ARGS: another recipe or extra flags (the CPU dry run of BENCHMARKS.md uses the tiny target)
             P="--run_dir /tmp/runs/peer/base --prepare.max_samples ${PEER_SAMPLES:-1600} --train.online false --regenerate.batch_size 1024 ${PEER_ARGS:-}"
             H="--run_dir /tmp/runs/peer/heldout --prepare.skip_samples 5400 --prepare.max_samples 200 --train.online false --regenerate.batch_size 1024 ${PEER_ARGS:-}"
             step peerdata "${PEERDATA_LIMIT:-330}" bash -c "for s in prepare regenerate capture vocab; do \
               python3 -m draftsmith.cli \$s ${PEER_RECIPE:-benchmarks/recipes/h200.yaml} $P || exit 1; done; \
               for s in prepare regenerate capture; do \
               python3 -m draftsmith.cli \$s ${PEER_RECIPE:-benchmarks/recipes/h200.yaml} $H || exit 1; done" ;;
  peer)      # bench_peer.py on the peerdata captures: speculators 0.9.0 and our trainer. The GPU image lacks speculators'
             # imports: its wheels travel in .whl/peer (cp312, listed in BENCHMARKS.md) and are unpacked into PEER_SITE
             # (PEER_SITE= empty: the installed packages, as on this repository's CPU machine)
             # PEER_OURS: flags for our side only (e.g. --train.batch_tokens 8192 with PEER_OURS_NAME=ours8k: its own folder)
             # PEER_SEEDS: e.g. 0,1,2 (or one call a seed, then bench_peer.py --merge; on an H100 with PEER_PROMPTS=80
             # the first seed took 456 s after call A, the next 325 s: one seed a call)
             # PEER_PROMPTS: MT-Bench questions (16; 80 = all, 160 turns); PEER_NGRAM= (empty) leaves n-gram out
             # PEER_TEMPS: e.g. 0,0.7,1 (both drafters at each); PEER_SERVES: the temperatures our recipe is for (then
             # bench_peer.py --by-temperature A.json B.json takes each temperature's ratio from the recipe serving it)
             peer "${PEER_OURS_NAME:-ours}" "${PEER_OURS:-}" "${PEER_LIMIT:-450}" ;;
  peersweep) # ours at other settings against the peer step's checkpoints (same seeds) and measurements, reused when the
             # variant's evaluate settings are the peer's, measured again when not (e.g. --evaluate.temperature 1): on an H100
             # at PEER_PROMPTS=80 a training variant took 164 s warm; PEER_VARIANTS="name=flags;name=flags", e.g.
             # "t025=--train.ttt_target_temperature 0.25;t1=--train.ttt_target_temperature 1" (each its own folder and -bench_peer.json)
             IFS=';' read -ra VS <<< "${PEER_VARIANTS:-}"
             for v in "${VS[@]}"; do peer "${v%%=*}" "${v#*=}" "${SWEEP_LIMIT:-240}"; done ;;
  ablation)  # bench_ablation.py on the peerdata captures, without the peer: AB_VARIANTS (e.g. t1) with the engine at
             # AB_TEMPERATURE (0: greedy); AB_BASE / AB_HELDOUT another capture (e.g. answers regenerated at another
             # temperature, the peerdata step moved aside first), AB_NAME its JSON, AB_NGRAM=--no-ngram leaves n-gram out
             step ablation "${AB_LIMIT:-300}" python3 benchmarks/bench_ablation.py --recipe benchmarks/recipes/h200.yaml \
               --base "${AB_BASE:-/tmp/runs/peer/base}" --heldout "${AB_HELDOUT:-/tmp/runs/peer/heldout}" \
               --work "${AB_WORK:-/tmp/runs/ablate}" --variants "${AB_VARIANTS:-baseline}" --seeds "${PEER_SEEDS:-0}" \
               --eval-prompts "${PEER_PROMPTS:-16}" --max-new-tokens 128 --benchmark build/gpu/mtbench_question.jsonl \
               --temperature "${AB_TEMPERATURE:-0}" ${AB_NGRAM:-} --out "$OUT/${AB_NAME:-ablation}.json" ;;
  explain)   # benchmarks/explain_turns.py on the peer step's evaluated run folders: each turn's engine tau beside the drafter's
             # teacher-forced tau on the same tokens, in float32 and in the recipe's dtype (a turn the decoding path lost, or the
             # drafter's blind spot; e.g. MT-Bench question 137, where seed-0 drafters drafted almost nothing, fourteenth session)
             for d in /tmp/runs/peer/work/*-s*; do [ -f "$d/eval/results.json" ] || continue
               for dt in float32 recipe; do step explain "${EXPLAIN_LIMIT:-150}" python3 benchmarks/explain_turns.py "$d" --dtype $dt \
                 --worst 12 --out "$OUT/explain-$(basename "$d")-$dt.json"; done; done ;;
  trainsmoke) R="--run_dir /tmp/runs/h200-smoke --prepare.max_samples 1500 --regenerate.enabled false --train.max_steps ${SMOKE_STEPS:-40} \
               --train.eval_every 20 --train.heldout_samples 64"  # the recipe's training on original answers: compile, speed, held-out
             step trainsmoke "${SMOKE_LIMIT:-200}" bash -c "for s in prepare vocab train; do \
               python3 -m draftsmith.cli \$s benchmarks/recipes/h200.yaml $R || exit 1; done"
             cp /tmp/runs/h200-smoke/train/manifest.json "$OUT/smoke_train_manifest.json" 2>/dev/null
             cp /tmp/runs/h200-smoke/train/metrics.jsonl "$OUT/smoke_train_metrics.jsonl" 2>/dev/null ;;
  profile)   step profile "${PROFILE_LIMIT:-90}" python3 benchmarks/profile_rounds.py benchmarks/recipes/h200.yaml \
               --out "$OUT/profile_rounds.json" ;;
  engine)    step engine "${ENGINE_LIMIT:-240}" python3 benchmarks/bench_engine.py --budget_s "${ENGINE_BUDGET:-170}" \
               ${ENGINE_ARGS:-} --out "$OUT/bench_engine.json" ;;
  engine2)   # a second configuration in the same call (e.g. ENGINE2_ARGS="--fast compile --draft_steps 3")
             step engine2 "${ENGINE2_LIMIT:-240}" python3 benchmarks/bench_engine.py --budget_s "${ENGINE2_BUDGET:-170}" \
               ${ENGINE2_ARGS:-} --out "$OUT/bench_engine2.json" ;;
  verifyattn) step verifyattn "${VA_LIMIT:-150}" python3 benchmarks/bench_verify_attention.py --out "$OUT/bench_verify_attention.json" ;;
  verifyrows) step verifyrows "${VR_LIMIT:-290}" python3 benchmarks/bench_verify_rows.py --budget_s "${VR_BUDGET:-230}" \
               ${VR_ARGS:-} --out "$OUT/verify_rows.json" ;;
  consistency) step consistency "${CONSISTENCY_LIMIT:-180}" python3 -m pytest -q -m gpu tests/test_consistency.py \
               -p no:cacheprovider ;;
  resident)  step resident "${RESIDENT_LIMIT:-200}" python3 benchmarks/bench_resident.py benchmarks/recipes/h200.yaml \
               ${RESIDENT_ARGS:-} --out "$OUT/bench_resident.json" ;;
  residenttests) step residenttests "${RT_LIMIT:-240}" python3 -m pytest -q tests/test_resident.py tests/test_fast.py -k "${RT_K:-}" \
               -p no:cacheprovider ;;
  gputests)  step gputests "${GPUTESTS_LIMIT:-90}" python3 -m pytest -q -m gpu tests/ -p no:cacheprovider ;;
  fasttests) step fasttests "${FASTTESTS_LIMIT:-240}" python3 -m pytest -q tests/test_fast.py -p no:cacheprovider -k "${FASTTESTS_K:-}" ;;
  fast)      step fast "${FAST_LIMIT:-330}" python3 benchmarks/bench_fast.py --moe_target /tmp/ref --out "$OUT/bench_fast.json" ;;
  capture)   step capture 110 python3 benchmarks/bench_capture.py --target /tmp/ref --batch 8 --seq-len 1024 \
               --out "$OUT/bench_capture.json" ;;
  write)     step write 120 python3 benchmarks/bench_write.py --repeats 5 --out "$OUT/bench_write.json" ;;
  train)     step train "${TRAIN_LIMIT:-230}" python3 benchmarks/bench_train.py --out "$OUT/bench_train.json" \
               --budget-s "${TRAIN_BUDGET:-170}" ;;
  trainreal) for w in ${TRAIN_WIDTHS:-4096}; do  # a random-weight Llama of width w captured over real ShareGPT sequences
               SRC=$(ls build/gpu/sharegpt_12000_*.jsonl.gz | head -n 1)  # whichever ShareGPT slice pack_gpu_data.py packed
               R="--target.path /tmp/wide$w --run_dir /tmp/runs/wide$w --prepare.source $SRC ${WIDE_ARGS:-}"
               step "wide$w" "${WIDE_LIMIT:-240}" bash -c "python3 benchmarks/wide_target.py --width $w \
                 --tokenizer build/gpu/tokenizer --out /tmp/wide$w && for s in prepare capture vocab; do \
                 python3 -m draftsmith.cli \$s benchmarks/recipes/h200_wide.yaml $R || exit 1; done"
               for c in off auto; do  # eager first (a figure even if compiling fails), then train.compile's default
                 step "trainreal$w-$c" "${TRAINREAL_LIMIT:-240}" python3 benchmarks/bench_train.py --capture /tmp/runs/wide$w/capture \
                   --compile $c --steps "${TRAINREAL_STEPS:-15}" --warmup "${TRAINREAL_WARMUP:-4}" ${TRAINREAL_ARGS:-} \
                   --out "$OUT/bench_train_real_h$w$([ $c = off ] && echo _eager).json"; done
               rm -rf "/tmp/wide$w" "/tmp/runs/wide$w/capture"; done ;;  # the disk holds one width's capture at a time
  kimi)      step kimi "${KIMI_LIMIT:-200}" python3 benchmarks/bench_train.py --hiddens --out "$OUT/bench_train_kimi.json" \
               --budget-s "${KIMI_BUDGET:-150}" ;;
  *) echo "unknown step $s" ;;
esac; done
ls -la "$OUT"
# The device returns at most 8 files of $OUT (16 MiB each): with more, pack them all into one archive
# (`tar xzf bundle.tar.gz` where the results go) so that none is dropped; left loose if it is too big.
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar czf /tmp/bundle.tar.gz -C "$OUT" . && [ "$(stat -c %s /tmp/bundle.tar.gz)" -lt 16000000 ] \
    && find "$OUT" -mindepth 1 -delete && mv /tmp/bundle.tar.gz "$OUT/bundle.tar.gz" \
    && echo "h200.sh: $OUT packed into bundle.tar.gz (more than the 8 files a device call returns)"
fi
