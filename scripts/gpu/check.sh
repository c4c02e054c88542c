#!/usr/bin/env bash
# The GPU check: run on an (offline) H100/H200 from the repository root, with the wheels that
# scripts/gpu/fetch-wheels.sh downloaded beside it; every step under its own time limit, inside 8
# minutes in all on one GPU (9 with two or more, where the tp step runs). Each step prints one `CHECK <name> PASS|FAIL|INFO|SKIP <figures>` line as it ends
# and adds its record to RESULTS_DIR/gpu-check.json (logs and figures land there too).
#
#   scripts/gpu/check.sh [--rehearse | --dry-run] [--only STEP,...] [--wheels DIR] [--python PY] RESULTS_DIR
#
# Steps: install (the carried wheels and the project, offline, beside the image's torch), env
# (versions; dispatch picks the Triton twins), kernels (every twin against its reference on CUDA,
# float32 and bfloat16, the twins' cases and serving shapes), parity (greedy tokens against
# transformers on CUDA, every family it carries), serve (`himamba serve --device cuda`, device- and
# host-tier prefix hits equal to recompute), throughput (8B-shaped Nemotron-H, bf16: decode and prefill
# beside their rooflines, CUDA graphs on and off), copies (host<->device GB/s, pageable vs pinned),
# tp (`--tensor-parallel-size 2` over NCCL: transformers' tokens through device and host hits, a dead
# rank stopping the server; SKIP with fewer than two GPUs; the rehearsal runs it over gloo).
# --rehearse runs every step on this CPU at tiny sizes (the CUDA-only parts report SKIP);
# --dry-run prints every step as SKIP and exits 0. The exit status is 1 when any step FAILs.
set -uo pipefail
cd "$(dirname "$0")/../.."

mode=gpu only="" wheels=.gpu-wheels results="" py=python3
while (($#)); do
    case "$1" in
        --rehearse) mode=rehearse ;;
        --dry-run) mode=dry-run ;;
        --only) only="$2"; shift ;;
        --wheels) wheels="$2"; shift ;;
        --python) py="$2"; shift ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        -*) echo "check.sh: unknown option $1" >&2; exit 2 ;;
        *) results="$1" ;;
    esac
    shift
done
[[ -n "$results" ]] || { echo "usage: scripts/gpu/check.sh [--rehearse|--dry-run] [--only STEP,...] RESULTS_DIR" >&2; exit 2; }
mkdir -p "$results" && results=$(cd "$results" && pwd)
rm -f "$results/gpu-check.json"

export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
record="python3 -P scripts/gpu/check_record.py $results"
failures=0

# name, time limit in seconds (on the GPU; the rehearsal's sizes are tiny), kind of result
steps=(install:30:info env:20:info kernels:100:tests parity:70:tests serve:100:tests throughput:90:figures copies:40:figures tp:80:tests)

wanted() { [[ -z "$only" || ",$only," == *",$1,"* ]]; }

