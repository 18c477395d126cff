"""Checks the command line runs before loading anything: the model source and the port to serve on.

Each failure raises UsageError with one line that says what is wrong (the command line prints it and exits
with status 2), instead of a traceback from deep inside a loader seconds later.
"""
from __future__ import annotations

import errno
import importlib.util
import json
import socket
from pathlib import Path

from lamina.models.builtin import BUILTIN, INSTALL_HINT


class UsageError(Exception):
    """A mistake in what the user asked for; str(e) is the one-line message to show."""


def builtin_path(name: str) -> Path:
    """The file of a built-in model; UsageError if the package that carries it is missing."""
    package, filename = BUILTIN[name]
    # find_spec, not import: the package's __init__ imports llama_cpp, which we neither need nor install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"the built-in model {name!r} needs the package {package}: {INSTALL_HINT[name]}")
    return Path(list(spec.submodule_search_locations)[0]) / filename


def model_file(model: str) -> tuple[str, Path | None]:
    """(kind, path) of a model argument: ("builtin" | "gguf" | "hf", path) or ("random", None); raises
    UsageError for a source that cannot be a model, saying what is missing."""
    if model in BUILTIN:
        return "builtin", builtin_path(model)
    if model.startswith("random:"):
        from lamina.models.presets import PRESETS

        preset = model.split(":", 1)[1]
        if preset not in PRESETS:
            raise UsageError(f"unknown preset {preset!r}; the random: presets are {', '.join(PRESETS)}")
        return "random", None
    path = Path(model).expanduser()
    if not path.exists():
        raise UsageError(f"model {model!r} does not exist (give an HF model directory, a .gguf file, or a "
                         f"built-in name: {', '.join(BUILTIN)})")
    if path.is_file():
        if path.suffix != ".gguf":
            raise UsageError(f"{path} is a file but not a .gguf file (give a .gguf file or an HF model directory)")
        return "gguf", path
    if (path / "config.json").is_file():
        return "hf", path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if len(ggufs) > 1:
        raise UsageError(f"{path} has no config.json and {len(ggufs)} .gguf files: name the .gguf file to load")
    raise UsageError(f"{path} has no config.json (an HF model directory needs config.json and *.safetensors)")


def check_model_source(model: str) -> None:
    """Everything about the model that can be checked without loading it: it exists, its config or GGUF
    header is readable and complete, and its architecture is one lamina supports."""
    kind, path = model_file(model)
    if kind == "random":
        return
    if kind == "hf":
        _check_hf_dir(path)
    else:
        _check_gguf(path)


def _check_hf_dir(path: Path) -> None:
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path / 'config.json'} is not readable JSON ({e})") from None
    if not isinstance(hf, dict):
        raise UsageError(f"{path / 'config.json'} is not a JSON object")
    from lamina.models.registry import supported_architectures

    archs = hf.get("architectures") or []
    supported = supported_architectures()
    if not any(a in supported for a in archs):
        raise UsageError(f"unsupported model architecture {archs or hf.get('model_type')!r} in {path}; "
                         f"lamina supports {', '.join(supported)}")
    if not any(path.glob("*.safetensors")):
        raise UsageError(f"{path} has no *.safetensors weights (lamina reads safetensors or GGUF)")


def _check_gguf(path: Path) -> None:
    from lamina.models.gguf_header import GGUFError, read_gguf_header
    from lamina.models.registry import GGUF_ARCHS

    try:
        header = read_gguf_header(path)
    except GGUFError as e:
        raise UsageError(str(e)) from None
    arch = header.metadata.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise UsageError(f"{path}: unsupported GGUF architecture {arch!r}; lamina reads GGUF files of "
                         f"{', '.join(sorted(GGUF_ARCHS))}")


def bind_socket(host: str, port: int) -> socket.socket:
    """Binds the listening address now (before the model loads) so a port in use fails at once; the server
    then serves on this socket."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"cannot resolve the host {host!r} ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a port in TIME_WAIT is free
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is already in use (pick another with --port)") from None
        raise UsageError(f"cannot bind {host}:{port} ({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock
