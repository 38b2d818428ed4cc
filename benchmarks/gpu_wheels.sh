#!/usr/bin/env bash
# Download the wheels that a CUDA machine with no network needs to run archon and
# benchmarks/gpu_suite.py, for CPython 3.12 on x86-64 Linux. torch is not among them: the machine's
# own CUDA build of torch (2.11 or later) is used.
#
#     bash benchmarks/gpu_wheels.sh [DIR]        # default DIR: .whl (git ignores it)
#
# Then, on the GPU machine, from the repository root (DIR copied along with the checkout):
#
#     python3 -m pip install --no-index --find-links DIR transformers==5.19.0 peft==0.21.2 tyro==1.0.17
#     python3 benchmarks/gpu_suite.py --out gpu_suite_out
#
# pip takes each requirement the machine already satisfies as it is and installs the rest from DIR.
# DIR holds transformers, tyro, safetensors, tokenizers, huggingface-hub and everything they need
# (numpy included), plus peft and accelerate without their dependencies, since those would drag in
# torch; their other dependencies are already in DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="${1:-.whl}"
PYTHON_VERSION=3.12
# Versions that CI runs with (pyproject.toml: transformers >=5.16.1,<5.20; peft in the test extra).
TRANSFORMERS=5.19.0
PEFT=0.21.2
ACCELERATE=1.16.0
TYRO=1.0.17
SAFETENSORS=0.8.0
TOKENIZERS=0.23.3
HUGGINGFACE_HUB=2.4.0

# pip matches each manylinux tag exactly, so name every glibc level up to the one of the target.
PLATFORMS=()
for tag in manylinux1_x86_64 manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 \
           manylinux_2_35_x86_64 manylinux_2_39_x86_64; do
  PLATFORMS+=(--platform "$tag")
done
TARGET=(--only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp "${PLATFORMS[@]}")

mkdir -p "$DIR"
python3 -m pip download -q "${TARGET[@]}" -d "$DIR" \
  "transformers==$TRANSFORMERS" "tyro==$TYRO" "safetensors==$SAFETENSORS" "tokenizers==$TOKENIZERS" \
  "huggingface-hub==$HUGGINGFACE_HUB" psutil
python3 -m pip download -q "${TARGET[@]}" --no-deps -d "$DIR" "peft==$PEFT" "accelerate==$ACCELERATE"

if ls "$DIR" | grep -qi '^torch-'; then
  echo "gpu_wheels.sh: a torch wheel reached $DIR; the GPU machine must keep its own torch" >&2
  exit 1
fi
echo "$(ls "$DIR" | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR:"
ls "$DIR"
