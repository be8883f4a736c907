"""dsv4.loader: header inspection, strict validation (every problem listed at once, with the exact
message lines), MTP optionality, placement over devices by bytes, progress, generation config."""

import io
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4 import loader
from dsv4.checkpoint import expected_tensors
from dsv4.config import ConfigError, ModelConfig
from dsv4.loader import (
    ByteProgress,
    CheckpointError,
    inspect_checkpoint,
    load_generation_config,
    load_model,
    plan_placement,
    validate_checkpoint,
)
from dsv4.writer import TINY_CONFIG, write_checkpoint

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    return write_checkpoint(
        TINY_CONFIG, tmp_path_factory.mktemp("m") / "ckpt", "fp8", max_shard_bytes=2**20
    )


@pytest.fixture
def ckpt(master, tmp_path):
    """A fresh copy of the tiny fp8 checkpoint for a test to damage."""
    return shutil.copytree(master, tmp_path / "ckpt")


def _index(ckpt):
    return json.loads((ckpt / INDEX).read_text())


def _write_index(ckpt, index):
    (ckpt / INDEX).write_text(json.dumps(index))


def _edit_shard(ckpt, name, fn):
    """Apply fn to the tensor dict of the shard holding `name` and save it back."""
    shard = ckpt / _index(ckpt)["weight_map"][name]
    tensors = load_file(shard)
    fn(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard.name


def _problems(excinfo) -> list[str]:
    lines = str(excinfo.value).splitlines()
    return [line.strip() for line in lines[1:]]


def _cfg(ckpt):
    return ModelConfig.from_file(ckpt / "config.json")


# ---- inspection ----------------------------------------------------------------------------------


def test_inspect_matches_index_and_table(master):
    entries = inspect_checkpoint(master)
    index = _index(master)
    spec = expected_tensors(_cfg(master))
    assert set(entries) == set(index["weight_map"]) == set(spec)
    for name, (shape, dtype, shard) in entries.items():
        assert shard == index["weight_map"][name]
        assert shape == spec[name].shape and dtype == spec[name].dtypes[0]
    assert sum(e.nbytes for e in entries.values()) == index["metadata"]["total_size"]
    assert inspect_checkpoint(master / INDEX) == entries


def test_single_file_checkpoints(master, tmp_path):
    tensors = {}
    for shard in sorted(set(_index(master)["weight_map"].values())):
        tensors.update(load_file(master / shard))
    one = tmp_path / "one"
    one.mkdir()
    for f in ("config.json", "generation_config.json"):
        shutil.copy(master / f, one / f)
    save_file(tensors, one / "weights.safetensors", metadata={"format": "pt"})
    entries = inspect_checkpoint(one)
    assert set(entries) == set(tensors) and {e.shard for e in entries.values()} == {
        "weights.safetensors"
    }
    assert inspect_checkpoint(one / "weights.safetensors") == entries
    model = load_model(one, progress=False)
    assert torch.equal(
        model.layers[1].attn.wq_a.weight.view(torch.uint8),
        tensors["layers.1.attn.wq_a.weight"].view(torch.uint8),
    )
    os.rename(one / "weights.safetensors", one / "model.safetensors")
    save_file({"x": torch.zeros(1)}, one / "other.safetensors")
    assert set(inspect_checkpoint(one)) == set(tensors)  # model.safetensors wins over other files
    os.rename(one / "model.safetensors", one / "b.safetensors")
    with pytest.raises(
        CheckpointError, match=r"2 \*\.safetensors files but no model\.safetensors\.index\.json"
    ):
        inspect_checkpoint(one)
    assert len(load_model(one / "b.safetensors", progress=False).layers) == 4  # the file named wins


def test_no_checkpoint_here(tmp_path):
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(tmp_path)
    assert (
        str(e.value) == f"checkpoint {tmp_path}: 1 problem\n  no *.safetensors files and no {INDEX}"
    )
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_model(tmp_path / "absent", progress=False)


# ---- validation errors ---------------------------------------------------------------------------


def test_missing_tensor(ckpt):
    name = "layers.2.attn.wq_b.scale"
    shard = _edit_shard(ckpt, name, lambda t: t.pop(name))
    index = _index(ckpt)
    del index["weight_map"][name]
    _write_index(ckpt, index)
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, progress=False)
    assert str(e.value).splitlines()[0] == f"checkpoint {ckpt}: 1 problem"
    assert _problems(e) == [f"missing tensor {name}"]
    assert shard


