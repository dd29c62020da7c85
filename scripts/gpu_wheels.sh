#!/usr/bin/env bash
# Wheels for the GPU machine (no internet, no TRL): trl==1.16.0 and the dependencies it needs
# that a machine with torch + transformers does not have (accelerate, datasets and its tree,
# pandas, pyarrow, ...), each `pip download`ed with --no-deps at the version of
# requirements.lock, for the GPU machine's Python (default 3.12) on manylinux x86_64.
#
#   bash scripts/gpu_wheels.sh [DEST=.gpu/wheels] [PYTHON_VERSION=3.12]
#
# pyarrow (~40 MiB) goes to DEST-pyarrow, the rest (~25 MiB) to DEST: the device tool carries at
# most 64 MiB of ignored paths per call (FlashInfer's AOT tarball is another ~18 MiB), and what a
# call carried stays on the warm machine, so carry .gpu/wheels-pyarrow in one call and
# .gpu/wheels + .gpu/flashinfer_aot.tar.xz in the next (scripts/gpu_check.sh installs from both).
# On the GPU machine: a venv with --system-site-packages, then pip install --no-index
# --find-links .gpu/wheels --find-links .gpu/wheels-pyarrow trl==1.16.0 (pip resolves
# against torch/transformers already there and takes only what is missing; gpu_check.sh does it).
# .gpu/ is git-ignored (.gitignore).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.gpu/wheels}"
PYVER="${2:-3.12}"
PIP="${PIP:-/work/main/.venv/bin/python -m pip}"
LOCK=requirements.lock
# trl's own requirements (minus torch/transformers/numpy/huggingface_hub/packaging/pyyaml/jinja2,
# which a torch + transformers machine has) and datasets', pandas' and multiprocess' below them.
PACKAGES=(trl accelerate datasets pandas pyarrow psutil dill multiprocess xxhash python-dateutil tzdata)
mkdir -p "$DEST"
pin() {  # the lock's version of $1 (names compared case- and -/_-insensitively)
  local want; want=$(echo "$1" | tr 'A-Z_' 'a-z-')
  awk -F'==' -v w="$want" '{n=tolower($1); gsub("_","-",n); if (n==w) {print $2; exit}}' "$LOCK"
}
for p in "${PACKAGES[@]}"; do
  v=$(pin "$p")
  if [ -z "$v" ]; then echo "gpu_wheels: $p is not in $LOCK" >&2; exit 1; fi
  dest="$DEST"; [ "$p" = pyarrow ] && dest="$DEST-pyarrow"
  mkdir -p "$dest"
  $PIP download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --implementation cp --dest "$dest" "$p==$v"
done
ls -1 "$DEST" "$DEST-pyarrow"
du -sh "$DEST" "$DEST-pyarrow" | awk '{print "gpu_wheels: " $1 " in " $2}'
