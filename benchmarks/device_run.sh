#!/usr/bin/env bash
# What one call of the device tool runs (see ../shared/device/README.md): install the carried
# frontend wheel, then the requested parts, logs and results under $OUT.
#   bash benchmarks/device_run.sh tests bench-conv bench-autotune bench-train bench-norm
# Everything under $OUT is packed into $OUT/run.tgz at the end (KEEP_FILES=1: left as is).
# realuse: the README's CLI jobs and examples/ as a new user runs them.
# BENCH_ARGS are passed to the bench scripts; TEST_FILES (default tests/) and TEST_K (a pytest -k expression) narrow the test parts; tests-NAME runs tests/<subject>/test_gpu_NAME.py alone.
set -uo pipefail
# once per machine: a second call of this script in the same command finds the wheels installed
[ -d /tmp/site/cudnn ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} PYTHONUNBUFFERED=1 FUSEKIT_CACHE_DIR=${FUSEKIT_CACHE_DIR:-/tmp/fusekit-cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# test runs report any CUDA-graph capture that gets invalidated, and the event after which it did
# (benchmarks/probes/capture_watch.py; CAPTURE_WATCH=0 turns it off)
if [ "${CAPTURE_WATCH:-1}" = 1 ]; then
  export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/probes PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -p capture_watch" CAPTURE_WATCH_LOG=$OUT/capture_watch.log
fi
for part in "$@"; do
  case $part in
    probe-*)
      timeout ${PROBE_TIMEOUT:-120} python3 "benchmarks/probes/${part//-/_}.py" > "$OUT/${part}.log" 2>&1
      cut -c1-1200 "$OUT/${part}.log" | tail -20 ;;
    tests)
      timeout ${TESTS_TIMEOUT:-330} python3 -m pytest -m gpu -q -p no:cacheprovider -rf ${TEST_K:+-k "$TEST_K"} ${TEST_FILES:-tests/} > "$OUT/gpu_tests.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | cut -c1-300 | tail -45 ;;
    tests-xdist)  # the GPU suite over WORKERS pytest-xdist processes sharing the GPU, tests handed out two at a time as
      # workers free up (--dist load --maxschedchunk 2: the tests marked heavy, collected first, start first, one or two
      # a worker, so no worker is left with a queue of whole models at the end); one fuzz seed
      # for all workers, a report per worker ($OUT/fuzz.gwN.json); the 25 slowest tests listed. Needs the
      # pytest-xdist and execnet wheels in .whl (else run `tests`, one process). TEST_FILES narrows it. At TESTS_TIMEOUT pytest gets SIGINT, so the
      # summary of what ran (passed, failed) is still printed.
      python3 -c "import xdist" 2> /dev/null || { echo "tests-xdist: pytest-xdist is not importable (put its and execnet's wheels in .whl)"; continue; }
      dist="--dist load --maxschedchunk 2"; python3 -m pytest --help 2> /dev/null | grep -q maxschedchunk || dist="--dist worksteal"  # (older xdist)
      export FUSEKIT_FUZZ_SEED=${FUSEKIT_FUZZ_SEED:-$(python3 -c "import random; print(random.SystemRandom().randrange(2**32))")}
      FUSEKIT_FUZZ_REPORT=$OUT/fuzz.json FUSEKIT_CACHE_DIR=/tmp/fk-cache timeout -s INT -k 30 ${TESTS_TIMEOUT:-450} python3 -m pytest -n "${WORKERS:-14}" --junitxml="$OUT/junit_xdist.xml" \
        $dist -m "gpu and not alone" -q -p no:cacheprovider -rf --tb=short --durations=25 ${TEST_K:+-k "$TEST_K"} ${TEST_FILES:-tests/} > "$OUT/gpu_tests_xdist.log" 2>&1
      FUSEKIT_CACHE_DIR=/tmp/fk-cache-alone timeout ${TESTS_TIMEOUT:-330} python3 -m pytest -m "gpu and alone" -q -p no:cacheprovider -rf --tb=short \
        ${TEST_K:+-k "$TEST_K"} ${TEST_FILES:-tests/} > "$OUT/gpu_tests_alone.log" 2>&1
      for k in xdist alone; do echo "$k:"; grep -E "^(FAILED|ERROR)|passed|failed|skipped in" "$OUT/gpu_tests_$k.log" | cut -c1-300 | tail -25 \
        || { echo "  no test summary: pytest stopped before it (last lines below)"; tail -6 "$OUT/gpu_tests_$k.log" | cut -c1-300; }; done
      python3 - "$OUT" <<'PY'