def test_tensor_missing_from_index_only(ckpt):
    name = "layers.0.attn.attn_sink"
    index = _index(ckpt)
    shard = index["weight_map"].pop(name)
    _write_index(ckpt, index)
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(ckpt, _cfg(ckpt))
    assert _problems(e) == [
        f"missing tensor {name} (it is in {shard}, but {INDEX} does not list it)"
    ]


def test_wrong_shape(ckpt):
    name = "layers.1.attn.q_norm.weight"
    _edit_shard(ckpt, name, lambda t: t.update({name: torch.ones(64, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, progress=False)
    assert _problems(e) == [f"wrong shape for {name}: checkpoint [64], expected [128]"]


def test_wrong_dtype(ckpt):
    name = "layers.1.attn.wq_a.scale"
    _edit_shard(ckpt, name, lambda t: t.update({name: torch.ones(1, 1)}))
    sink = "layers.0.attn.attn_sink"
    _edit_shard(ckpt, sink, lambda t: t.update({sink: torch.zeros(4, dtype=torch.int32)}))
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, progress=False)
    assert _problems(e) == [
        f"wrong dtype for {sink}: checkpoint I32, expected F32 (or BF16, F16)",
        f"wrong dtype for {name}: checkpoint F32, expected F8_E8M0",
    ]


def test_float_tensors_accept_any_float_dtype(ckpt):
    name = "layers.0.attn_norm.weight"
    _edit_shard(ckpt, name, lambda t: t.update({name: t[name].float()}))
    model = load_model(ckpt, progress=False)
    assert model.layers[0].attn_norm.weight.dtype == torch.float32


def test_truncated_shard(ckpt):
    shard = ckpt / _index(ckpt)["weight_map"]["embed.weight"]
    size = shard.stat().st_size
    os.truncate(shard, size - 100)
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, progress=False)
    (p,) = _problems(e)
    assert p.startswith(
        f"shard {shard.name} is truncated: its header needs {size} bytes, the file has {size - 100}"
    )


def test_unreadable_and_absent_shards(ckpt):
    index = _index(ckpt)
    shards = sorted(set(index["weight_map"].values()))
    (ckpt / shards[0]).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    os.remove(ckpt / shards[1])
    n1 = sum(1 for v in index["weight_map"].values() if v == shards[1])
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(ckpt)
    problems = _problems(e)
    assert problems[0].startswith(f"shard {shards[0]} is unreadable: invalid safetensors header")
    assert problems[1] == f"shard {shards[1]} does not exist (the index lists {n1} tensors in it)"
    assert len(problems) == 2


def test_broken_shard_header_is_one_problem_and_one_consequence(ckpt):
    # the cause once, then one line for the tensors lost with it (not one "missing tensor" each)
    index = _index(ckpt)
    shards = sorted(set(index["weight_map"].values()))
    lost = sum(1 for v in index["weight_map"].values() if v == shards[0])
    with open(ckpt / shards[0], "r+b") as f:
        f.seek(12)
        f.write(b"\x00garbage")
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, progress=False)
    problems = _problems(e)
    assert len(problems) == 2
    assert problems[0].startswith(f"shard {shards[0]} is unreadable: invalid safetensors header")
    total = len(expected_tensors(_cfg(ckpt)))
    assert problems[1] == f"so {lost} of the model's {total} tensors (in {shards[0]}) cannot be checked or loaded"
    # absent shards too
    os.remove(ckpt / shards[1])
    lost += sum(1 for v in index["weight_map"].values() if v == shards[1])
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(ckpt, _cfg(ckpt))
    assert _problems(e)[-1] == (f"so {lost} of the model's {total} tensors (in shards {shards[0]}, {shards[1]}) "
                                "cannot be checked or loaded")
    assert len(_problems(e)) == 3


