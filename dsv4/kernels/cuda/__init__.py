"""Build and load dsv4's CUDA C++ kernels (the .cu files here + binding.cpp, one extension module).

`load()` compiles them on first use with torch.utils.cpp_extension for the architecture of the current CUDA device
(sm_90a on Hopper, sm_XY otherwise), into `<cache>/kernels/<key>` where <cache> is $DSV4_CACHE (default
~/.cache/dsv4) and <key> hashes the sources, the torch and CUDA versions and the architecture: a second run loads the
built module without rebuilding, and an edited source builds anew. While it builds, one progress line goes to stderr.
Where it cannot build (PyTorch without CUDA, no CUDA device, no nvcc, a compiler error) `load()` returns None and
`status()` says why in one line; the ops that would use the kernels then run their Triton or reference paths, and
`ops.banner()` / `tools/ab_compare.py --list` show that. Set DSV4_NO_CUDA_BUILD=1 to never build (Triton only).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import threading
import time
from pathlib import Path

SRC_DIR = Path(__file__).resolve().parent
SOURCES = ("attn.cu", "binding.cpp", "gemm.cu", "gemv.cu", "mhc.cu", "moe.cu", "probe.cu", "router.cu", "topk.cu")  # compiled; headers (*.h) are hashed too
NAME = "dsv4_cuda"
NO_BUILD_ENV = "DSV4_NO_CUDA_BUILD"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "module" | "why" once decided for this process


def _arch() -> tuple[str, str] | None:
    """(sm tag, nvcc -gencode flag) for the current CUDA device, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    suffix = "a" if major >= 9 else ""  # sm_90a / sm_100a: the arch-specific instructions (griddepcontrol, ...)
    tag = f"sm_{major}{minor}{suffix}"
    return tag, f"-gencode=arch=compute_{major}{minor}{suffix},code={tag}"


def source_files() -> list[Path]:
    return sorted(p for p in SRC_DIR.iterdir() if p.suffix in (".cu", ".cpp", ".h"))


def build_key(arch_tag: str) -> str:
    """Hash of every source and header, the torch and CUDA versions and the target architecture."""
    import torch

    h = hashlib.sha256()
    for p in source_files():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{arch_tag}|{sys.version_info[:2]}".encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    from dsv4.demo import default_cache_dir

    return default_cache_dir() / "kernels"


def why_unbuildable() -> str | None:
    """One line saying why the kernels cannot be built here, or None when they can."""
    if os.environ.get(NO_BUILD_ENV) == "1":
        return f"CUDA kernels off ({NO_BUILD_ENV}=1)"
    import torch

    if torch.version.cuda is None:
        return "CUDA kernels need a CUDA build of PyTorch"
    if not torch.cuda.is_available():
        return "CUDA kernels need a CUDA device"
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home is None or not (Path(home) / "bin" / "nvcc").exists():
        return "CUDA kernels need the CUDA toolkit (nvcc not found; set CUDA_HOME)"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the pip package puts the binary on PATH only in some setups)
        except ImportError:
            return "CUDA kernels need ninja (pip install ninja)"
    return None


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(NAME, path, loader=importlib.machinery.ExtensionFileLoader(NAME, str(path)))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(build_dir: Path, arch_flag: str, progress) -> object:
    import torch  # noqa: F401  (the extension links against the loaded torch)
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if progress:
        print(f"dsv4: building CUDA kernels for {arch_flag.split('code=')[1]} (first use, about a minute) in "
              f"{build_dir} ...", file=sys.stderr, flush=True)
    mod = cpp_extension.load(
        name=NAME, sources=[str(SRC_DIR / s) for s in SOURCES], build_directory=str(build_dir),
        extra_cflags=["-O3", "-std=c++17"], extra_cuda_cflags=["-O3", "-std=c++17", arch_flag],
        verbose=False)
    if progress:
        print(f"dsv4: CUDA kernels built in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return mod


def load(progress: bool = True):
    """The built extension module, or None (then `status()` says why). Builds once per source/torch/arch key."""
    with _lock:
        if "module" in _state or "why" in _state:
            return _state.get("module")
        why = why_unbuildable()
        if why is None:
            tag, flag = _arch()
            build_dir = cache_root() / f"{tag}-{build_key(tag)}"
            built = build_dir / f"{NAME}.so"
            try:
                mod = _import(built) if built.exists() else _build(build_dir, flag, progress)
            except Exception as e:  # a compiler or loader error: one line, the log stays in build_dir
                first = next((ln.strip() for ln in str(e).splitlines() if "error" in ln.lower()), str(e).splitlines()[0] if str(e) else type(e).__name__)
                why = f"CUDA kernels failed to build ({first[:200]}); build directory {build_dir}"
            else:
                _state["module"] = mod
                return mod
        _state["why"] = why
        return None


def status() -> tuple[bool, str]:
    """(built, why not) for this process; does not build."""
    if "module" in _state:
        return True, ""
    return False, str(_state.get("why") or why_unbuildable() or "CUDA kernels not built yet (first use builds them)")


def attempted() -> bool:
    """Whether load() has run in this process (built, found cached, or failed)."""
    return "module" in _state or "why" in _state


def reset_for_tests() -> None:
    with _lock:
        _state.clear()
