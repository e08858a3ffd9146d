#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool's `run`, carrying .gpu): build llama.cpp for
# CUDA with ../shared/gpu's kit, write a model with a real vocabulary size, and measure the
# sampling loads against greedy at 64 slots. Everything lands under $OUT; a step that runs out
# of time loses only the steps after it. About 9 minutes on an H200 (the build is 5 of them).
#
#   here:  bash ../shared/gpu/make-kit.sh
#   there: bash benchmarks/gpu_session.sh          (run(..., carry=[".gpu"], timeout_s=595))
#
# STEPS picks the measurements (default "auto threads per-tick graph"; "llama-server" too); the build
# and the model always come first.
#
# A process whose first native library is not llama.cpp's dies with SIGSEGV at model load on
# this kit's CUDA build (docs/gpu.md): a sitecustomize that imports llama_cpp makes it first in
# every Python process the script starts (bench_sampling's crash went unseen once, under
# 2>/dev/null).
set -u
R=$(pwd)
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-/tmp/m1b262k.gguf}
STEPS=" ${STEPS:-auto threads per-tick graph} "
want() { [[ $STEPS == *" $1 "* ]]; }
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
T0=$SECONDS
stamp() { echo "=== $1 at $((SECONDS - T0)) s"; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl
model_writer=
if [ ! -f "$MODEL" ]; then
    PYTHONPATH=/tmp/site:$R python3 -m benchmarks.gpu_model "$MODEL" > "$OUT/model.log" 2>&1 &
    model_writer=$!
fi
# The worker's two C libraries (csrc/sampling, csrc/kernels: every .c there, as
# pyproject.toml's ext-modules list them; pip builds them elsewhere) for this machine's
# Python, and what its CPU offers them (a flat row's top-p wants AVX-512).
if [ -f csrc/sampling/rowscan.c ]; then
    suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    gcc -O3 -shared -fPIC -Icsrc/include -o "worker/sampling/_sampling$suffix" csrc/sampling/*.c -lm -ldl || exit 1
    gcc -O3 -shared -fPIC -Icsrc/include -o "worker/engine/_kernels$suffix" csrc/kernels/*.c -lm -ldl || exit 1
fi
grep -m1 'model name' /proc/cpuinfo
grep -o -m1 -w 'avx512f' /proc/cpuinfo || echo "no avx512f"
bash .gpu/build.sh || exit 1
# Its own PID: a bare `wait` (bash 5.1 on) also waits for the `tee` above, which never ends;
# that hung a whole 10-minute call once.
[ -z "$model_writer" ] || wait "$model_writer"
cat "$OUT/model.log" 2>/dev/null
stamp "build and model"

source .gpu/env.sh > /dev/null
# The working tree installs as the package `loomserve` (pyproject's package-dir): a folder of
# links gives it that name without pip.
LINKS=${LINKS:-/tmp/ls}
mkdir -p "$LINKS/loomserve"
for d in cli gateway protocol worker; do ln -sfn "$R/$d" "$LINKS/loomserve/$d"; done
mkdir -p /tmp/sc
# llama.cpp's libraries first, as the worker loads them (cli/main.py: a CUDA build crashed
# at model load when other extension modules had loaded before it).
printf '%s\n' "import llama_cpp" > /tmp/sc/sitecustomize.py
export PYTHONPATH=/tmp/sc:$LINKS${PYTHONPATH:+:$PYTHONPATH}

bench="python3 -m benchmarks.gpu_bench --model $MODEL --bin /tmp/k/build/bin --slots 64"
bench="$bench --concurrency 64 --prompts-per-stream 3"
if want auto; then
    timeout 200 $bench --only ceiling,loomserve --loads greedy,t1,topp --out "$OUT/graph"
    grep -o -m1 '"sampling": "[a-z]*"' "$OUT/graph/loomserve.log"
    stamp "loomserve, sampling where auto puts it"
fi
if want threads; then
    timeout 100 $bench --only loomserve --loads greedy,t1,topp --loomserve-args "--sampling-threads 8" \
        --out "$OUT/threads-8"
    stamp "loomserve, 8 sampling threads"
fi
if want graph; then
    timeout 120 $bench --only loomserve --loads greedy,t1 --loomserve-args "--backend-sampling on" \
        --out "$OUT/in-graph"
    stamp "loomserve, sampled in the graph"
fi
if want per-tick; then
    python3 -c 'from loomserve.worker.sampling import rowscan; print("rowscan isa", rowscan.library() and rowscan.library().ls_isa())'
    timeout 120 python3 -m benchmarks.bench_sampling --model "$MODEL" --threads 8 --slots 64 \
        --reps 3 --ticks 10 --sampling-threads 1,8,16 2>"$OUT/per-tick.log" | tee "$OUT/per-tick.txt"
    stamp "per tick"
fi
if want llama-server; then
    timeout 100 $bench --only llama-server --loads greedy,t1,topp \
        --server-args "--backend-sampling" --out "$OUT/llama-server"
    stamp "llama-server --backend-sampling"
fi