def test_broken_single_file_checkpoint(master, tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(master / "config.json", single)
    tensors = {}
    for shard in sorted(master.glob("model-*.safetensors")):
        tensors.update(load_file(shard))
    save_file(tensors, single / "model.safetensors", metadata={"format": "pt"})
    (single / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError) as e:
        load_model(single, progress=False)
    problems = _problems(e)
    assert len(problems) == 2 and problems[0].startswith("shard model.safetensors is unreadable")
    n = len(expected_tensors(_cfg(single), with_mtp=False))  # no MTP tensor is readable: MTP is not expected
    assert problems[1] == f"so {n} of the model's {n} tensors (in model.safetensors) cannot be checked or loaded"


def test_index_entry_not_in_its_shard(ckpt):
    index = _index(ckpt)
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    _write_index(ckpt, index)
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(ckpt, _cfg(ckpt))
    assert _problems(e)[0] == f"index lists {name} in {shards[1]}, but that shard does not hold it"


def test_unexpected_tensor(ckpt):
    name = "layers.0.attn.wq_a.weight"
    shard = _edit_shard(ckpt, name, lambda t: t.update({"layers.0.attn.bogus": torch.zeros(2)}))
    index = _index(ckpt)
    index["weight_map"]["layers.0.attn.bogus"] = shard
    _write_index(ckpt, index)
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(ckpt, _cfg(ckpt))
    assert _problems(e) == [f"unexpected tensor layers.0.attn.bogus (in {shard})"]


def test_reports_all_problems_at_once(ckpt):
    a, b = "layers.3.ffn.gate.bias", "layers.1.attn.kv_norm.weight"
    _edit_shard(ckpt, a, lambda t: t.update({a: torch.zeros(9)}))
    index = _index(ckpt)
    del index["weight_map"][b]
    _write_index(ckpt, index)
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, progress=False)
    lines = str(e.value).splitlines()
    assert lines[0] == f"checkpoint {ckpt}: 2 problems"
    missing = f"missing tensor {b} (it is in {_shard_of(ckpt, b)}, but {INDEX} does not list it)"
    assert sorted(_problems(e)) == sorted(
        [f"wrong shape for {a}: checkpoint [9], expected [8]", missing]
    )
    assert e.value.problems == _problems(e)


def _shard_of(ckpt, name):
    for shard in ckpt.glob("model-*.safetensors"):
        if name in load_file(shard):
            return shard.name
    raise AssertionError(name)


def test_long_problem_lists_are_capped_in_the_message(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["hidden_size"] = 256  # every hidden-sized tensor now has the wrong shape
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, progress=False)
    n = len(e.value.problems)
    lines = str(e.value).splitlines()
    assert n > 100 and lines[0] == f"checkpoint {ckpt}: {n} problems"
    assert (
        len(lines) == 102
        and lines[-1] == f"  ... and {n - 100} more (CheckpointError.problems lists all)"
    )


def test_config_error_propagates(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["scoring_func"] = "relu"
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="'scoring_func' 'relu' is not supported"):
        load_model(ckpt, progress=False)


def test_unfilled_model_tensor_is_an_error(ckpt, monkeypatch):
    real = loader.expected_tensors

    def without_sink(cfg, with_mtp=True):
        out = real(cfg, with_mtp)
        out.pop("layers.1.attn.attn_sink")
        return out

    monkeypatch.setattr(loader, "expected_tensors", without_sink)
    name = "layers.1.attn.attn_sink"
    _edit_shard(ckpt, name, lambda t: t.pop(name))
    _drop(ckpt, [name])
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt, progress=False)
    assert _problems(e) == ["model tensor layers.1.attn.attn_sink was not filled by the checkpoint"]


# ---- MTP -----------------------------------------------------------------------------------------


def _drop(ckpt, names):
    index = _index(ckpt)
    for n in names:
        del index["weight_map"][n]
    _write_index(ckpt, index)


def test_mtp_optional(ckpt):
    cfg = _cfg(ckpt)
    mtp = [n for n in _index(ckpt)["weight_map"] if n.startswith("mtp.")]
    assert mtp and any(n.startswith("mtp.") for n in validate_checkpoint(ckpt, cfg))
    assert not any(n.startswith("mtp.") for n in validate_checkpoint(ckpt, cfg, with_mtp=False))
    assert len(load_model(ckpt, with_mtp=False, progress=False).mtp) == 0
    _drop(ckpt, mtp[:3])
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(ckpt, cfg)
    assert sorted(_problems(e)) == sorted(
        f"missing tensor {n} (it is in {_shard_of(ckpt, n)}, but {INDEX} does not list it)"
        for n in mtp[:3]
    )
    # without any indexed MTP tensor the unindexed ones still count as "some present"
    _drop(ckpt, mtp[3:])
    for shard in ckpt.glob("model-*.safetensors"):
        t = load_file(shard)
        save_file(
            {k: v for k, v in t.items() if not k.startswith("mtp.")},
            shard,
            metadata={"format": "pt"},
        )
    model = load_model(ckpt, progress=False)
    assert len(model.mtp) == 0 and model.cfg.num_nextn_predict_layers == 0
    assert model.cfg.compress_ratios == tuple(TINY_CONFIG["compress_ratios"][:4])
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(ckpt, cfg, with_mtp=True)
    assert len(e.value.problems) == len(mtp) and all(
        p.startswith("missing tensor mtp.0.") for p in e.value.problems
    )


