"""The OpenMP wait policy each process gets: the worker's bounded spin (model.omp_spin) or an
immediate sleep, never over the user's own OMP_WAIT_POLICY / GOMP_SPINCOUNT; the bench mirrors it."""

from __future__ import annotations

import pytest

from himamba.bench.forward import wait_env
from himamba.common.config import Config, ModelConfig
from himamba.common.openmp_wait import describe_openmp_wait, openmp_wait_env
from himamba.services.launch import _child_env


def test_a_spin_sets_gomp_spincount_and_no_policy() -> None:
    env = openmp_wait_env({"PATH": "/bin"}, 20000)
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": "20000"}
    assert describe_openmp_wait(env) == "GOMP_SPINCOUNT=20000"


def test_no_spin_sleeps_at_once() -> None:
    assert openmp_wait_env({}, 0) == {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "5"}])
@pytest.mark.parametrize("spin", [0, 20000])
def test_the_users_own_setting_wins(user: dict[str, str], spin: int) -> None:
    assert openmp_wait_env(user, spin) == user


def test_libgomps_default_is_named_when_nothing_is_set() -> None:
    assert "libgomp's default" in describe_openmp_wait({})


def test_only_a_cpu_worker_spins(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    cpu = Config(model=ModelConfig(omp_spin=30000))
    assert _child_env("worker", cpu)["GOMP_SPINCOUNT"] == "30000"
    assert "OMP_WAIT_POLICY" not in _child_env("worker", cpu)
    for service in ("tokenizer", "scheduler", "cache"):
        env = _child_env(service, cpu)
        assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env
    cuda = Config(model=ModelConfig(omp_spin=30000, device="cuda"))
    assert _child_env("worker", cuda)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert _child_env("worker", Config())["OMP_WAIT_POLICY"] == "PASSIVE"  # the default: no spin
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert _child_env("worker", cpu)["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "GOMP_SPINCOUNT" not in _child_env("worker", cpu)


def test_the_bench_runs_every_engine_under_the_policy_asked_for() -> None:
    user = {"PATH": "/bin", "GOMP_SPINCOUNT": "7"}
    assert wait_env("server", 20000, {"PATH": "/bin"}) == {"PATH": "/bin", "GOMP_SPINCOUNT": "20000"}
    assert wait_env("server", 20000, user) == user  # as the server: the user's own wins
    assert wait_env("passive", 20000, user) == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert wait_env("active", 0, user) == {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE"}
    assert wait_env("inherit", 20000, user) == user