install_cmd() {
    # The image's torch, triton and the rest stay: --no-index can only take what the wheels folder holds.
    if $py -m pip install -q --no-index --find-links "$wheels" --no-build-isolation -e . ; then
        echo "installed: pip install --no-index --find-links $wheels -e ."
        return 0
    fi
    # An image whose setuptools cannot build an editable install: the wheels into a folder of their
    # own, and the project imported from the checkout through a shim of the package-dir mapping.
    echo "editable install failed; installing the wheels with --target and a package shim"
    local site=/tmp/himamba-site
    $py -m pip install -q --no-index --no-deps --target "$site" "$wheels"/*.whl || return 1
    mkdir -p "$site/himamba"
    for d in common services kernels; do ln -sfn "$PWD/$d" "$site/himamba/$d"; done
    echo "$site" > "$results/pythonpath"
}

env_cmd() {
    $py -P - <<'PY'
import importlib, pkgutil, torch
import himamba.services, himamba.common, himamba.kernels
from himamba.kernels import dispatch
# Storage backends' clients are extras (pyproject's `storage`; Mooncake's wheel is the operator's);
# the Triton twins are imported only for CUDA tensors (a CPU server runs without triton).
OPTIONAL = ("redis", "mooncake", "triton")
names, optional = [], []
for pkg in (himamba.common, himamba.kernels, himamba.services):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        try:
            importlib.import_module(m.name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in OPTIONAL:
                raise
            optional.append(f"{m.name} (needs {e.name})")
            continue
        names.append(m.name)
versions = {"torch": torch.__version__}
for name in ("triton", "transformers", "msgspec", "zmq", "llguidance"):
    try:
        versions[name] = importlib.import_module(name).__version__
    except Exception as e:
        versions[name] = f"missing ({type(e).__name__})"
cuda = torch.cuda.is_available()
device = torch.cuda.get_device_name() if cuda else "cpu"
picks = dispatch.uses_triton(torch.zeros(1, device="cuda")) if cuda else "SKIP (no CUDA)"
print(f"imported {len(names)} modules (not {optional or 'none'}: optional extras); device {device}; {versions}; dispatch picks triton on cuda: {picks}")
PY
}


run_step() {  # name limit kind
    local name=$1 limit=$2 kind=$3 log="$results/$1.log" figures="" rc
    if [[ "$mode" == dry-run ]]; then
        $record "$name" skip 0 0 "$limit" "dry run: nothing ran"
        return
    fi
    local device=cuda size=full interp=""
    # The rehearsal's shapes are tiny, but 2 CPU cores run the twins under the interpreter and the servers' models;
    # HIMAMBA_CHECK_REHEARSAL_SCALE (default 4) stretches the limits further on a machine others share.
    if [[ "$mode" == rehearse ]]; then
        device=cpu size=tiny interp=1 limit=$((limit * ${HIMAMBA_CHECK_REHEARSAL_SCALE:-4}))
    fi
    local start=$SECONDS
    case "$name" in
        install)
            if [[ "$mode" == rehearse ]]; then
                $record "$name" skip 0 0 "$limit" "rehearsal: the project is installed here (tests/gpu/test_offline_install.py installs it offline)"
                return
            fi
            timeout -k 5 "$limit" bash -c "$(declare -f install_cmd); py=$py wheels=$wheels results=$results install_cmd" >"$log" 2>&1 ;;
        env) timeout -k 5 "$limit" bash -c "$(declare -f env_cmd); py=$py env_cmd" >"$log" 2>&1 ;;
        kernels)
            if [[ "$mode" == rehearse ]]; then
                # The twins' CUDA-only modules skip themselves on the CPU; the serving-shape cases run under the interpreter.
                HIMAMBA_TEST_DEVICE=$device HIMAMBA_CHECK_SIZE=$size TRITON_INTERPRET=$interp \
                    timeout -k 5 "$limit" $py -P -m pytest -v -p no:cacheprovider -rfE tests/gpu/test_serving_shapes.py >"$log" 2>&1
            else
                HIMAMBA_TEST_DEVICE=$device timeout -k 5 "$limit" $py -P -m pytest -v -p no:cacheprovider -rfE \
                    $(xdist 8) tests/kernels/test_triton_cuda.py tests/kernels/test_cuda.py tests/gpu/test_serving_shapes.py >"$log" 2>&1
            fi ;;
        parity)
            HIMAMBA_TEST_DEVICE=$device HIMAMBA_CHECK_SIZE=$size HIMAMBA_CHECK_FIGURES="$results/parity.jsonl" \
                timeout -k 5 "$limit" $py -P -m pytest -v -p no:cacheprovider -rfE $(xdist 6) tests/gpu/test_cuda_parity.py >"$log" 2>&1 ;;
        serve)
            if [[ "$mode" == rehearse ]]; then
                HIMAMBA_TEST_DEVICE=$device timeout -k 5 "$limit" $py -P -m pytest -v -p no:cacheprovider -rfE \
                    tests/e2e/test_prefix_cache.py -k "small_device_pool" >"$log" 2>&1
            else
                HIMAMBA_TEST_DEVICE=$device timeout -k 5 "$limit" $py -P -m pytest -v -p no:cacheprovider -rfE \
                    $(xdist 2 "--dist loadfile") tests/e2e/test_prefix_cache.py tests/e2e/test_serve_cuda.py >"$log" 2>&1
            fi ;;
        tp)
            if [[ "$mode" != rehearse ]]; then
                local gpus
                gpus=$($py -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
                if ((gpus < 2)); then
                    $record "$name" skip 0 0 "$limit" "$gpus GPU(s): tensor parallelism needs two or more"
                    return
                fi
            fi
            HIMAMBA_TEST_DEVICE=$device timeout -k 5 "$limit" $py -P -m pytest -v -p no:cacheprovider -rfE \
                tests/e2e/test_tensor_parallel.py >"$log" 2>&1 ;;
        throughput|copies)
            figures="$results/$name.json"
            local flag=""
            [[ "$mode" == rehearse ]] && flag=--rehearse
            timeout -k 5 "$limit" $py -P "scripts/gpu/$name.py" --out "$figures" $flag >"$log" 2>&1 ;;
    esac
    rc=$?
    if [[ "$name" == serve ]]; then
        # What the served workers said of their graphs, warm-up and host copies (their logs are the tests' temp files).
        grep -rhoE "CUDA graphs: .*|warm-up: .*|host pools pinned.*|host copies pageable.*" /tmp/pytest-of-*/ 2>/dev/null \
            | sed -E 's/[0-9]+\.[0-9]+s/Ns/; s/[0-9]+ MiB/N MiB/' | sort | uniq -c > "$results/serve-server-lines.txt"
    fi
    local line
    line=$($record "$name" "$kind" "$rc" "$((SECONDS - start))" "$limit" "$log" "$figures")
    echo "$line"
    [[ "$line" == "CHECK $name FAIL"* ]] && failures=$((failures + 1))
    if [[ "$name" == install && -f "$results/pythonpath" ]]; then
        export PYTHONPATH="$(cat "$results/pythonpath")${PYTHONPATH:+:$PYTHONPATH}"
    fi
}

# The image has pytest-xdist: compiling the Triton twins for each test is CPU work, spread over the cores.
xdist() { $py -c "import xdist" 2>/dev/null && echo "-n $1 ${2:-}"; }
echo "check.sh: mode $mode, results in $results"
for step in "${steps[@]}"; do
    IFS=: read -r name limit kind <<<"$step"
    wanted "$name" && run_step "$name" "$limit" "$kind"
done
echo "check.sh: $failures step(s) failed"
[[ "$mode" == dry-run ]] && exit 0
((failures == 0))
