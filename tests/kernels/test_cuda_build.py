"""dsv4.kernels.cuda: the build key, the one-line reasons it cannot build, the cache, and the fallback (CPU tier)."""

from __future__ import annotations

import pytest
import torch

from dsv4 import ops
from dsv4.kernels import cuda as ck


@pytest.fixture(autouse=True)
def fresh_state():
    ck.reset_for_tests()
    yield
    ck.reset_for_tests()


def test_sources_are_all_there():
    names = {p.name for p in ck.source_files()}
    assert set(ck.SOURCES) <= names and "gemv.h" in names


def test_build_key_follows_sources_and_arch(tmp_path, monkeypatch):
    key = ck.build_key("sm_90a")
    assert key == ck.build_key("sm_90a") and len(key) == 16
    assert ck.build_key("sm_100a") != key
    src = tmp_path / "src"
    src.mkdir()
    for p in ck.source_files():
        (src / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(ck, "SRC_DIR", src)
    assert ck.build_key("sm_90a") == key
    (src / "gemv.cu").write_text((src / "gemv.cu").read_text() + "\n// edited\n")
    assert ck.build_key("sm_90a") != key


def test_cache_under_dsv4_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path))
    assert ck.cache_root() == tmp_path / "kernels"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA answers")
def test_no_cuda_one_line_and_fallback():
    assert ck.load() is None
    ok, why = ck.status()
    assert not ok and "\n" not in why and why.startswith("CUDA kernels need")
    # the fast linear still exists (Triton) and never asks for the CUDA module off CUDA
    assert ops.OPS["linear"].fast is not None


def test_opt_out_and_missing_toolkit(monkeypatch):
    monkeypatch.setenv(ck.NO_BUILD_ENV, "1")
    assert ck.why_unbuildable() == f"CUDA kernels off ({ck.NO_BUILD_ENV}=1)"
    assert ck.load() is None and ck.status() == (False, f"CUDA kernels off ({ck.NO_BUILD_ENV}=1)")
    monkeypatch.delenv(ck.NO_BUILD_ENV)
    ck.reset_for_tests()
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert ck.why_unbuildable() == "CUDA kernels need the CUDA toolkit (nvcc not found; set CUDA_HOME)"


def test_build_failure_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "why_unbuildable", lambda: None)
    monkeypatch.setattr(ck, "_arch", lambda: ("sm_90a", "-gencode=arch=compute_90a,code=sm_90a"))
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path))

    def boom(build_dir, flag, progress):
        raise RuntimeError("Error building extension 'dsv4_cuda':\nstuff\ngemv.cu(12): error: identifier x\nmore")
    monkeypatch.setattr(ck, "_build", boom)
    assert ck.load() is None
    ok, why = ck.status()
    assert not ok and "\n" not in why
    assert why.startswith("CUDA kernels failed to build (Error building extension") and str(tmp_path) in why
    assert ck.load() is None  # decided once per process: no second attempt


def test_cached_module_is_imported_not_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "why_unbuildable", lambda: None)
    monkeypatch.setattr(ck, "_arch", lambda: ("sm_90a", "-gencode=arch=compute_90a,code=sm_90a"))
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path))
    d = ck.cache_root() / f"sm_90a-{ck.build_key('sm_90a')}"
    d.mkdir(parents=True)
    (d / f"{ck.NAME}.so").write_bytes(b"")
    sentinel = object()
    monkeypatch.setattr(ck, "_build", lambda *a: pytest.fail("rebuilt although a build is cached"))
    monkeypatch.setattr(ck, "_import", lambda path: sentinel if path == d / f"{ck.NAME}.so" else None)
    assert ck.load() is sentinel and ck.status() == (True, "")
