"""Where one server's endpoints live: a private runtime directory per instance.

A server is an *instance* with a name (`[endpoints] instance`, default `port-<HTTP port>`;
required when HTTP is off). Its ZeroMQ endpoints are unix sockets in its own directory,
`<base>/<instance>/`, mode 0700 and owned by the server's user, so no other local user can
connect to any of them (abstract unix sockets have no permissions at all). The base is, first
found: `[endpoints] runtime_dir`, `$RUNTIME_DIRECTORY` (systemd's `RuntimeDirectory=`),
`$XDG_RUNTIME_DIR/himamba`, `/run/himamba` for root, else `<tmp>/himamba-<uid>`.

Several servers per host need nothing but a different `--port` (or `--instance`): each has its
own directory and sockets. A process that binds endpoints takes a lock file in the directory
first, so a second server of the same instance is a one-line error instead of stealing the
first one's sockets (binding a unix socket path replaces whatever was there).

Clients find a server the same way, by `port` or `instance` (`client_endpoint`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import IO

import msgspec

from himamba.common.config import Config, ConfigError

# endpoint field -> socket file name in the instance directory
SOCKETS = {
    "zmq_endpoint": "client.sock",
    "tokenizer_ipc": "tokenizer.sock",
    "scheduler_ipc": "scheduler.sock",
    "worker_ipc": "worker.sock",
    "cache_ipc": "cache.sock",
    "control_ipc": "control.sock",
}
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class RuntimeDirError(ConfigError):
    """The runtime directory cannot be used safely, or the instance is taken; one line says why."""


def instance_name(cfg: Config) -> str:
    """The instance this config names: its own, or one derived from the HTTP port."""
    name = cfg.endpoints.instance
    if not name:
        if not cfg.http.port:
            raise RuntimeDirError("instance: HTTP is off (--port 0), so name this server with --instance NAME")
        name = f"port-{cfg.http.port}"
    if not _NAME.fullmatch(name):
        raise RuntimeDirError(f"instance: {name!r} is not a valid name (letters, digits, '.', '_', '-'; at most 64)")
    return name


def runtime_base(runtime_dir: str = "") -> Path:
    """The directory that holds the instances' directories (see the module docstring)."""
    if runtime_dir:
        return Path(runtime_dir)
    if os.environ.get("RUNTIME_DIRECTORY"):  # systemd may list several, ':'-separated
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "himamba"
    if os.geteuid() == 0:
        return Path("/run/himamba")
    return Path(tempfile.gettempdir()) / f"himamba-{os.geteuid()}"


def instance_dir(cfg: Config) -> Path:
    return runtime_base(cfg.endpoints.runtime_dir) / instance_name(cfg)


def _check_owned(path: Path, what: str, forbidden_bits: int) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"{what} {path} is not a directory (a symlink or a file): refusing to use it")
    if st.st_uid != os.geteuid():
        raise RuntimeDirError(
            f"{what} {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
            f"refusing to use it (remove it, or choose --runtime-dir)"
        )
    if st.st_mode & forbidden_bits:
        # Ours, so nobody else made it: tighten it rather than refuse.
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~forbidden_bits)


def ensure_private_dir(path: Path) -> Path:
    """Create (or check) the instance directory: 0700, ours, under a base no one else can
    write into. Raises RuntimeDirError saying what is wrong."""
    base = path.parent
    for d, mode in ((base, 0o700), (path, 0o700)):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise RuntimeDirError(f"runtime directory: {d.parent} does not exist") from None
        except PermissionError:
            raise RuntimeDirError(f"runtime directory: no permission to create {d}") from None
    # The base may be shared (systemd's RuntimeDirectory is 0755): others may read it, not write it.
    _check_owned(base, "runtime directory", stat.S_IWGRP | stat.S_IWOTH)
    _check_owned(path, "instance directory", 0o077)
    return path


def socket_endpoint(directory: Path, field: str) -> str:
    path = directory / SOCKETS[field]
    check_path_length(path)
    return f"ipc://{path}"


def check_path_length(path: Path) -> None:
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise RuntimeDirError(
            f"unix socket path {path} is {len(os.fsencode(path))} bytes, more than the {_SUN_PATH_MAX} "
            f"the kernel allows: choose a shorter --runtime-dir or --instance"
        )


