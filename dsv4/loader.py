"""Strict streaming checkpoint loader: official safetensors shards -> a placed `Transformer`.

Owns reading safetensors headers (no tensor data), validating a checkpoint against the one name
table `dsv4.checkpoint.expected_tensors(cfg)` with every problem reported at once
(`CheckpointError`), device placement (`plan_placement`), and streaming shard by shard from
memory-mapped files straight into a meta-built model. It never renames tensors and never keeps a
second host copy; the name table, tensor assignment and the model itself belong to other modules.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from dsv4.checkpoint import TensorSpec, assign_tensor, expected_tensors
from dsv4.config import ModelConfig
from dsv4.model.layers import Numerics
from dsv4.model.transformer import Transformer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}

# safetensors dtype strings <-> torch dtypes (the subset a DeepSeek-V4 checkpoint can hold, plus the
# common ones so that a foreign tensor is reported by its real dtype rather than as unreadable)
# fmt: off
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
# fmt: on
ST_NAMES: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
_SHOWN_PROBLEMS = 100  # problems printed in a CheckpointError message; `.problems` has them all


class CheckpointError(Exception):
    """Everything wrong with a checkpoint, one problem per line after a summary line."""

    def __init__(self, path: str | Path, problems: Sequence[str]):
        self.path = str(path)
        self.problems = list(problems)
        n = len(self.problems)
        lines = [f"checkpoint {self.path}: {n} problem{'s' if n != 1 else ''}"]
        lines += [f"  {p}" for p in self.problems[:_SHOWN_PROBLEMS]]
        if n > _SHOWN_PROBLEMS:
            lines.append(
                f"  ... and {n - _SHOWN_PROBLEMS} more (CheckpointError.problems lists all)"
            )
        super().__init__("\n".join(lines))


class TensorEntry(NamedTuple):
    """One stored tensor as its shard header describes it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    shard: str  # file name relative to the checkpoint directory

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def st_dtype_name(dtype: torch.dtype) -> str:
    """torch dtype -> safetensors dtype string (what checkpoint headers and error messages use)."""
    return ST_NAMES.get(dtype, str(dtype).removeprefix("torch."))


# --------------------------------------------------------------------------------------------------
# headers


@dataclasses.dataclass
class _Shard:
    tensors: dict[
        str, tuple[tuple[int, ...], torch.dtype, int]
    ]  # name -> (shape, dtype, data start)


def _read_header(file: Path) -> tuple[_Shard | None, list[str]]:
    """Parse one safetensors header; (None, [problem]) if the file cannot be used at all."""
    name = file.name
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None, [f"shard {name} is truncated: {size} bytes, not even a header length"]
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                what = "truncated" if n <= _MAX_HEADER else "unreadable"
                return None, [
                    f"shard {name} is {what}: header length {n} but the file has {size} bytes"
                ]
            raw = f.read(n)
    except OSError as e:
        return None, [f"shard {name} is unreadable: {e.strerror or e}"]
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise TypeError("not a JSON object")
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        return None, [f"shard {name} is unreadable: invalid safetensors header ({e})"]

    problems: list[str] = []
    tensors = {}
    end_max = 0
    for tname, info in header.items():
        if tname == "__metadata__":
            continue
        try:
            dtype_s, shape, (start, end) = (
                info["dtype"],
                tuple(int(d) for d in info["shape"]),
                info["data_offsets"],
            )
        except (KeyError, TypeError, ValueError):
            problems.append(f"shard {name}: malformed header entry for {tname}")
            continue
        dtype = ST_DTYPES.get(dtype_s)
        if dtype is None:
            problems.append(f"shard {name}: {tname} has unsupported dtype {dtype_s}")
            continue
        entry = TensorEntry(shape, dtype, name)
        if not (0 <= start <= end) or end - start != entry.nbytes:
            problems.append(
                f"shard {name}: {tname} has data_offsets [{start}, {end}] inconsistent with "
                f"{dtype_s}{list(shape)} ({entry.nbytes} bytes)"
            )
            continue
        tensors[tname] = (shape, dtype, start)
        end_max = max(end_max, end)
    if 8 + n + end_max > size:
        problems.append(
            f"shard {name} is truncated: its header needs {8 + n + end_max} bytes, "
            f"the file has {size}"
        )
    return _Shard(tensors), problems


