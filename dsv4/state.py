"""Per-sequence inference state, preallocated once for a maximum context and never grown.

Per block: the sliding-window KV ring (`sliding_window` slots, slot = p mod W), the compressed KV
entries, the compressor's raw per-token partial windows (values and gate+ape scores, CSA also the
previous complete window for the overlap) and its input rows of the open window (`x_ring`), and for CSA the
indexer's key cache and its compressor state. `ModelState.reset()` starts a new sequence: positions to 0, compressor
scores to -inf. `ModelState.mark()` copies what later positions overwrite (the rings and the compressors' open
windows) and `rewind(mark)` puts it back: the state is then the one after the marked position again, whatever ran past
it (a chat's next turn that re-renders the end of the last prompt, `Engine.complete(keep=...)`).

With `kv_packed` (reference numerics, bf16 activations: the FP8 simulation of the K = V rows is on) the window ring and
the attention compressor's entries hold packed FP8 rows (dsv4/ops/kv_pack.py: 592 bytes a Flash row instead of
1,024), the same values bit for bit. With `keys_packed` (the same conditions: the indexer's keys are FP4-simulated)
the indexer's keys are packed FP4 rows (80 bytes a Flash key instead of 256), the same values bit for bit.
"""

from __future__ import annotations

import torch

from dsv4.config import LayerSpec, ModelConfig
from dsv4.ops.kv_pack import key_row_bytes, kv_row_bytes


