#!/usr/bin/env bash
# What an offline GPU machine needs besides its image (torch, transformers, peft) to run benchmarks/gpu_check.py:
# the wheels of the pure-Python packages polyrl's check imports and such an image lacks (pydantic and its parts,
# a typing-extensions as new as pydantic wants; trl and datasets with their small dependencies), for CPython 3.12
# on manylinux x86_64, and SmolLM2's tokenizer from polyrl's cache (made from the bundled model here, once). All
# go into gpu-bundle/ (git-ignored); the bundle travels with the working tree, and the two must stay under 60 MiB.
#
#   bash scripts/gpu_bundle.sh                 # here, with polyrl's environment active; then on the GPU machine:
#   pip install -q --no-index --no-deps --target /tmp/gpu-check/site-packages gpu-bundle/wheels/*.whl
#   POLYRL_CACHE=gpu-bundle/polyrl-cache PYTHONPATH=/tmp/gpu-check/site-packages:. python benchmarks/gpu_check.py
#
# The folder's name ends in site-packages because datasets hashes its tables with dill, which pickles the classes
# of modules found outside such a folder by value, and fails on some of them.
#
# datasets (so TRL) also needs pyarrow and pandas, left out: their wheels are 55 and 12 MB, over the limit. On an
# image without them the check's TRL part says so and the rest runs. --with-arrow adds them, for a bundle that
# may be larger.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=gpu-bundle
LIMIT_MIB=60
PACKAGES=(
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
)
if [[ "${1:-}" == "--with-arrow" ]]; then
  PACKAGES+=(pyarrow==26.0.1 pandas==3.1.1)
fi

rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/polyrl-cache"
for package in "${PACKAGES[@]}"; do  # one at a time: --no-deps, so each pin is exactly what travels
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT/wheels" "$package"
done
tokenizer=$(python -c "from polyrl.models.loading import smollm2_tokenizer_dir; print(smollm2_tokenizer_dir())")
cp -r "$tokenizer" "$OUT/polyrl-cache/smollm2-tokenizer"

bundle=$(du -cb "$OUT" | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "gpu-bundle: $(ls "$OUT/wheels" | wc -l) wheels and the tokenizer, $(mib "$bundle") MiB;" \
  "working tree $(mib "$tree") MiB; together $(mib $((bundle + tree))) MiB (limit $LIMIT_MIB MiB)"
if (( bundle + tree > LIMIT_MIB * 1048576 )); then
  echo "gpu-bundle: over the limit" >&2
  exit 1
fi
