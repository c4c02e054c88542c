"""himamba.bench: every `himamba bench …` benchmark and what only benchmarks use (servers they start,
workloads, reports, the machine line). Benchmarks may import the whole product; the product (common,
kernels, services) never imports this package: `services/cli.py` names the subcommands' modules and
imports the one asked for (tests/test_layering.py checks both)."""