def _check_explicit(field: str, endpoint: str, insecure: bool, curve: bool = False) -> None:
    """An endpoint the operator set: filesystem unix sockets are theirs to place; the others
    reach beyond this user and need `insecure_endpoints` (or, for the client endpoint over
    tcp, CURVE keys: `curve`)."""
    if endpoint.startswith("ipc://@"):
        if not insecure:
            raise RuntimeDirError(
                f"{field}: {endpoint} is an abstract unix socket, which any local user can reach; leave it "
                f"unset (a socket in the instance's private directory) or set insecure_endpoints"
            )
    elif endpoint.startswith("ipc://"):
        check_path_length(Path(endpoint[len("ipc://") :]))
    elif endpoint.startswith("tcp://"):
        if not (insecure or curve):
            hint = " (or curve_secret_key_file and curve_clients_dir)" if field == "zmq_endpoint" else ""
            raise RuntimeDirError(
                f"{field}: {endpoint} is reachable from the network without authentication; leave it unset "
                f"(a private unix socket){hint} or set insecure_endpoints"
            )
    else:
        raise RuntimeDirError(f"{field}: {endpoint!r} must be ipc:///path or tcp://host:port")


def resolve_endpoints(cfg: Config) -> Config:
    """The config with its instance named and every unset endpoint made a socket in the
    instance's private directory (created and checked here)."""
    name = instance_name(cfg)
    ep = cfg.endpoints
    directory = ensure_private_dir(runtime_base(ep.runtime_dir) / name)
    filled: dict[str, str] = {"instance": name}
    if bool(ep.curve_secret_key_file) != bool(ep.curve_clients_dir):
        raise RuntimeDirError("curve_secret_key_file and curve_clients_dir go together: set both or neither")
    for path in (ep.curve_secret_key_file, ep.curve_clients_dir):
        if path and not os.path.exists(path):
            raise RuntimeDirError(f"CURVE: {path} does not exist")
    for field in SOCKETS:
        value = getattr(ep, field)
        if value:
            curve = field == "zmq_endpoint" and bool(ep.curve_secret_key_file)
            _check_explicit(field, value, ep.insecure_endpoints, curve)
        else:
            filled[field] = socket_endpoint(directory, field)
    return msgspec.structs.replace(cfg, endpoints=msgspec.structs.replace(ep, **filled))


def client_endpoint(*, instance: str = "", port: int = 0, runtime_dir: str = "") -> str:
    """The client endpoint of the server named by `instance` or by its HTTP `port` (default:
    the default port's), as the server would place it for this user."""
    if not instance:
        instance = f"port-{port or Config().http.port}"
    if not _NAME.fullmatch(instance):
        raise RuntimeDirError(f"instance: {instance!r} is not a valid name")
    return socket_endpoint(runtime_base(runtime_dir) / instance, "zmq_endpoint")


class InstanceLock:
    """An exclusive lock on `<instance dir>/<what>.lock`, held while the process lives."""

    def __init__(self, cfg: Config, what: str):
        self.path = instance_dir(cfg) / f"{what}.lock"
        self._file: IO[str] | None = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            f = os.fdopen(fd, "r+")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    f.close()
                    raise
                holder = f.read().strip() or "?"
                f.close()
                raise RuntimeDirError(
                    f"instance {instance_name(cfg)!r} is already running ({what}, pid {holder}): "
                    f"choose another --port or --instance"
                ) from None
            # The holder before us removes the file as it stops (`remove`): a lock on a file no
            # longer at the path locks nothing, so take the one that is there now.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            f.close()
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        """Release the lock and remove its file (a clean stop leaves no lock file behind)."""
        if self._file is not None:
            try:
                self.path.unlink()  # while still held: the next holder locks a new file
            except FileNotFoundError:
                pass
        self.release()


def remove_runtime_files(cfg: Config) -> None:
    """Remove the instance's socket and service lock files once every service has stopped (the
    server's own lock goes with `InstanceLock.remove`). Only files of the instance directory."""
    directory = instance_dir(cfg)
    for field in SOCKETS:
        endpoint = getattr(cfg.endpoints, field)
        path = Path(endpoint.removeprefix("ipc://")) if endpoint.startswith("ipc://") else None
        if path is not None and path.parent == directory:
            path.unlink(missing_ok=True)
    for name in ("worker", "cache", "scheduler", "tokenizer"):
        (directory / f"{name}.lock").unlink(missing_ok=True)