import glob, json, sys
rs = [json.load(open(p)) for p in sorted(glob.glob(f"{sys.argv[1]}/fuzz.*.json"))]
if rs:
    print(f"fusekit fuzz: {sum(r['cases'] for r in rs)} cases, {sum(r['failures'] for r in rs)} failures over {len(rs)} workers, "
          f"seed {rs[0]['seed']}, longest worker {max(r['seconds'] for r in rs):.0f} s")
PY
      grep -A 27 "slowest 25" "$OUT/gpu_tests_xdist.log" | cut -c1-200
      [ -s "$OUT/capture_watch.log" ] && head -40 "$OUT/capture_watch.log" | cut -c1-300 ;;
    tests-diag)  # TEST_FILES (node ids) in one process with long tracebacks, CUDA-graph trees recording allocation sites; the E lines printed
      FUSEKIT_TEST_CUDAGRAPH_HISTORY=1 timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=long \
        ${TEST_K:+-k "$TEST_K"} ${TEST_FILES:-tests/} > "$OUT/gpu_tests_diag.log" 2>&1
      grep -E "^E |^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests_diag.log" | cut -c1-300 | head -80 ;;
    tests-*)
      timeout 480 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/*/"test_gpu_${part#tests-}.py" > "$OUT/gpu_${part}.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_${part}.log" | cut -c1-300 | tail -30 ;;
    notebooks)  # needs the nbclient/ipykernel wheels in .whl (see notebooks/execute.py); executed copies and key figures under $OUT
      timeout -k 10 ${NOTEBOOKS_TIMEOUT:-240} python3 notebooks/execute.py --out "$OUT/notebooks" --figures "$OUT/figures" > "$OUT/notebooks.log" 2>&1
      rc=$?; echo "notebooks: execute.py exit $rc$([ $rc -eq 124 ] && echo ", timed out after ${NOTEBOOKS_TIMEOUT:-240} s")"
      grep -E "^python |ipynb: |error: |passed, |stopped by|cannot run" "$OUT/notebooks.log" | cut -c1-400 | tail -20
      ls "$OUT/figures" 2>/dev/null | tr '\n' ' '; echo ;;
    realuse)  # a new user's main jobs in a fresh cache: doctor, autotune one layer, the cache's checks, the examples
      ( export FUSEKIT_CACHE_DIR=/tmp/fk-realuse
        python3 -m fusekit doctor | tail -4
        python3 -m fusekit autotune conv_bias_relu --shape x=32,64,56,56 --shape w=64,64,3,3 --shape b=64 --attr padding=1 2>&1 | tail -6
        python3 -m fusekit cache ls | tail -3; python3 -m fusekit cache verify
        timeout 150 python3 examples/train_resnet.py --steps 30 --graphed --control | tail -7
        timeout 90 python3 examples/autoencoder.py --steps 100 | tail -4 ) > "$OUT/realuse.log" 2>&1
      cut -c1-300 "$OUT/realuse.log" | tail -40 ;;
    bg-bench-*)  # a benchmark in the background (memory figures, not timings), waited for at the end
      name=${part#bg-}
      timeout ${BG_TIMEOUT:-250} python3 "benchmarks/${name//-/_}.py" --out "$OUT" ${BG_ARGS:-} > "$OUT/${name}.log" 2>&1 & ;;
    bench-*)
      timeout ${BENCH_TIMEOUT:-150} python3 "benchmarks/${part//-/_}.py" --out "$OUT" ${BENCH_ARGS:-} > "$OUT/${part}.log" 2>&1
      grep -v "^|" "$OUT/${part}.log" | tail -14 | cut -c1-300 ;;
  esac
done
wait  # background parts
# the tool returns at most 8 files: everything under $OUT travels back as one archive, run.tgz
if [ -z "${KEEP_FILES:-}" ]; then
  tar czf /tmp/run.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/run.tgz "$OUT/run.tgz"
  echo "packed \$OUT into run.tgz ($(du -h "$OUT/run.tgz" | cut -f1))"
fi
