"""scripts/test.sh, the README's test command and CI's only step: it names the Debian packages the
tests use exactly as tests/system_packages.py does, says which are missing and what they skip,
and installs the test extra under the torch constraint before running pytest."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.system_packages import ALL

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "test.sh"


def _needs() -> dict[str, tuple[str, str]]:
    """scripts/test.sh's NEEDS: Debian packages -> (probe, what skips without them)."""
    block = re.search(r"^NEEDS=\(\n(.*?)^\)", SCRIPT.read_text(), re.MULTILINE | re.DOTALL)
    assert block, "scripts/test.sh has no NEEDS=( ... ) table"
    rows = [line.strip().strip('"').split("|") for line in block.group(1).splitlines() if line.strip()]
    return {names: (probe, skips) for names, probe, skips in rows}


def test_the_script_and_the_tests_name_the_same_packages():
    assert {names: probe for names, (probe, _) in _needs().items()} == {p.names: p.probe for p in ALL}


def test_ci_runs_exactly_the_script():
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert commands == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', "exec scripts/test.sh"]


def test_the_readme_runs_the_script_and_the_docs_name_every_package_it_may_skip_for():
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"^```bash\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert first_block
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands[1] == "scripts/test.sh"
    page = (ROOT / "docs" / "getting-started" / "tests.md").read_text()
    skips = page.split("## Skipped tests", 1)
    assert len(skips) == 2, "docs/getting-started/tests.md has no '## Skipped tests' section"
    rows = [line for line in skips[1].split("\n## ", 1)[0].splitlines() if line.startswith("| `needs Debian package")]
    for package in ALL:
        assert any(package.names in row for row in rows), f"no skip row names {package.names}"


# What the fake apt-get "installs": each package's command, as an empty script.
_COMMANDS = {"gcc": "cc", "prometheus": "promtool", "redis-server": "redis-server", "systemd": "systemd-analyze",
             "util-linux": "prlimit"}  # fmt: skip


def _run_without_packages(
    tmp_path: Path, *args: str, root_with_apt: bool = False
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The script on a PATH holding only the few tools it uses itself (no apt-get, no package's
    command), with a python whose pip and pytest only record their arguments. `root_with_apt`:
    `id -u` says 0 and an apt-get records its arguments and "installs" each package's command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "record"
    fakes = {
        "python": "#!/bin/bash\n"
        f'if [[ $1 == -m ]]; then echo "$*" >>{record}; [[ $2 != pip ]] || cat "${{@: -3:1}}" >>{record}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    }
    if root_with_apt:
        installs = " ".join(f"{package}) touch {bin_dir / command}; chmod +x {bin_dir / command};;"
                            for package, command in _COMMANDS.items())  # fmt: skip
        fakes["id"] = "#!/bin/bash\necho 0\n"
        fakes["apt-get"] = (
            f'#!/bin/bash\necho "apt-get $*" >>{record}\n'
            f'[[ $1 != install ]] || for p in "$@"; do case $p in {installs} esac; done\n'
        )
    for tool in ("dirname", "mktemp", "rm", "id", "tail", "cat", "env", "touch", "chmod"):
        if tool not in fakes:
            found = shutil.which(tool)
            assert found, tool
            (bin_dir / tool).symlink_to(found)
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": str(bin_dir), "PYTHON": str(bin_dir / "python"), "HOME": str(tmp_path)}
    out = subprocess.run(
        ["/bin/bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    return out, record.read_text().splitlines() if record.exists() else []


def test_without_installing_each_missing_package_is_named_with_what_it_skips(tmp_path):
    out, ran = _run_without_packages(tmp_path, "--no-system-packages", "-k", "nothing")
    assert out.returncode == 0, out.stderr
    assert "installing" not in out.stdout + out.stderr
    for names, (probe, skips) in _needs().items():
        named = f"missing Debian package {names} (no {probe.partition(':')[2]}): skips {skips}" in out.stderr
        command_probe = probe.startswith("cmd:")  # none of those is on this PATH; libraries are the machine's
        assert named == (command_probe or not next(p for p in ALL if p.names == names).present()), (names, out.stderr)
    assert ran == [
        "-m pip install -q -c " + ran[0].split(" -c ")[1].split()[0] + " -e .[test]",
        "torch>=2.11,<2.14",
        "-m pytest -rs -k nothing",
    ]


def test_where_it_cannot_install_it_says_why_and_still_runs_the_tests(tmp_path):
    out, ran = _run_without_packages(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "no apt-get here: installing no Debian package" in out.stderr
    assert "missing Debian package redis-server" in out.stderr
    assert ran[-1] == "-m pytest -rs"


def test_as_root_it_installs_every_missing_package_then_names_only_what_is_still_missing(tmp_path):
    out, ran = _run_without_packages(tmp_path, root_with_apt=True)
    assert out.returncode == 0, out.stderr
    missing_here = [p for p in ALL if p.probe.startswith("cmd:") or not p.present()]
    want = " ".join(p.names for p in missing_here)
    assert f"installing Debian packages: {want}" in out.stdout
    assert ran[:2] == ["apt-get update -qq", f"apt-get install -y -qq --no-install-recommends {want}"]
    assert ran[-1] == "-m pytest -rs"
    for package in ALL:  # the fake installed the commands, not the libraries
        still = f"missing Debian package {package.names} " in out.stderr
        assert still == (package.probe.startswith("lib:") and not package.present()), (package, out.stderr)
