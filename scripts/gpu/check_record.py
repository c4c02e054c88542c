"""One finished step of the GPU check: its `CHECK <name> PASS|FAIL|INFO|SKIP <figures>` line on stdout,
and its record added to RESULTS_DIR/gpu-check.json.

    python -P scripts/gpu/check_record.py RESULTS_DIR NAME KIND RC SECONDS LIMIT LOG [FIGURES]

KIND: `tests` (a pytest run with -v: PASS when it exits 0 having passed something; the counts, and on
a failure the failed tests' names), `figures` (a measuring script: INFO with its figures file's key
numbers, FAIL when it exits non-zero), `info` (INFO with the log's last line), or `skip` (LOG is the reason).
RC 124 or 137 means the step ran out of time: a FAIL saying what it reached."""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


def test_counts(log: str) -> dict[str, int]:
    """Outcomes of a `pytest -v` log so far (complete or cut off by a timeout)."""
    counts = dict.fromkeys(OUTCOMES, 0)
    # `path::test OUTCOME` (plain -v) or `[gwN] [ p%] OUTCOME path::test` (pytest-xdist)
    for m in re.finditer(
        r"::\S+ (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)|\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) \S+::", log
    ):
        counts[m.group(1) or m.group(2)] += 1
    return {k: v for k, v in counts.items() if v}


def failed_tests(log: str) -> list[str]:
    return sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)))


def last_line(log: str) -> str:
    lines = [ln for ln in log.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _short(figures: dict) -> str:
    """The figures that matter most, on one line."""
    parts = []
    for key, value in figures.items():
        if isinstance(value, dict):
            inner = {k: v for k, v in value.items() if not isinstance(v, dict)}
            if inner:
                parts.append(f"{key}=" + ",".join(f"{k}:{_num(v)}" for k, v in inner.items()))
            for sub, subvalue in value.items():
                if isinstance(subvalue, dict):
                    parts.append(f"{key}[{sub}]=" + ",".join(f"{k}:{_num(v)}" for k, v in subvalue.items()))
        else:
            parts.append(f"{key}={_num(value)}")
    return " ".join(parts)


def _num(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace(" ", "_")


def record(
    results: Path, name: str, kind: str, rc: int, seconds: float, limit: int, log_path: str, figures_path: str
) -> str:
    timed_out = rc in (124, 137)
    entry: dict = {"name": name, "seconds": round(seconds, 1), "limit_s": limit, "rc": rc}
    if kind == "skip":
        status, summary = "SKIP", log_path
    else:
        log = Path(log_path).read_text(errors="replace") if Path(log_path).is_file() else ""
        if kind == "tests":
            counts = test_counts(log)
            entry["tests"] = counts
            failed = failed_tests(log)
            entry["failed"] = failed
            summary = " ".join(f"{k.lower()}={v}" for k, v in counts.items()) or last_line(log)
            status = "PASS" if rc == 0 and counts.get("PASSED", 0) else "FAIL"
            if rc == 5 or (rc == 0 and not counts.get("PASSED", 0) and counts.get("SKIPPED", 0)):
                status = "SKIP"
            if failed:
                summary += " failed: " + ", ".join(failed[:8]) + (" ..." if len(failed) > 8 else "")
        else:
            status = "INFO" if rc == 0 else "FAIL"
            summary = last_line(log)
            if figures_path and Path(figures_path).is_file():
                figures = json.loads(Path(figures_path).read_text())
                entry["figures"] = figures
                summary = _short(figures)
        if timed_out:
            status = "FAIL"
            summary = f"timed out after {limit} s; reached: {summary}"
        elif rc != 0 and status == "FAIL" and kind != "tests":
            summary = f"exit {rc}: {last_line(log)}"
    entry.update(status=status, summary=summary)
    path = results / "gpu-check.json"
    doc = json.loads(path.read_text()) if path.is_file() else {"steps": []}
    doc.setdefault("started", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    doc["steps"].append(entry)
    path.write_text(json.dumps(doc, indent=1))
    return f"CHECK {name} {status} {summary}"


def main(argv: list[str]) -> int:
    results, name, kind, rc, seconds, limit, log = argv[:7]
    figures = argv[7] if len(argv) > 7 else ""
    print(record(Path(results), name, kind, int(rc), float(seconds), int(limit), log, figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