def test_mtp_tensors_without_mtp_config_are_unexpected(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 0
    raw["compress_ratios"] = raw["compress_ratios"][:4]
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(ckpt, ModelConfig.from_dict(raw))
    assert all(p.startswith("unexpected tensor mtp.0.") for p in e.value.problems)
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(ckpt, ModelConfig.from_dict(raw), with_mtp=True)
    assert "with_mtp=True, but config.json declares no MTP block" in str(e.value)


# ---- placement -----------------------------------------------------------------------------------


def test_plan_placement():
    assert plan_placement([1] * 8, 1) == [0] * 8
    assert plan_placement([1] * 8, 2) == [0] * 4 + [1] * 4
    assert plan_placement([1] * 9, 3) == [0] * 3 + [1] * 3 + [2] * 3
    assert plan_placement([4, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1]
    assert plan_placement([1, 1, 1, 1, 4], 2) == [0, 0, 0, 0, 1]
    # embedding on the first device and head + MTP on the last count too
    assert plan_placement([1] * 6, 2, first_bytes=2) == [0] * 2 + [1] * 4
    assert plan_placement([1] * 6, 2, last_bytes=2) == [0] * 4 + [1] * 2
    assert plan_placement([1] * 8, 4, first_bytes=2, last_bytes=2) == [0, 1, 1, 1, 2, 2, 2, 3]
    assert plan_placement([1, 1], 4) == sorted(
        plan_placement([1, 1], 4)
    )  # more devices than layers
    assert plan_placement([], 2) == []
    with pytest.raises(ValueError, match="at least one device"):
        plan_placement([1], 0)


def test_multi_device_placement_by_bytes(master):
    entries = inspect_checkpoint(master)
    model = load_model(master, devices=["cpu", "cpu"], progress=False)
    L = TINY_CONFIG["num_hidden_layers"]
    layer_bytes = [
        sum(e.nbytes for n, e in entries.items() if n.startswith(f"layers.{i}.")) for i in range(L)
    ]
    first = entries["embed.weight"].nbytes
    last = sum(e.nbytes for n, e in entries.items() if not n.startswith(("layers.", "embed.")))
    plan = plan_placement(layer_bytes, 2, first_bytes=first, last_bytes=last)
    assert len(set(plan)) == 2
    assert model.layer_devices == [torch.device("cpu")] * L
    for i, layer in enumerate(model.layers):
        assert layer.attn_norm.weight.device == model.layer_devices[i]
    st = model.new_state(32)
    with torch.no_grad():
        assert model(torch.arange(20)[None], st).isfinite().all()
    with pytest.raises(ValueError, match="devices: 'gpu0' is not a device"):
        load_model(master, devices=["cpu", "gpu0"], progress=False)
    with pytest.raises(ValueError, match="need at least one device"):
        load_model(master, devices=[], progress=False)


# ---- progress and generation config -----------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar():
    out = _Tty()
    bar = ByteProgress(2 * 10**9, "loading x", True, stream=out)
    bar.update(10**9)
    bar.update(10**9)
    bar.close()
    text = out.getvalue()
    assert (
        text.startswith("\rloading x: 1.00/2.00 GB (50%)")
        and "GB/s" in text
        and text.endswith("\n")
    )
    assert "2.00/2.00 GB (100%)" in text
    quiet = io.StringIO()  # not a TTY and small: nothing
    bar = ByteProgress(10**6, "loading x", True, stream=quiet)
    bar.update(10**6)
    bar.close()
    assert quiet.getvalue() == ""
    log = io.StringIO()  # not a TTY but large: a line per 10%
    bar = ByteProgress(10 * 10**9, "loading x", True, stream=log)
    for _ in range(10):
        bar.update(10**9)
    bar.close()
    assert log.getvalue().count("\n") == 10 and "10.00/10.00 GB (100%)" in log.getvalue()


def test_load_quiet_when_small(master, capfd):
    load_model(master, progress=True)
    assert capfd.readouterr().err == ""


def test_generation_config(master, tmp_path):
    gen = load_generation_config(master)
    assert (
        gen["temperature"] == 1.0
        and gen["top_p"] == 1.0
        and gen["do_sample"] is True
        and gen["eos_token_id"] == 1
    )
    assert load_generation_config(tmp_path) == {"temperature": 1.0, "top_p": 1.0}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95})
    )
    assert load_generation_config(tmp_path) == {"temperature": 0.6, "top_p": 0.95}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_p": 2}))
    with pytest.raises(CheckpointError) as e:
        load_generation_config(tmp_path)
    assert len(e.value.problems) == 2 and "top_p must be in (0, 1], got 2" in str(e.value)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="generation_config.json is unreadable"):
        load_generation_config(tmp_path)