def _resolve(path: str | Path) -> tuple[Path, Path | None, list[Path]]:
    """-> (checkpoint dir, index file or None, shard files when there is no index)."""
    p = Path(path)
    if p.is_file():
        if p.name.endswith(".index.json"):
            return p.parent, p, []
        if p.suffix == ".safetensors":
            return p.parent, None, [p]
        raise CheckpointError(
            p, [f"{p.name} is neither a safetensors file nor a safetensors index"]
        )
    if not p.is_dir():
        raise CheckpointError(p, ["no such file or directory"])
    if (p / INDEX_FILE).is_file():
        return p, p / INDEX_FILE, []
    if (p / SINGLE_FILE).is_file():
        return p, None, [p / SINGLE_FILE]
    shards = sorted(p.glob("*.safetensors"))
    if len(shards) == 1:
        return p, None, shards
    if not shards:
        raise CheckpointError(p, ["no *.safetensors files and no " + INDEX_FILE])
    raise CheckpointError(
        p, [f"{len(shards)} *.safetensors files but no {INDEX_FILE} to say which to use"]
    )


class _Scan(NamedTuple):
    root: Path
    entries: dict[str, TensorEntry]
    offsets: dict[str, int]  # data start of each entry within its shard's data section
    unindexed: dict[str, str]  # tensors a shard holds but the index does not list: name -> shard
    problems: list[str]
    lost: dict[str, str]  # tensors whose shard is missing or unreadable: name -> shard ("*": all)


def _scan(path: str | Path) -> _Scan:
    """Read the index and every shard header; a shard that cannot be used is one problem, and the
    tensors it should hold are listed in `lost` rather than reported one by one."""
    root, index, singles = _resolve(path)
    problems: list[str] = []
    weight_map: dict[str, str] = {}
    if index is not None:
        try:
            raw = json.loads(index.read_text())
            weight_map = raw["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise TypeError("weight_map must map tensor names to file names")
        except OSError as e:
            raise CheckpointError(
                root, [f"{index.name} is unreadable: {e.strerror or e}"]
            ) from None
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                root, [f"{index.name} is not a valid safetensors index: {e}"]
            ) from None
        files = sorted(set(weight_map.values()))
    else:
        files = [s.name for s in singles]

    entries: dict[str, TensorEntry] = {}
    offsets: dict[str, int] = {}
    unindexed: dict[str, str] = {}
    headers: dict[str, _Shard] = {}
    for fname in files:
        file = root / fname
        if Path(fname).name != fname:
            problems.append(
                f"index names shard {fname!r}, which is outside the checkpoint directory"
            )
            continue
        if not file.is_file():
            count = sum(1 for v in weight_map.values() if v == fname)
            problems.append(f"shard {fname} does not exist (the index lists {count} tensors in it)")
            continue
        shard, shard_problems = _read_header(file)
        problems += shard_problems
        if shard is not None:
            headers[fname] = shard
    unusable = set(files) - set(headers)
    lost = {t: f for t, f in weight_map.items() if f in unusable}

    if index is None:
        for fname, shard in headers.items():
            for tname, (shape, dtype, start) in shard.tensors.items():
                entries[tname] = TensorEntry(shape, dtype, fname)
                offsets[tname] = start
        if not headers and files:  # the one shard is unusable: every tensor is lost with it
            lost = {"*": files[0]}
        return _Scan(root, entries, offsets, unindexed, problems, lost)

    for tname, fname in weight_map.items():
        shard = headers.get(fname)
        if shard is None:
            continue  # the shard's own problem is already listed
        if tname not in shard.tensors:
            problems.append(f"index lists {tname} in {fname}, but that shard does not hold it")
            continue
        shape, dtype, start = shard.tensors[tname]
        entries[tname] = TensorEntry(shape, dtype, fname)
        offsets[tname] = start
    for fname, shard in headers.items():
        for tname in shard.tensors:
            if weight_map.get(tname) != fname and tname not in unindexed:
                unindexed[tname] = fname
    return _Scan(root, entries, offsets, unindexed, problems, lost)


