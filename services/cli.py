"""The `himamba` command: serve, service, generate, make-model, bench."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import msgspec

from himamba.common.config import Config, ConfigError, field_name, resolve_dtype
from himamba.common.config_flags import accepted_notes, add_config_flags, config_from_args, formatter_class
from himamba.common.log import setup_logging
from himamba.common.runtime_dir import resolve_endpoints
from himamba.services.tokenizer.generation_defaults import load_generation_defaults
from himamba.services.tokenizer.http.cors import parse_origins

DEMO_ARCH = "nemotron_h"
DEMO_PRESET = "tiny"


def demo_dir() -> Path:
    base = Path.home() / ".cache" / "himamba"
    return base / f"demo-{DEMO_ARCH}-{DEMO_PRESET}-v1"


class Resolved(NamedTuple):
    """The Config the services run (model paths absolute, dtype concrete) and what start-up logs about it."""

    cfg: Config
    notes: list[str]


def resolve_model(cfg: Config) -> Resolved:
    """Make the model settings concrete before any service starts: `model = "demo"` becomes the demo
    checkpoint (built once), paths become absolute and are checked, `dtype = "auto"` becomes a dtype."""
    m = cfg.model
    if m.model != "demo":
        path = Path(m.model).expanduser()
        if not (path / "config.json").is_file():
            hint = (
                " (hub ids are not downloaded: `hf download <repo> --local-dir DIR`, then pass DIR)"
                if not path.exists()
                else ""
            )
            raise ConfigError(
                f"{field_name('model', 'model')}: {path} is not a checkpoint directory (no config.json){hint}"
            )
        path = path.resolve()
    else:
        path = _demo_checkpoint()
    tokenizer = Path(m.tokenizer).expanduser().resolve() if m.tokenizer else path
    if not (tokenizer / "tokenizer.json").is_file():
        which = field_name("model", "tokenizer") if m.tokenizer else field_name("model", "model")
        raise ConfigError(f"{which}: {tokenizer} has no tokenizer.json")
    chat_template = m.chat_template
    if chat_template and "{{" not in chat_template and "{%" not in chat_template:
        template_path = Path(chat_template).expanduser()
        if not template_path.is_file():
            raise ConfigError(
                f"{field_name('model', 'chat_template')}: {chat_template} is neither a file nor a Jinja template"
            )
        chat_template = str(template_path.resolve())
    generation_config = m.generation_config
    if generation_config not in ("auto", "vllm"):
        generation_config = str(Path(generation_config).expanduser().resolve())
    try:  # checked here so a bad file stops start-up with the flag's name, not a service
        load_generation_defaults(generation_config, path)
    except ValueError as e:
        raise ConfigError(f"{field_name('model', 'generation_config')}: {e}") from None
    if cfg.cache.hicache_storage_group and cfg.cache.hicache_storage_backend == "file":
        from himamba.services.cache.storage.file_modes import resolve_group

        try:  # checked here, not when the cache service opens the tier (that would only turn it off)
            resolve_group(cfg.cache.hicache_storage_group)
        except ValueError as e:
            raise ConfigError(f"{field_name('cache', 'hicache_storage_group')}: {e}") from None
    try:
        parse_origins(cfg.http.allowed_origins)
    except ValueError as e:
        raise ConfigError(f"{field_name('http', 'allowed_origins')}: {e}") from None
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field_name('model', 'model')}: cannot read {path / 'config.json'}: {e}") from None
    dtype = resolve_dtype(m, raw if isinstance(raw, dict) else {})
    model = msgspec.structs.replace(
        m,
        model=str(path),
        tokenizer=str(tokenizer) if m.tokenizer else "",
        chat_template=chat_template,
        generation_config=generation_config,
        dtype=dtype.dtype,
    )
    return Resolved(msgspec.structs.replace(cfg, model=model), [f"dtype {dtype.dtype} ({dtype.why})"])


def _demo_checkpoint() -> Path:
    from himamba.services.modelgen.checkpoint import make_checkpoint

    path = demo_dir()
    if not (path / "config.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # One builder at a time (two first starts on one host): the others wait, then reuse it.
        with open(path.parent / f"{path.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (path / "config.json").exists():
                print(f"building the demo checkpoint (random weights) in {path} ...", file=sys.stderr, flush=True)
                # Built aside and renamed: a reader never sees half a checkpoint.
                tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
                try:
                    make_checkpoint(DEMO_ARCH, tmp, preset=DEMO_PRESET, seed=0)
                    tmp.rename(path)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return path


def _service(name: str, cfg: Config) -> None:
    from himamba.common.runtime_dir import InstanceLock
    from himamba.services.actor import run_actor

    rank = int(os.environ.get("HIMAMBA_TP_RANK", "0") or 0) if name == "worker" else 0
    # held for the process's life: one `name` per instance (one per rank of the worker)
    lock = InstanceLock(cfg, f"worker-rank{rank}" if rank else name)

    if name == "worker" and rank:
        from himamba.services.worker.rank_follower import run_follower

        code = run_follower(cfg, rank)
        lock.release()
        sys.exit(code)
    if name == "worker":
        from himamba.services.worker.service import WorkerService as cls
    elif name == "cache":
        from himamba.services.cache.service import CacheService as cls  # type: ignore[no-redef]
    elif name == "scheduler":
        from himamba.services.scheduler.service import SchedulerService as cls  # type: ignore[no-redef]
    elif name == "tokenizer":
        from himamba.services.tokenizer.service import TokenizerService as cls  # type: ignore[no-redef]
    else:
        raise ConfigError(f"unknown service {name!r}")
    run_actor(cls(cfg))
    lock.release()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="himamba", description="Serve hybrid Mamba/attention models with a tiered prefix cache."
    )
    sub = p.add_subparsers(dest="command", required=True)
    # No abbreviations: `--tok` must not silently mean one of --tokenizer / --tokenizer-ipc.
    flags = {"formatter_class": formatter_class(), "allow_abbrev": False}

    serve = sub.add_parser("serve", help="start the four services and supervise them", **flags)
    serve.add_argument("--config", help="a TOML config file (default: the embedded defaults)")
    add_config_flags(serve, positional_model=True)

    svc = sub.add_parser("service", help="run one service alone (for external supervisors)", **flags)
    svc.add_argument("name", choices=["tokenizer", "scheduler", "worker", "cache"])
    svc.add_argument("--config", help="a TOML (or JSON) config file")
    add_config_flags(svc)

    sub.add_parser("generate", help="stream a completion from a running server", add_help=False)

    mk = sub.add_parser("make-model", help="write a random-weight HF checkpoint (+ tokenizer)")
    mk.add_argument("--arch", required=True)
    mk.add_argument("--out", required=True)
    mk.add_argument("--preset", default="tiny")
    mk.add_argument("--seed", type=int, default=0)

    bench = sub.add_parser("bench", help="benchmarks (print numbers and ratios)", add_help=False)
    bench.add_argument("which", nargs="?")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["service"]:
        # Until the service's event loop takes SIGTERM over, a stop (a process manager stopping a
        # service that is still importing torch) is a clean exit, not a death by signal.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if argv[:1] == ["generate"]:
        from himamba.services.generate_cmd import main as generate_main

        return generate_main(argv[1:])
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = _parser().parse_args(argv)
    if args.command in ("serve", "service"):
        from himamba.services.fd_limit import raise_fd_limit

        raise_fd_limit()  # children inherit it
    try:
        if args.command == "make-model":
            from himamba.services.modelgen.checkpoint import make_checkpoint

            out = make_checkpoint(args.arch, Path(args.out), preset=args.preset, seed=args.seed)
            print(f"wrote a random-weight {args.arch} ({args.preset}) checkpoint to {out}")
            return 0
        asked = resolve_endpoints(config_from_args(args))
        if args.command == "serve":
            from himamba.services.launch import Launcher

            log = setup_logging("launcher", asked.log.level)

            def prepare(cfg: Config) -> Config:
                resolved = resolve_model(cfg)
                for note in [*resolved.notes, *accepted_notes(args)]:
                    log.info("%s", note)
                return resolved.cfg

            # Checked before anything is built or started: a taken instance or port is one line.
            return Launcher(asked, log).run(prepare)
        cfg, notes = resolve_model(asked)
        # Under a process manager the worker, which loads the model, says what auto resolved to (under
        # `himamba serve` the launcher said it, and hands its children a resolved config).
        worker_notes = [*(notes if asked.model.dtype == "auto" else []), *accepted_notes(args)]
        if args.name == "worker" and worker_notes:
            log = setup_logging(args.name, cfg.log.level)
            for note in worker_notes:
                log.info("%s", note)
        _service(args.name, cfg)
    except (ConfigError, ValueError) as e:
        print(f"himamba: {e}", file=sys.stderr)
        return 2
    return 0


def _bench(argv: list[str]) -> int:
    benches = {
        "cache": "himamba.bench.cache",
        "scheduler": "himamba.bench.scheduler",
        "forward": "himamba.bench.forward",
        "kernels": "himamba.bench.kernels",
        "multiturn": "himamba.bench.multiturn",
        "structured": "himamba.bench.structured",
        "serve-overhead": "himamba.bench.serve_overhead",
        "launches": "himamba.bench.launches",
        "prefill-ab": "himamba.bench.prefill_ab",
    }
    if not argv or argv[0] not in benches:
        print(f"usage: himamba bench {{{','.join(benches)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    return int(importlib.import_module(benches[argv[0]]).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
