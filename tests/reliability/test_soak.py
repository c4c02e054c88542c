"""Soak: chaos waves back to back. After every wave the keepers equal the no-cache reference and the
pools drain clean; at the end the services' resident memory has not kept growing.

The suite runs a short soak (SHORT_WAVES waves: enough to pass warm-up and see a wave on warm caches);
HIMAMBA_SOAK=1 runs it for HIMAMBA_SOAK_MINUTES (default 10) instead, which is where slow growth shows."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import time

import pytest

from tests.reliability.chaos_wave import NUM_VICTIMS, run_wave
from tests.reliability.pools import assert_nothing_leaked, wait_drained
from tests.reliability.prompts import mixed_prompts

KEEPERS = 24
SHORT_WAVES = 12


def _rss_kib(launcher_pid: int) -> dict[str, int]:
    """Resident memory of each service (KiB), from ps."""
    out = subprocess.run(["ps", "-ww", "-o", "rss=,args=", "--ppid", str(launcher_pid)], capture_output=True, text=True, check=False)
    found = {}
    for line in out.stdout.splitlines():
        rss, args = line.strip().split(" ", 1)
        parts = args.split()
        if "service" in parts:
            found[parts[parts.index("service") + 1]] = int(rss)
    return found


def test_chaos_waves_for_minutes(served, reference_tokens):
    long_soak = os.environ.get("HIMAMBA_SOAK") == "1"
    deadline = time.monotonic() + 60 * float(os.environ.get("HIMAMBA_SOAK_MINUTES", "10"))
    rng = random.Random(11)
    wave = 0
    baseline: dict[str, int] = {}
    while (time.monotonic() < deadline) if long_soak else (wave < SHORT_WAVES):
        mix = mixed_prompts(KEEPERS + NUM_VICTIMS, seed=90_000 + wave, max_tokens=(2, 24))
        keepers, victims = mix[:KEEPERS], mix[KEEPERS:]
        got, _ = asyncio.run(run_wave(served, keepers, victims, rng))
        want = reference_tokens([(p.input_ids, p.max_tokens) for p in keepers])
        assert got == want, f"wave {wave}: keepers differ from the reference"
        assert served.main.proc.poll() is None, f"wave {wave}: the server died"
        assert_nothing_leaked(wait_drained(served.main))
        if wave == 2:  # after warm-up: caches and allocator arenas have reached their size
            baseline = _rss_kib(served.main.proc.pid)
        wave += 1
    final = _rss_kib(served.main.proc.pid)
    grown = {k: (baseline[k], final.get(k, 0)) for k in baseline if final.get(k, 0) > 1.5 * baseline[k] + 65536}
    assert not grown, f"resident memory kept growing over {wave} waves (KiB before, after): {grown}"
