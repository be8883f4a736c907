"""CUDA-graph decode: one captured graph per layer (plus embedding and head), replayed every step.

All decode state lives preallocated on each layer's device (`ModelState`); the step's inputs (token id,
position) reach every device through one pinned host buffer and non-blocking copies into static
tensors, and every position-dependent decision is made on the device, so one capture is right at
every position. Residual streams hop devices between graphs without host syncs (stream waits only); on one
device a graph reads the previous graph's output where it lies (no copy between them). With `use_graphs=False` the
same step runs eagerly (the reference for the graphs).
"""

from __future__ import annotations

import torch

from dsv4.model.transformer import Transformer
from dsv4.state import ModelState


class DecodeRunner:
    """Decode one token at a time for batch 1 through per-layer CUDA graphs (or eagerly)."""

    def __init__(self, model: Transformer, state: ModelState, use_graphs: bool = True, warmup: int = 2):
        if state.batch != 1:
            raise ValueError(f"the decode runner supports batch 1, state has batch {state.batch}")
        if use_graphs and model.embed.weight.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on CUDA devices (use use_graphs=False on CPU)")
        self.model, self.state, self.use_graphs = model, state, use_graphs
        model.prepare()  # every weight's kernel layout, made before warm-up and capture
        self.devices = [layer.attn_norm.weight.device for layer in model.layers]
        self.embed_dev = model.embed.weight.device
        self.head_dev = model.head.weight.device
        uniq = list(dict.fromkeys([self.embed_dev, *self.devices, self.head_dev]))
        pin = self.embed_dev.type == "cuda"
        # a small ring of pinned [token id, position] buffers: a slot is rewritten only after the
        # copies that read it (recorded by an event) have run, so the host never races the GPU
        self.ring = [torch.zeros(2, dtype=torch.int64, pin_memory=pin) for _ in range(4)]
        self.ring_events: list = [None] * len(self.ring)
        self.slot = 0
        self.inp = {d: torch.zeros(2, dtype=torch.int64, device=d) for d in uniq}  # static per device
        hc, D = model.cfg.hc_mult, model.cfg.hidden_size
        dt = model.numerics.dtype
        # x_in[i]: static input streams of layer i (on its device); x_out[i]: its output
        self.x_in = [torch.zeros(1, 1, hc, D, dtype=dt, device=d) for d in self.devices]
        self.x_out: list[torch.Tensor] = [None] * len(self.devices)
        self.x_head = torch.zeros(1, 1, hc, D, dtype=dt, device=self.head_dev)
        self.embed_out: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.graphs: dict = {}
        if use_graphs:
            if warmup < 1:
                raise ValueError("CUDA-graph capture needs at least one warm-up step")
            self._capture(warmup)

    # ---- the step pieces, each reading only static tensors ----
    def _ids(self, dev) -> torch.Tensor:
        return self.inp[dev][0:1].view(1, 1)

    def _pos(self, dev) -> torch.Tensor:
        return self.inp[dev][1:2]

    def _run_embed(self) -> torch.Tensor:
        return self.model.embed_step(self._ids(self.embed_dev))

    def _run_layer(self, i: int) -> torch.Tensor:
        dev = self.devices[i]
        return self.model.layer_step(i, self.x_in[i], self._ids(dev), self._pos(dev), self.state.blocks[i])

    def _run_head(self) -> torch.Tensor:
        return self.model.head_step(self.x_head)

    def _capture(self, warmup: int) -> None:
        # warm up on a side stream (allocator, lazy inits), capture, then clear what warm-up wrote
        self._upload(0, 0)
        pools: dict = {}
        # torch.cuda.graph's default capture stream is created once, on whichever device is current
        # at first use: every device needs its own capture stream
        streams = {d: torch.cuda.Stream(d) for d in dict.fromkeys([self.embed_dev, *self.devices, self.head_dev])}
        pieces = [("embed", self.embed_dev, self._run_embed)]
        pieces += [(i, d, (lambda i=i: self._run_layer(i))) for i, d in enumerate(self.devices)]
        pieces += [("head", self.head_dev, self._run_head)]
        for key, dev, fn in pieces:
            # on the previous piece's device, read its output in place: it lives in the graph's memory pool as long as
            # the graph does, and the step's copy between the two graphs goes away
            prev = self.embed_out if key == 0 else self.x_out[key - 1] if isinstance(key, int) else \
                self.x_out[-1] if key == "head" else None
            if prev is not None and prev.device == dev:
                if key == "head":
                    self.x_head = prev
                else:
                    self.x_in[key] = prev
            with torch.cuda.device(dev):
                s = torch.cuda.Stream(dev)
                s.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(s), torch.no_grad():
                    for _ in range(warmup):
                        fn()
                torch.cuda.current_stream(dev).wait_stream(s)
                g = torch.cuda.CUDAGraph()
                # graphs of one device replay one after another: they share one memory pool
                with torch.no_grad(), torch.cuda.graph(g, pool=pools.get(dev), stream=streams[dev]):
                    out = fn()
                pools.setdefault(dev, g.pool())
                # run it once: the tensors its capture made hold nothing until a replay, and the next pieces'
                # warm-ups read some of them (the step plan the device's first layer builds)
                g.replay()
                self.graphs[key] = g
                self._bind(key, out)
        torch.cuda.synchronize()
        self.state.reset()

    def _bind(self, key, out: torch.Tensor) -> None:
        if key == "embed":
            self.embed_out = out
        elif key == "head":
            self.logits = out
        else:
            self.x_out[key] = out

    def _upload(self, token: int, pos: int) -> None:
        self.slot = (self.slot + 1) % len(self.ring)
        host, ev = self.ring[self.slot], self.ring_events[self.slot]
        for e in ev or ():
            e.synchronize()  # the copies that read this slot 4 steps ago are done
        host[0], host[1] = token, pos
        for t in self.inp.values():
            t.copy_(host, non_blocking=True)
        if host.is_pinned():
            events = []
            for dev in self.inp:
                e = torch.cuda.Event()
                e.record(torch.cuda.current_stream(dev))
                events.append(e)
            self.ring_events[self.slot] = events

    @staticmethod
    def _hop(dst: torch.Tensor, src: torch.Tensor) -> None:
        # cross-device (or same-device) copy ordered after src's producer, without a host sync; none where the graph
        # reads src in place (see _capture)
        if dst is src:
            return
        if dst.device != src.device:
            torch.cuda.current_stream(dst.device).wait_stream(torch.cuda.current_stream(src.device))
        dst.copy_(src, non_blocking=True)

    @torch.no_grad()
    def step(self, token: int, pos: int | None = None) -> torch.Tensor:
        """Feed `token` at `pos` (default state.pos) -> next-token logits [vocab] fp32 (on the head device)."""
        pos = self.state.pos if pos is None else pos
        if pos >= self.state.max_len:
            raise ValueError(f"position {pos} is past the state's max_len {self.state.max_len}")
        self._upload(token, pos)
        if self.use_graphs:
            self.graphs["embed"].replay()
            x = self.embed_out
        else:
            x = self._run_embed()
        for i in range(len(self.devices)):
            self._hop(self.x_in[i], x)
            if self.use_graphs:
                self.graphs[i].replay()
                x = self.x_out[i]
            else:
                x = self._run_layer(i)
        self._hop(self.x_head, x)
        if self.use_graphs:
            self.graphs["head"].replay()
            logits = self.logits
        else:
            logits = self._run_head()
        self.state.pos = pos + 1
        return logits[0, -1]
