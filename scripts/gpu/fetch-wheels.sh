#!/usr/bin/env bash
# Downloads, on a CPU machine with a package registry, the cp312 manylinux wheels that a GPU image lacks
# (its torch, triton, transformers, uvloop, aiohttp, tokenizers, ... stay as they are) into a git-ignored
# folder that travels to the offline GPU machine beside the repository; scripts/gpu/check.sh installs them.
#
#   scripts/gpu/fetch-wheels.sh [DIR]        (default: .gpu-wheels at the repository root)
#
# PYTHON_VERSION (default 3.12, the GPU images') picks the interpreter the wheels are for.
#
# The list is what himamba imports at run time and the images named in docs/serving/gpu.md do not ship, with
# everything those wheels require: msgspec, pyzmq, llguidance and isal require nothing else.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="${1:-.gpu-wheels}"
# Each name with the version range pyproject.toml asks for, so the GPU machine installs what CI tests.
wheels=("msgspec>=0.19" "pyzmq>=26" "llguidance>=1.9.1,<2" "isal>=1.6")
limit_mib=48

rm -rf "$dir" && mkdir -p "$dir"
# pip matches each manylinux tag exactly: name the ones these projects publish for x86-64.
platforms=()
for tag in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
           manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64; do
    platforms+=(--platform "$tag")
done
for spec in "${wheels[@]}"; do
    echo "fetch-wheels: $spec"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
        "${platforms[@]}" -d "$dir" "$spec"
done
# A wheel that needs another distribution on CPython 3.12 / Linux would fail the offline install: say so here.
python3 - "$dir" <<'PY'
import sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement
import os
version = os.environ.get("PYTHON_VERSION", "3.12")
env = {"python_version": version, "python_full_version": version + ".0", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
       "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
missing = []
for whl in sorted(Path(sys.argv[1]).glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is None or req.marker.evaluate(env):
                    missing.append(f"{whl.name} requires {req}")
if missing:
    sys.exit("fetch-wheels: " + "; ".join(missing))
PY
size_kib=$(du -sk "$dir" | cut -f1)
ls -1 "$dir"
echo "fetch-wheels: $(ls "$dir" | wc -l) wheels, $((size_kib / 1024)) MiB in $dir (limit ${limit_mib} MiB)"
if ((size_kib > limit_mib * 1024)); then
    echo "fetch-wheels: over the ${limit_mib} MiB a GPU machine's carry allows" >&2
    exit 1
fi
