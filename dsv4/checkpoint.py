"""The one name table: which tensors a checkpoint for a config holds, and how they enter the model.

The model's module tree carries the official names (SPEC §3.2), so the table is read off a model
built on the meta device: name -> shape and accepted dtypes. Plain float tensors (BF16 in the official
release) may also be F32/F16; quantized data and scales must have their exact dtype; `tid2eid` may be
I64 or I32. `assign_tensor` puts one tensor into the model: in place of the placeholder buffer, or,
for a routed expert (`...ffn.experts.{e}.w1.weight`), into slice e of the layer's stacked tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.config import ModelConfig

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]  # accepted stored dtypes; the first is the official one

    def accepts(self, dtype: torch.dtype) -> bool:
        return dtype in self.dtypes


def _accepted(name: str, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    if name.endswith("tid2eid"):
        return (torch.int64, torch.int32)
    if dtype in FLOAT_DTYPES and not name.endswith(("weight_scale_2", "input_scale")) and not name.endswith(".scale"):
        return (dtype,) + tuple(d for d in FLOAT_DTYPES if d != dtype)
    return (dtype,)


def expected_tensors(cfg: ModelConfig, with_mtp: bool = True) -> dict[str, TensorSpec]:
    """name -> TensorSpec for every tensor a checkpoint of `cfg` holds (MTP tensors if with_mtp)."""
    from dsv4.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg, max_pos=1)
    out = {}
    for name, t in model.state_dict().items():
        if not with_mtp and name.startswith("mtp."):
            continue
        out[name] = TensorSpec(tuple(t.shape), _accepted(name, t.dtype))
    return out


def _resolve(model: torch.nn.Module, name: str):
    """name -> (module, buffer name, expert index or None)."""
    from dsv4.model.moe import StackedExperts

    parts = name.split(".")
    mod = model
    for i, p in enumerate(parts[:-1]):
        if isinstance(mod, StackedExperts) and p.isdigit() and len(parts) - i == 3:
            lin, suffix = mod.slot(int(p), parts[i + 1], parts[i + 2])
            return lin, suffix, int(p)
        mod = getattr(mod, p)
    return mod, parts[-1], None


def assign_tensor(model: torch.nn.Module, name: str, tensor: torch.Tensor, device=None) -> None:
    """Put `tensor` into the model as `name` (moved to the buffer's device): replaces the placeholder
    buffer, or writes a routed expert's slice of its layer's stack (allocated on first use, and kept
    in the checkpoint's float dtype, so an fp32 checkpoint is not rounded to the placeholder's bf16).

    Checks shape and dtype against the placeholder; a float placeholder accepts any float dtype.
    """
    try:
        mod, attr, expert = _resolve(model, name)
    except (AttributeError, KeyError):
        raise KeyError(f"{name}: the model has no such tensor") from None
    old = mod._buffers.get(attr)
    if expert is not None and old is not None:
        _assign_expert(mod, attr, expert, old, name, tensor, device)
        return
    if old is None:
        raise KeyError(f"{name}: the model has no such tensor")
    if tuple(tensor.shape) != tuple(old.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(old.shape)}")
    if tensor.dtype not in _accepted(name, old.dtype):
        raise ValueError(f"{name}: dtype {tensor.dtype}, expected {old.dtype}")
    target = device if device is not None else (old.device if old.device.type != "meta" else "cpu")
    mod._buffers[attr] = tensor.to(target)


def _assign_expert(mod, attr: str, e: int, stack: torch.Tensor, name: str, tensor: torch.Tensor, device) -> None:
    if tuple(tensor.shape) != tuple(stack.shape[1:]):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(stack.shape[1:])}")
    if tensor.dtype not in _accepted(name, stack.dtype):
        raise ValueError(f"{name}: dtype {tensor.dtype}, expected {stack.dtype}")
    target = torch.device(device) if device is not None else (stack.device if stack.device.type != "meta"
                                                              else torch.device("cpu"))
    if stack.device.type == "meta":
        stack = torch.zeros(stack.shape, dtype=tensor.dtype, device=target)
    elif stack.dtype != tensor.dtype or stack.device != target:
        stack = stack.to(device=target, dtype=tensor.dtype if tensor.dtype.is_floating_point else stack.dtype)
    stack[e].copy_(tensor)
    mod._buffers[attr] = stack


def load_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], strict: bool = True,
               allow_missing_mtp: bool = True) -> None:
    """Assign every tensor of an in-memory {official name: tensor} dict; strict: same key sets."""
    names = set(model.state_dict().keys())
    missing = sorted(n for n in names - tensors.keys() if not (allow_missing_mtp and n.startswith("mtp.")))
    extra = sorted(tensors.keys() - names)
    if strict and (missing or extra):
        raise ValueError(f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, unexpected {extra[:8]}")
    for name, t in tensors.items():
        if name in names:
            assign_tensor(model, name, t)
