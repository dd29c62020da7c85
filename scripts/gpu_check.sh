#!/usr/bin/env bash
# Issue 34's GPU checks in one call of the device tool (run from the repository root):
#
#   bash scripts/gpu_check.sh [STEP ...]       # on the GPU machine; default: every step
#   GPU_CHECK_CPU=1 bash scripts/gpu_check.sh  # rehearsal on a CPU machine (smoke sizes; PYTHON=
#                                              # the interpreter, GPU_CHECK_EXTRA_SITE= a directory
#                                              # with torch + transformers for the install's venv)
#
# Steps, in order, each under its own timeout, its output in $OUT/<step>.log and one JSON line
# {"step", "rc", "seconds"} appended to $OUT/steps.jsonl as it ends (a run cut short keeps what
# it measured; the benchmarks append their own JSON lines to $OUT/*.jsonl cell by cell):
#   env      GPU, driver, python, torch, transformers, flashinfer, trl versions
#   install  FlashInfer AOT (.gpu/flashinfer_aot.tar.xz -> /tmp/site) and the wheels of
#            scripts/gpu_wheels.sh (.gpu/wheels*, into a venv with --system-site-packages)
#   memory   tests/gpu/test_memory_gpu.py -s (the 40-call test; its drift printed)
#   pytest   python -m pytest -m gpu tests/gpu (every GPU test; junit XML in $OUT)
#   trl      benchmarks/bench_trl_step_gpu.py (stock GRPOTrainer vs ours, memory after each step)
#   decode   benchmarks/bench_decoding_gpu.py 0.6B, B=8, 32k and 4k, CUDA graphs
#   fused    tests/gpu/test_fused_gpu.py -s (the fused step: compile + capture, parity, kernels
#            per step printed), tests/gpu/test_votes_gpu.py and test_kv_write_gpu.py -s (the
#            fused Triton kernels: dispatch, parity, their times against the stock ops printed)
#            and benchmarks/bench_decode_kernels.py --smoke --cuda (torch.profiler kernels per
#            step: eager / CUDA graph / fused; JSON in $OUT/decode_kernels.json)
#   snapkv   benchmarks/bench_decode_kernels.py --schedule-only --cuda: the decode table's 32k cell
#            (0.6B, B=8, budget 2048, CUDA graphs) with StreamingLLM, SnapKV, RKV, SnapKV, RKV in one
#            process: ms/token, compression events and each event's seconds, captures and dynamo
#            graphs per call (is SnapKV's 6.7 ms/token a one-time cost of its first call? JSON in
#            $OUT/snapkv_schedule.json; ~2 min)
#   rollout  benchmarks/bench_rollout_gpu.py: the RL shape (64 requests x (512 prompt + log-normal
#            lengths, std = mean, mean 2,048, capped at 8,192), budget 512: dense static vs the
#            continuous Scheduler per policy, each row against its bandwidth floor, and the
#            head-of-line case (JSON in $OUT/rollout.jsonl; sized to ~3 min)
#   trl20    benchmarks/bench_trl_step_gpu.py --memory-steps 20: our rows only, memory after each of
#            20 steps (flat within 64 MiB?) (JSON in $OUT/trl_memory.jsonl)
#            (ROLLOUT_ARGS / ROLLOUT_TIMEOUT override the sizes and the limit; PYTEST_TIMEOUT the
#            pytest step's limit)
#   rkv      benchmarks/bench_decoding_gpu.py at 8 x 32k for Dense and RKV only (no HF row), with
#            teacher forcing (JSON in $OUT/rkv.jsonl; ~1 min)
# Budget: about 12-13 minutes on an H100 in all (pytest ~2 min, trl < 4 min, decode ~2 min,
# fused ~2 min, snapkv ~2 min: not measured yet).
# Prepare on the CPU machine first: bash ../shared/gpu/build_flashinfer_aot.sh and
# bash scripts/gpu_wheels.sh; carry .gpu (see gpu_wheels.sh for the 64 MiB carry limit).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT="${OUT:-$ROOT/results/gpu-check}"
mkdir -p "$OUT"
CPU="${GPU_CHECK_CPU:-0}"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env install memory pytest trl decode fused snapkv)
PY=python3
[ "$CPU" = 1 ] && PY="${PYTHON:-python3}"
export PYTHONPATH="/tmp/site:$ROOT/src:$ROOT/integrations/trl/src:$ROOT" FLASHINFER_WORKSPACE_BASE=/tmp/fiws \
    PYTHONUNBUFFERED=1

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  echo "== $name: $*" | tee -a "$OUT/steps.log"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; rc=$?
  printf '{"step": "%s", "rc": %d, "seconds": %d}\n' "$name" "$rc" "$((SECONDS - t0))" \
      | tee -a "$OUT/steps.jsonl"
  tail -n 25 "$OUT/$name.log"
  return 0
}

