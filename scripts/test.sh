#!/usr/bin/env bash
# The README's test command, and all CI runs: on a fresh machine it installs the Debian packages
# the tests use (where this user may), then the Python packages, then runs pytest.
#
#   scripts/test.sh [--no-system-packages] [PYTEST_ARGS...]
#
# --no-system-packages (or HIMAMBA_TEST_SYSTEM_PACKAGES=0) installs no Debian package, for machines
# where that is not allowed. Either way each package still missing is named, with the tests that
# skip without it (pytest's -rs summary names them again, test by test). PYTHON picks the
# interpreter (default: the `python` on PATH, e.g. an activated venv's).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1 # the repo root must never land on sys.path
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PIP_DISABLE_PIP_VERSION_CHECK=1
PYTHON=${PYTHON:-$(command -v python || command -v python3)}

system_packages=${HIMAMBA_TEST_SYSTEM_PACKAGES:-1}
if [[ ${1:-} == --no-system-packages ]]; then
    system_packages=0
    shift
fi

# Debian packages | what shows they are there (cmd:COMMAND or lib:SONAME) | what skips without them.
# tests/system_packages.py gives the tests the same names; tests/test_test_script.py keeps the two in step.
NEEDS=(
    "gcc libc6-dev|cmd:cc|the native CPU kernels' tests (tests/kernels: test_native*.py and every [native] case)"
    "prometheus|cmd:promtool|the promtool lints of /metrics and the alert rules (tests/metrics), and the fleet (tests/ops/test_fleet.py)"
    "redis-server|cmd:redis-server|the Redis storage backend's tests (tests/cache/storage, [redis] cases in tests/cache, e2e, reliability), and the fleet"
    "systemd|cmd:systemd-analyze|systemd-analyze verify of the shipped units (tests/ops/test_configs.py)"
    "util-linux|cmd:prlimit|the hostile-client tests (tests/hostile), whose server runs under prlimit"
    "libibverbs1|lib:libibverbs.so.1|the Mooncake Store tests (the wheel and mooncake_master link it, even over TCP): every [mooncake] case"
    "libnl-3-200|lib:libnl-3.so.200|the Mooncake Store tests: every [mooncake] case"
    "libnl-route-3-200|lib:libnl-route-3.so.200|the Mooncake Store tests: every [mooncake] case"
)

present() {
    case $1 in
    cmd:*) command -v "${1#cmd:}" >/dev/null 2>&1 ;;
    lib:*) "$PYTHON" -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1])' "${1#lib:}" >/dev/null 2>&1 ;;
    esac
}

absent() {
    local need
    for need in "${NEEDS[@]}"; do
        IFS='|' read -r _ probe _ <<<"$need"
        present "$probe" || printf '%s\n' "$need"
    done
}

mapfile -t missing < <(absent)
if ((${#missing[@]})) && [[ $system_packages == 1 ]]; then
    packages=()
    for need in "${missing[@]}"; do
        read -ra names <<<"${need%%|*}"
        packages+=("${names[@]}")
    done
    as_root=()
    if [[ $(id -u) != 0 ]]; then
        as_root=(sudo -n)
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "scripts/test.sh: no apt-get here: installing no Debian package" >&2
    elif ((${#as_root[@]})) && ! { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; }; then
        echo "scripts/test.sh: not root and no password-less sudo: installing no Debian package" >&2
    else
        echo "scripts/test.sh: installing Debian packages: ${packages[*]}"
        log=$(mktemp)
        if ! { "${as_root[@]}" apt-get update -qq &&
            "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
                apt-get install -y -qq --no-install-recommends "${packages[@]}"; } >"$log" 2>&1; then
            echo "scripts/test.sh: apt-get failed:" >&2
            tail -n 20 "$log" >&2
        fi
        rm -f "$log"
    fi
    mapfile -t missing < <(absent)
fi
for need in "${missing[@]}"; do
    IFS='|' read -r names probe skips <<<"$need"
    echo "scripts/test.sh: missing Debian package ${names} (no ${probe#*:}): skips ${skips}" >&2
done

# The constraint keeps every package from pulling another (multi-GB CUDA) torch: within the
# project's range pip takes this machine's local CPU wheel.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch>=2.11,<2.14" >"$constraints"
"$PYTHON" -m pip install -q -c "$constraints" -e '.[test]'

# -rs: every skip with its reason, at the end of the run.
"$PYTHON" -m pytest -rs "$@"
