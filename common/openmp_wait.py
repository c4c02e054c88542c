"""How a process's idle OpenMP threads wait between parallel regions, set through its environment
(libgomp, torch's OpenMP, reads it once, when torch loads it).

Sleeping at once (OMP_WAIT_POLICY=PASSIVE) leaves the cores to whoever else needs them, but every
parallel op then wakes the sleeping threads first (tens of microseconds each on a VM). Spinning a
bounded number of iterations first (GOMP_SPINCOUNT, without OMP_WAIT_POLICY) keeps the threads
awake across the back-to-back ops of a step and still lets them sleep soon after it ends; spinning
without bound (OMP_WAIT_POLICY=ACTIVE) starves every other process on the same cores. The user's
own OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins.
"""

from __future__ import annotations

from collections.abc import Mapping

USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_wait_env(environ: Mapping[str, str], spin: int) -> dict[str, str]:
    """`environ` with the wait policy of a process whose idle threads spin `spin` iterations
    (0: sleep at once) — unless `environ` already chooses one."""
    env = dict(environ)
    if any(name in env for name in USER_VARIABLES):
        return env
    if spin > 0:
        env["GOMP_SPINCOUNT"] = str(spin)
    else:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def describe_openmp_wait(environ: Mapping[str, str]) -> str:
    """The wait policy `environ` gives, in words (for logs and bench reports)."""
    chosen = [f"{name}={environ[name]}" for name in USER_VARIABLES if name in environ]
    return ", ".join(chosen) if chosen else "libgomp's default (spin 300000 iterations, then sleep)"
