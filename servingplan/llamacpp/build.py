"""Where `make llamacpp` (scripts/build_llamacpp.sh) puts the pinned llama.cpp build."""
from __future__ import annotations

import os
from pathlib import Path

VERSION = "0.3.36"          # llama-cpp-python sdist; vendors llama.cpp 0c1e570
BINARIES = ("llama-server", "llama-bench", "llama-batched-bench")


def cache_dir() -> Path:
    return Path(os.environ.get("SERVINGPLAN_CACHE") or Path.home() / ".cache" / "servingplan")


def build_dir(version: str = VERSION) -> Path:
    return cache_dir() / f"llamacpp-{version}"


def source_dir(version: str = VERSION) -> Path:
    """The vendored llama.cpp tree of the unpacked sdist (present once the build has unpacked it)."""
    return build_dir(version) / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def built(version: str = VERSION) -> bool:
    """The build finished: its stamp is written only after every binary ran."""
    return (build_dir(version) / ".built").is_file()


def binary(name: str, version: str = VERSION) -> Path:
    if name not in BINARIES:
        raise ValueError(f"{name!r}: built are {', '.join(BINARIES)}")
    return build_dir(version) / "bin" / name


def env(version: str = VERSION) -> dict:
    """The environment to run a binary in: the shared libraries it links sit beside it."""
    lib = str(build_dir(version) / "bin")
    old = os.environ.get("LD_LIBRARY_PATH")
    return {**os.environ, "LD_LIBRARY_PATH": f"{lib}:{old}" if old else lib}