class CompressorState:
    """Raw projections of the incomplete window (+ CSA's previous window) and the emitted entries.

    kv / score: fp32 [B, coff*r, coff*d]. CSA (coff=2): slots 0..r-1 = previous complete window,
    slots r..2r-1 = current window; HCA (coff=1): slot = p mod r. Scores include `ape`.
    entries: [B, max_len // r + 1, d] in the activation dtype (post norm/RoPE/quant simulation), or packed rows
    [B, max_len // r + 1, bytes] uint8 (packed "kv": FP8 K = V rows of kv_row_bytes(d); "key": FP4 indexer keys of
    key_row_bytes(d)); the spare last row belongs to a window that cannot close within max_len (no query reads it).
    """

    def __init__(self, batch: int, ratio: int, dim: int, overlap: bool, max_len: int, dtype, device,
                 packed: str | None = None):
        coff = 2 if overlap else 1
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        self.kv = torch.zeros(batch, coff * ratio, coff * dim, dtype=torch.float32, device=device)
        self.score = torch.full_like(self.kv, float("-inf"))
        rb = {None: None, "kv": kv_row_bytes, "key": key_row_bytes}[packed]
        width, edt = (rb(dim), torch.uint8) if rb else (dim, dtype)
        self.entries = torch.zeros(batch, max_len // ratio + 1, width, dtype=edt, device=device)

    def reset(self) -> None:
        self.kv.zero_()
        self.score.fill_(float("-inf"))
        self.entries.zero_()


class BlockState:
    """One block's state. A block with compressors also keeps `x_ring` [B, ratio, D] (activation dtype): the
    compressors' input x of the open window's positions, slot = p mod ratio, written by every step and chunk. A decode
    step that closes no window may leave its compressors' work to the step that closes it (Attention.begin's `defer`):
    that step projects the window's x rows at once. Until then the compressor states' open rows are stale and
    `lagging` (a host flag the decode runner keeps) is set; `Attention.catch_up` brings them up to date before anything
    else reads them (a prefill chunk, a step in the one-schedule mode)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, batch: int, max_len: int, dtype, device,
                 kv_packed: bool = False, keys_packed: bool = False):
        self.max_len = max_len
        width, wdt = (kv_row_bytes(cfg.head_dim), torch.uint8) if kv_packed else (cfg.head_dim, dtype)
        self.window = torch.zeros(batch, cfg.sliding_window, width, dtype=wdt, device=device)
        self.compressor = None
        self.indexer = None
        self.x_ring = None
        self.lagging = False
        if spec.ratio > 0:
            self.x_ring = torch.zeros(batch, spec.ratio, cfg.hidden_size, dtype=dtype, device=device)
            self.compressor = CompressorState(batch, spec.ratio, cfg.head_dim, spec.overlap, max_len, dtype, device,
                                              "kv" if kv_packed else None)
        if spec.has_indexer:
            self.indexer = CompressorState(batch, spec.ratio, cfg.index_head_dim, True, max_len, dtype, device,
                                           "key" if keys_packed else None)

    def reset(self) -> None:
        self.window.zero_()
        self.lagging = False
        if self.x_ring is not None:
            self.x_ring.zero_()
        for c in (self.compressor, self.indexer):
            if c is not None:
                c.reset()


class StateMark:
    """A ModelState as it was at position `pos` (ModelState.mark): copies of the tensors that positions from `pos` on
    overwrite, and the blocks' `lagging` flags. The rest of the state is indexed by position for good (the compressed
    entries and the indexer's keys of the windows closed before `pos`), so the copies restore it whole as long as
    nothing before `pos` is rewritten (a reset, or a prompt that diverges before `pos`, invalidates the mark: `rewind`
    refuses a mark taken before the state's last reset; the rest is the caller's: Engine.complete drops the marks past
    the position a request starts writing at)."""

    def __init__(self, owner: ModelState, pos: int, tensors: list[torch.Tensor], lagging: list[bool], epoch: int):
        self.owner, self.pos, self.tensors, self.lagging, self.epoch = owner, pos, tensors, lagging, epoch


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i as multi-tensor copies (torch._foreach_copy_): a few launches for the ~200 of a
    43-layer state, against one each (2.8 ms for a Flash mark on an H200, sixty-sixth pass)."""
    if len(dst) != len(src):
        raise ValueError(f"{len(dst)} tensors to copy into, {len(src)} to copy from")
    torch._foreach_copy_(dst, src)


class ModelState:
    """All state of `batch` sequences that advance together, for up to `max_len` positions."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype=torch.float32, device="cpu",
                 with_mtp: bool = False, block_devices: list | None = None, mtp_devices: list | None = None,
                 kv_packed: bool = False, keys_packed: bool = False):
        """block_devices / mtp_devices: per-block devices (layers spread over GPUs); default `device`. kv_packed: the
        K = V rows as packed FP8 rows; keys_packed: the indexer's keys as packed FP4 rows (both: bf16 activations,
        reference numerics)."""
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_len {max_len} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}"
            )
        self.batch, self.max_len = batch, max_len
        self.pos = 0  # number of tokens already processed (the next token's position)
        self.epoch = 0  # resets so far (a StateMark from an earlier epoch no longer holds)
        bdev = block_devices or [device] * len(cfg.layers)
        mdev = mtp_devices or [device] * len(cfg.mtp_layers)
        self.kv_packed, self.keys_packed = kv_packed, keys_packed
        self.blocks = [BlockState(cfg, s, batch, max_len, dtype, d, kv_packed, keys_packed)
                       for s, d in zip(cfg.layers, bdev)]
        self.mtp = ([BlockState(cfg, s, batch, max_len, dtype, d, kv_packed, keys_packed)
                     for s, d in zip(cfg.mtp_layers, mdev)] if with_mtp else [])

    def reset(self) -> None:
        self.pos = 0
        self.epoch += 1
        for b in self.blocks + self.mtp:
            b.reset()

    def _overwritten(self) -> list[torch.Tensor]:
        """The tensors that positions past the current one overwrite in place: each block's window ring (slot = p mod
        W), its compressors' input rows of the open window (x_ring, slot = p mod ratio) and the compressor states' open
        windows (kv / score, CSA's previous window with them)."""
        out = []
        for b in self.blocks + self.mtp:
            out.append(b.window)
            if b.x_ring is not None:
                out.append(b.x_ring)
            out += [t for c in (b.compressor, b.indexer) if c is not None for t in (c.kv, c.score)]
        return out

    def mark(self, into: StateMark | None = None) -> StateMark:
        """This state at `pos` as a StateMark that `rewind` restores (see StateMark for when it holds). `into`: an
        earlier mark of this state whose buffers are reused (nothing is allocated then; the old mark is gone)."""
        src = self._overwritten()
        bufs = into.tensors if into is not None and into.owner is self else [torch.empty_like(t) for t in src]
        _copy_all(bufs, src)
        return StateMark(self, self.pos, bufs, [b.lagging for b in self.blocks + self.mtp], self.epoch)

    def rewind(self, mark: StateMark) -> None:
        """Back to the state `mark` was taken of, at mark.pos (device copies; no host sync)."""
        if mark.owner is not self:
            raise ValueError("the mark was taken of another state")
        if mark.epoch != self.epoch:
            raise ValueError("the mark was taken before the state's last reset")
        _copy_all(self._overwritten(), mark.tensors)
        for b, lag in zip(self.blocks + self.mtp, mark.lagging, strict=True):
            b.lagging = lag
        self.pos = mark.pos