def inspect_checkpoint(path: str | Path) -> dict[str, TensorEntry]:
    """name -> (shape, dtype, shard file) of every tensor, from the headers only (no tensor data).

    `path`: a checkpoint directory (with `model.safetensors.index.json`, or one `model.safetensors`,
    or exactly one `*.safetensors`), an index file, or a single safetensors file. Raises
    CheckpointError listing every missing, unreadable or truncated shard and every index entry
    that its shard does not hold."""
    scan = _scan(path)
    root, entries, problems = scan.root, scan.entries, scan.problems
    if problems:
        raise CheckpointError(root, problems)
    return entries


# --------------------------------------------------------------------------------------------------
# validation


def _mtp_names(names) -> set[str]:
    return {n for n in names if n.startswith("mtp.")}


def _resolve_mtp(
    cfg: ModelConfig,
    expected: dict[str, TensorSpec],
    present,
    with_mtp: bool | None,
    problems: list[str],
) -> bool:
    exp_mtp, got_mtp = _mtp_names(expected), _mtp_names(present)
    if with_mtp is None:
        return bool(exp_mtp) and bool(
            got_mtp & exp_mtp
        )  # some present: all must be (checked as missing)
    if with_mtp and not exp_mtp:
        problems.append(
            "with_mtp=True, but config.json declares no MTP block (num_nextn_predict_layers is 0)"
        )
    return bool(with_mtp) and bool(exp_mtp)


def _dtype_list(spec: TensorSpec) -> str:
    names = [st_dtype_name(d) for d in spec.dtypes]
    return names[0] if len(names) == 1 else f"{names[0]} (or {', '.join(names[1:])})"


def _validate(path, cfg: ModelConfig, with_mtp: bool | None):
    root, entries, offsets, unindexed, problems, lost = _scan(path)
    expected = expected_tensors(cfg, with_mtp=True)
    use_mtp = _resolve_mtp(cfg, expected, set(entries) | set(unindexed), with_mtp, problems)
    if not use_mtp:
        skipped = _mtp_names(expected)
        expected = {n: s for n, s in expected.items() if n not in skipped}
    else:
        skipped = set()

    unavailable: dict[str, int] = {}  # shard -> expected tensors lost with it
    for name, spec in expected.items():
        e = entries.get(name)
        if e is None and (name in lost or "*" in lost):
            shard = lost.get(name, lost.get("*"))
            unavailable[shard] = unavailable.get(shard, 0) + 1
            continue
        if e is None:
            where = unindexed.get(name)
            hint = f" (it is in {where}, but {INDEX_FILE} does not list it)" if where else ""
            problems.append(f"missing tensor {name}{hint}")
            continue
        if tuple(e.shape) != spec.shape:
            problems.append(
                f"wrong shape for {name}: checkpoint {list(e.shape)}, expected {list(spec.shape)}"
            )
        if not spec.accepts(e.dtype):
            problems.append(
                f"wrong dtype for {name}: checkpoint {st_dtype_name(e.dtype)}, "
                f"expected {_dtype_list(spec)}"
            )
    for name, e in entries.items():
        if name not in expected and name not in skipped:
            problems.append(f"unexpected tensor {name} (in {e.shard})")
    for name, shard in unindexed.items():
        if name not in expected and name not in skipped and name not in entries:
            problems.append(
                f"unexpected tensor {name} (in {shard}, not listed in {INDEX_FILE} either)"
            )
    if unavailable:  # the consequence of the shard problems above, in one line
        n = sum(unavailable.values())
        shards = ", ".join(sorted(unavailable))
        problems.append(f"so {n} of the model's {len(expected)} tensors ({'in ' if len(unavailable) == 1 else 'in shards '}"
                        f"{shards}) cannot be checked or loaded")
    load = {n: e for n, e in entries.items() if n in expected}
    return root, load, offsets, problems


def validate_checkpoint(
    path: str | Path, cfg: ModelConfig, with_mtp: bool | None = None
) -> dict[str, TensorEntry]:
    """Check a checkpoint against `expected_tensors(cfg)`; returns the tensors to load.

    Lists, all at once in one CheckpointError: missing / unexpected tensors, wrong shapes and
    dtypes, missing, unreadable or truncated shards, and index entries their shard lacks. MTP
    (`mtp.*`) is optional: with_mtp=None loads it when the checkpoint has it and skips it when it
    has none of it (some but not all is an error); True requires it; False ignores it."""
    root, load, _, problems = _validate(path, cfg, with_mtp)
    if problems:
        raise CheckpointError(root, problems)
    return load