install() {
  if [ -f .gpu/flashinfer_aot.tar.xz ]; then
    mkdir -p /tmp/site && tar -xJf .gpu/flashinfer_aot.tar.xz -C /tmp/site && echo "flashinfer AOT unpacked"
  else
    echo "no .gpu/flashinfer_aot.tar.xz: FlashInfer JIT or not installed (backend auto may pick torch)"
  fi
  local links=()
  for d in .gpu/wheels*; do [ -d "$d" ] && links+=(--find-links "$d"); done
  if [ ${#links[@]} -eq 0 ]; then echo "no .gpu/wheels*: TRL not installed (the trl step will fail)"; return 0; fi
  $PY -m venv --system-site-packages /tmp/gpu-venv || return 1
  if [ -n "${GPU_CHECK_EXTRA_SITE:-}" ]; then  # CPU rehearsal: torch + transformers live there
    echo "$GPU_CHECK_EXTRA_SITE" > "$(/tmp/gpu-venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/extra.pth"
    /tmp/gpu-venv/bin/python -m pip uninstall -q -y setuptools 2>/dev/null || true  # use the site's
  fi
  /tmp/gpu-venv/bin/python -m pip install --no-index "${links[@]}" trl==1.16.0 || return 1
  /tmp/gpu-venv/bin/python -c "import trl, datasets, accelerate; print('trl', trl.__version__)"
}

env_info() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
  $PY - <<'PYEOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name())
for m in ("transformers", "flashinfer", "trl", "datasets", "accelerate"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as exc:
        print(m, "missing:", type(exc).__name__, exc)
PYEOF
}

export -f install env_info
export PY CPU
for s in "${STEPS[@]}"; do
  [ -x /tmp/gpu-venv/bin/python ] && PY=/tmp/gpu-venv/bin/python
  case $s in
    env) step env 60 bash -c env_info ;;
    install) step install 240 bash -c install ;;
    memory) step memory 180 $PY -m pytest -q -s -m gpu tests/gpu/test_memory_gpu.py -p no:cacheprovider -rfEs \
                -o addopts="" ;;
    pytest) step pytest "${PYTEST_TIMEOUT:-300}" $PY -m pytest -q -s -m gpu tests/gpu -p no:cacheprovider -rfEs -o addopts="" \
                --junitxml "$OUT/pytest-gpu.xml" ;;
    trl) if [ "$CPU" = 1 ]; then step trl 240 $PY benchmarks/bench_trl_step_gpu.py --smoke --out "$OUT/trl_step.jsonl"
         else step trl 300 $PY benchmarks/bench_trl_step_gpu.py --out "$OUT/trl_step.jsonl"; fi ;;
    decode) if [ "$CPU" = 1 ]; then step decode 240 $PY benchmarks/bench_decoding_gpu.py --smoke --out "$OUT/decode.jsonl"
            else step decode 240 $PY benchmarks/bench_decoding_gpu.py --models qwen3-0.6b --batches 8 \
                     --contexts 32768,4096 --cuda-graph --out "$OUT/decode.jsonl"; fi ;;
    fused) step fused 240 bash -c "$PY -m pytest -q -s -m gpu tests/gpu/test_fused_gpu.py tests/gpu/test_votes_gpu.py tests/gpu/test_kv_write_gpu.py -p no:cacheprovider -rfEs -o addopts='' ; $PY benchmarks/bench_decode_kernels.py --smoke --cuda --no-fused --json $OUT/decode_kernels.json" ;;
    snapkv) if [ "$CPU" = 1 ]; then step snapkv 240 $PY benchmarks/bench_decode_kernels.py --schedule-only --smoke \
                --json "$OUT/snapkv_schedule.json"
            else step snapkv 240 $PY benchmarks/bench_decode_kernels.py --schedule-only --cuda \
                --json "$OUT/snapkv_schedule.json"; fi ;;
    rollout) if [ "$CPU" = 1 ]; then step rollout 240 $PY benchmarks/bench_rollout_gpu.py --smoke --out "$OUT/rollout.jsonl"
             else step rollout "${ROLLOUT_TIMEOUT:-330}" $PY benchmarks/bench_rollout_gpu.py ${ROLLOUT_ARGS:---n 64 \
                 --prompt 512 --mean 2048 --cap 8192 --budget 512 --buffer 64 --policies rkv,streaming_llm --hf-n 4 \
                 --hf-cap 128 --hol-long 2048} --out "$OUT/rollout.jsonl"; fi ;;
    trl20) if [ "$CPU" = 1 ]; then step trl20 240 $PY benchmarks/bench_trl_step_gpu.py --smoke --memory-steps 3 \
               --out "$OUT/trl_memory.jsonl"
           else step trl20 300 $PY benchmarks/bench_trl_step_gpu.py --memory-steps 20 --out "$OUT/trl_memory.jsonl"; fi ;;
    rkv) if [ "$CPU" = 1 ]; then step rkv 240 $PY benchmarks/bench_decoding_gpu.py --smoke --policies dense,rkv --no-hf \
             --out "$OUT/rkv.jsonl"
         else step rkv 200 $PY benchmarks/bench_decoding_gpu.py --models qwen3-0.6b --batches 8 --contexts 32768 \
             --cuda-graph --policies dense,rkv --no-hf --out "$OUT/rkv.jsonl"; fi ;;
    *) echo "gpu_check: unknown step $s (env install memory pytest trl trl20 decode fused snapkv rollout rkv)" >&2; exit 2 ;;
  esac
done
echo "gpu_check: done; $OUT/steps.jsonl:"; cat "$OUT/steps.jsonl"