# --------------------------------------------------------------------------------------------------
# placement


def plan_placement(
    layer_bytes: Sequence[int], n_devices: int, *, first_bytes: int = 0, last_bytes: int = 0
) -> list[int]:
    """Contiguous split of the layers over `n_devices`: the device index of each layer.

    The first device also holds `first_bytes` (the embedding), the last one `last_bytes` (head,
    norm, hc head and the MTP blocks). The split minimises the sum of squared per-device bytes,
    so every device gets about the same bytes; device indices never decrease along the layers."""
    if n_devices < 1:
        raise ValueError(f"plan_placement: need at least one device, got {n_devices}")
    L = len(layer_bytes)
    if n_devices == 1:
        return [0] * L
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + int(b))

    def load(d: int, i: int, j: int) -> int:  # device d holds layers i..j-1
        extra = (first_bytes if d == 0 else 0) + (last_bytes if d == n_devices - 1 else 0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    cost = [[inf] * (L + 1) for _ in range(n_devices)]
    cut = [[0] * (L + 1) for _ in range(n_devices)]
    for j in range(L + 1):
        cost[0][j] = load(0, 0, j) ** 2
    for d in range(1, n_devices):
        for j in range(L + 1):
            for i in range(j + 1):
                c = cost[d - 1][i] + load(d, i, j) ** 2
                if c < cost[d][j]:
                    cost[d][j], cut[d][j] = c, i
    plan = [0] * L
    j = L
    for d in range(n_devices - 1, 0, -1):
        i = cut[d][j]
        for k in range(i, j):
            plan[k] = d
        j = i
    return plan


def _parse_devices(
    devices: str | torch.device | Sequence[str | torch.device],
) -> list[torch.device]:
    items = [devices] if isinstance(devices, (str, torch.device)) else list(devices)
    if not items:
        raise ValueError("devices: need at least one device")
    out = []
    for d in items:
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"devices: {d!r} is not a device ({e})") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"devices: {dev} requested, but CUDA is not available")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            if dev.index >= torch.cuda.device_count():
                raise ValueError(
                    f"devices: {dev} requested, but only {torch.cuda.device_count()} CUDA devices "
                    "exist"
                )
        elif dev.type == "meta":
            raise ValueError("devices: 'meta' cannot hold a loaded model")
        out.append(dev)
    return out


def _layer_of(name: str) -> int | None:
    if name.startswith("layers."):
        return int(name.split(".", 2)[1])
    return None


# --------------------------------------------------------------------------------------------------
# progress


class ByteProgress:
    """Plain-text progress on stderr: bytes done / total and throughput (\\r updates on a TTY,
    a line per 10% otherwise). Shown only if `enabled` and the stream is a TTY or the job is
    large (> 1 GB)."""

    def __init__(self, total: int, label: str, enabled: bool, stream=None):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.label = max(total, 1), label
        self.enabled = enabled and (self.tty or total > 1e9)
        self.done, self.t0, self.last, self.last_decile = 0, time.perf_counter(), 0.0, -1

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        now = time.perf_counter()
        decile = 10 * self.done // self.total
        if self.tty and now - self.last >= 0.1:
            self.last = now
            self.stream.write("\r" + self._line(now))
            self.stream.flush()
        elif not self.tty and decile > self.last_decile:
            self.last_decile = decile
            self.stream.write(self._line(now) + "\n")
            self.stream.flush()

    def _line(self, now: float) -> str:
        dt = max(now - self.t0, 1e-9)
        return (
            f"{self.label}: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
            f"({100 * self.done // self.total}%) {self.done / 1e9 / dt:.2f} GB/s"
        )

    def close(self) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            self.stream.write("\r" + self._line(now) + "\n")
        elif self.last_decile < 10:
            self.stream.write(self._line(now) + "\n")
        self.stream.flush()


# --------------------------------------------------------------------------------------------------
# loading


def _without_mtp(cfg: ModelConfig) -> ModelConfig:
    n = cfg.num_hidden_layers
    return dataclasses.replace(
        cfg, num_nextn_predict_layers=0, compress_ratios=cfg.compress_ratios[:n], mtp_layers=()
    )


def load_model(
    path: str | Path,
    *,
    numerics: str | Numerics = "reference",
    dtype: torch.dtype = torch.bfloat16,
    devices: str | Sequence[str] = "cpu",
    with_mtp: bool | None = None,
    max_pos: int | None = None,
    progress: bool = True,
) -> Transformer:
    """Load a checkpoint directory into a `Transformer`, streaming shard by shard.

    Parses config.json (ConfigError propagates), validates the tensors (CheckpointError with every
    problem), builds the model on the meta device and assigns each tensor, read from a
    memory-mapped shard, straight to its device. `numerics`: "reference" | "exact" (or a
    Numerics), `dtype`: activation dtype. Several `devices`: embedding on the first, head, norm,
    hc head and MTP on the last, layers split contiguously by bytes (`model.layer_devices`).
    Without MTP tensors (or with_mtp=False) the model is built without MTP blocks."""
    root, _, _ = _resolve(path)
    cfg = ModelConfig.from_file(root / "config.json")
    num = numerics if isinstance(numerics, Numerics) else Numerics(numerics, dtype)
    devs = _parse_devices(devices)
    root, load, offsets, problems = _validate(path, cfg, with_mtp)
    if problems:
        raise CheckpointError(root, problems)
    if not _mtp_names(load) and cfg.mtp_layers:
        cfg = _without_mtp(cfg)

    layer_bytes = [0] * cfg.num_hidden_layers
    first = last = 0
    for name, e in load.items():
        li = _layer_of(name)
        if li is not None:
            layer_bytes[li] += e.nbytes
        elif name.startswith("embed."):
            first += e.nbytes
        else:
            last += e.nbytes
    plan = plan_placement(layer_bytes, len(devs), first_bytes=first, last_bytes=last)

    with torch.device("meta"):
        model = Transformer(cfg, num, max_pos)
    model.layer_devices = [devs[d] for d in plan]

    def device_of(name: str) -> torch.device:
        li = _layer_of(name)
        if li is not None:
            return model.layer_devices[li]
        return devs[0] if name.startswith("embed.") else devs[-1]

    bar = ByteProgress(sum(e.nbytes for e in load.values()), f"loading {root.name}", progress)
    by_shard: dict[str, list[str]] = {}
    for name in sorted(
        load, key=lambda n: (load[n].shard, offsets[n])
    ):  # file order: sequential reads
        by_shard.setdefault(load[name].shard, []).append(name)
    for fname, names in by_shard.items():
        try:
            with safe_open(root / fname, framework="pt", device="cpu") as f:
                for name in names:
                    assign_tensor(model, name, f.get_tensor(name), device_of(name))
                    bar.update(load[name].nbytes)
        except (OSError, RuntimeError, ValueError) as e:
            bar.close()
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(root, [f"shard {fname}: reading failed: {first_line}"]) from None
    bar.close()

    left = [n for n, t in list(model.named_buffers()) + list(model.named_parameters()) if t.is_meta]
    if left:
        raise CheckpointError(
            root, [f"model tensor {n} was not filled by the checkpoint" for n in left]
        )
    return model.eval()


def load_generation_config(path: str | Path) -> dict:
    """generation_config.json of a checkpoint directory over the defaults (temperature 1.0,
    top_p 1.0; the defaults alone when the file is missing)."""
    p = Path(path)
    root = p if p.is_dir() else p.parent
    file = root / "generation_config.json"
    out = dict(GENERATION_DEFAULTS)
    if not file.is_file():
        return out
    try:
        raw = json.loads(file.read_text())
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(root, [f"generation_config.json is unreadable: {e}"]) from None
    out.update(raw)
    problems = []
    t, top_p = out["temperature"], out["top_p"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
        problems.append(f"generation_config.json: temperature must be a number >= 0, got {t!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        problems.append(f"generation_config.json: top_p must be in (0, 1], got {top_p!r}")
    if problems:
        raise CheckpointError(root, problems)
    return out


__all__ = [
    "ST_DTYPES",
    "ByteProgress",
    "CheckpointError",
    "TensorEntry",
    "inspect_checkpoint",
    "load_generation_config",
    "load_model",
    "plan_placement",
    "st_dtype_name",
    "validate_checkpoint",
]
