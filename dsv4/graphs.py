"""CUDA graphs: the decode step (one captured graph per layer, plus embedding and head, replayed every step) and the
full prefill chunks (two graphs per layer around an eager middle, `PrefillRunner`).

All decode state lives preallocated on each layer's device (`ModelState`); the step's inputs (token id,
position) reach every device through a ring of pinned host buffers and non-blocking copies into static
tensors, or, for a token sampled on the device, through device copies (the position by `fill_`), and every
position-dependent decision is made on the device, so one capture is right at every position. Residual streams hop devices between graphs without host syncs (stream waits only); on one
device a graph reads the previous graph's output where it lies (no copy between them). With `use_graphs=False` the
same step runs eagerly (the reference for the graphs).

A layer with compressors has two step schedules (Attention.begin's `defer` and `lag`): at a position that closes a
compressor window the compressors run ahead of the attention, which reads the entry they emit, over the window's rows
kept by the steps before; at every other position (CSA: 3 in 4, HCA: 127 in 128) the step only keeps its x (a CSA
layer's indexer also projects its head weights). Such a layer gets two graphs, the deferring one (`graphs[i]`) and the
emitting one (`graphs[(i, "emit")]`, which ends by copying its output streams into the deferring graph's, so that the
next graph reads one tensor either way); each step replays the one its position calls for (`layer_graph`), and the
runner keeps `BlockState.lagging` (the compressor state's open rows are not written between the two). (The first layer
on a device builds the step plan in its graph, and two graphs would build two plans: it keeps one schedule, its
compressors run at every step; a state that deferring steps left behind is brought up to date first,
`Transformer.catch_up`, as before a prefill chunk.)
"""

from __future__ import annotations

import torch

from dsv4 import ops
from dsv4.model.layers import StepPlan
from dsv4.model.transformer import Transformer
from dsv4.state import ModelState


def hop(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy src into dst ordered after src's producer, without a host sync (a cross-device copy waits on the source
    device's stream); nothing when dst is src."""
    if dst is src:
        return
    if dst.device != src.device:
        torch.cuda.current_stream(dst.device).wait_stream(torch.cuda.current_stream(src.device))
    dst.copy_(src, non_blocking=True)


def defer_ratios(model: Transformer) -> list[int]:
    """Per layer: the compressor ratio of a layer whose compressors a decode step that closes none of their windows
    defers (two schedules: a CSA or HCA layer), else 0 (one schedule: no compressor, or the first layer on its device,
    which builds the step plan). See the module's docstring."""
    devs = [layer.attn_norm.weight.device for layer in model.layers]
    return [layer.spec.ratio if layer.attn.can_defer and i > 0 and devs[i - 1] == d else 0
            for i, (layer, d) in enumerate(zip(model.layers, devs))]


def _copy_into(dst, src) -> None:
    """dst.copy_(src) over tensors and (nested) tuples of them."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    else:
        for d, t in zip(dst, src, strict=True):
            _copy_into(d, t)


class DecodeRunner:
    """Decode one token at a time for batch 1 through per-layer CUDA graphs (or eagerly). defer: a layer with
    compressors has two decode schedules (see the module's docstring); False: one, the compressors always ahead of the
    attention."""

    def __init__(self, model: Transformer, state: ModelState, use_graphs: bool = True, warmup: int = 2,
                 defer: bool = True):
        if state.batch != 1:
            raise ValueError(f"the decode runner supports batch 1, state has batch {state.batch}")
        if use_graphs and model.embed.weight.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on CUDA devices (use use_graphs=False on CPU)")
        self.model, self.state, self.use_graphs = model, state, use_graphs
        model.prepare()  # every weight's kernel layout, made before warm-up and capture
        self.devices = [layer.attn_norm.weight.device for layer in model.layers]
        self.embed_dev = model.embed.weight.device
        self.head_dev = model.head.weight.device
        self.defer_ratio = defer_ratios(model) if defer else [0] * len(model.layers)
        # one-schedule layers with compressors: brought up to date before a step where deferring steps (another
        # runner's) left their state behind
        self.every_step = [i for i, layer in enumerate(model.layers)
                           if layer.attn.compressor is not None and not self.defer_ratio[i]]
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
        # pre_out[i]: layer i + 1's attention input (y, post, comb) where layer i's FFN op makes it
        # (Transformer.next_block), which layer i + 1's step reads (in place: the two run on one device)
        self.pre_out: list = [None] * len(self.devices)
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

    def _run_layer(self, i: int, defer: bool = False):
        # a two-schedule layer's emitting step closes the window of the deferring steps before it (lag)
        dev = self.devices[i]
        pre = self.pre_out[i - 1] if i > 0 else None
        return self.model.layer_step(i, self.x_in[i], self._ids(dev), self._pos(dev), self.state.blocks[i], pre,
                                     defer, self.defer_ratio[i] > 0 and not defer)

    def _run_emit(self, i: int):
        """Layer i's emitting schedule, its outputs copied into the deferring schedule's (bound by then)."""
        out = self._run_layer(i)
        x, pre = out if isinstance(out, tuple) else (out, None)
        _copy_into(self.x_out[i], x)
        if pre is not None:
            _copy_into(self.pre_out[i], pre)
        return out

    def defers(self, i: int, pos: int) -> bool:
        """Whether a step at pos runs layer i's deferring schedule (its compressors close no window there)."""
        r = self.defer_ratio[i]
        return r > 0 and (pos + 1) % r != 0

    def layer_graph(self, i: int, pos: int) -> torch.cuda.CUDAGraph:
        """The graph a step at pos replays for layer i."""
        return self.graphs[i] if self.defers(i, pos) or not self.defer_ratio[i] else self.graphs[(i, "emit")]

    def layer_fn(self, i: int, pos: int):
        """Layer i's step at pos as a callable (its graph's replay, or the eager step): for the benchmarks."""
        if self.use_graphs:
            return self.layer_graph(i, pos).replay
        return lambda: self._run_layer(i, self.defers(i, pos))

    def _run_head(self) -> torch.Tensor:
        return self.model.head_step(self.x_head)

    def _capture(self, warmup: int) -> None:
        # warm up on a side stream (allocator, lazy inits), capture, then clear what warm-up wrote (and what a state
        # handed over held: the pieces are captured from a clean one, none of whose compressors lag)
        self.state.reset()
        self._upload(0, 0)
        pools: dict = {}
        # torch.cuda.graph's default capture stream is created once, on whichever device is current
        # at first use: every device needs its own capture stream
        streams = {d: torch.cuda.Stream(d) for d in dict.fromkeys([self.embed_dev, *self.devices, self.head_dev])}
        pieces = [("embed", self.embed_dev, self._run_embed)]
        for i, d in enumerate(self.devices):
            pieces.append((i, d, (lambda i=i: self._run_layer(i, self.defer_ratio[i] > 0))))
            if self.defer_ratio[i]:  # its second schedule, after the first's outputs are bound
                pieces.append(((i, "emit"), d, (lambda i=i: self._run_emit(i))))
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
            # the pieces replay their captured shapes: kernels may specialize on them (ops.fixed_shapes), and do so in
            # the warm-up, so that nothing compiles during the capture
            with torch.cuda.device(dev), ops.fixed_shapes():
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

    def _bind(self, key, out) -> None:
        if isinstance(key, tuple):  # a second schedule: its outputs were copied into the first's
            return
        if key == "embed":
            self.embed_out = out
        elif key == "head":
            self.logits = out
        elif isinstance(out, tuple):  # the streams and the next layer's attention input
            self.x_out[key], self.pre_out[key] = out
        else:
            self.x_out[key], self.pre_out[key] = out, None  # (the next layer makes its own)

    def _upload(self, token: int | torch.Tensor, pos: int) -> None:
        if isinstance(token, torch.Tensor):  # a sampled token still on its device: no host round trip
            for t in self.inp.values():
                t[0:1].copy_(token.view(1), non_blocking=True)
                t[1:2].fill_(pos)
            return
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

    @torch.no_grad()
    def step(self, token: int | torch.Tensor, pos: int | None = None) -> torch.Tensor:
        """Feed `token` at `pos` (default state.pos) -> next-token logits [vocab] fp32 (on the head device). `token`
        may be a one-element int64 tensor on a device (the last step's sample): the step is then queued behind the
        sampling without the host reading the token first."""
        pos = self.state.pos if pos is None else pos
        if pos >= self.state.max_len:
            raise ValueError(f"position {pos} is past the state's max_len {self.state.max_len}")
        if self.every_step:
            self.model.catch_up(self.state, self.every_step)
        self._upload(token, pos)
        if self.use_graphs:
            self.graphs["embed"].replay()
            x = self.embed_out
        else:
            x = self._run_embed()
        for i in range(len(self.devices)):
            hop(self.x_in[i], x)  # nothing where the graph reads x in place (see _capture)
            if self.use_graphs:
                self.layer_graph(i, pos).replay()
            else:
                self._bind(i, self._run_layer(i, self.defers(i, pos)))
            if self.defer_ratio[i]:
                self.state.blocks[i].lagging = self.defers(i, pos)
            x = self.x_out[i]
        hop(self.x_head, x)
        if self.use_graphs:
            self.graphs["head"].replay()
            logits = self.logits
        else:
            logits = self._run_head()
        self.state.pos = pos + 1
        return logits[0, -1]


def prefill_graphs_apply() -> bool:
    """Whether the ops bound now can be captured for prefill: the reference MoE (moe_experts_ref, which moe_post_ref
    calls) syncs with the host (its expert loop)."""
    from dsv4 import ops

    return all(ops.OPS[name].active == "fast" for name in ("moe_experts", "moe_post"))


class PrefillRunner:
    """Full prefill chunks, batch 1, through two CUDA graphs per layer around an eager middle.

    Launched one by one, a 128-token chunk's ~20-40 kernels per layer take the host longer than the GPU takes to run
    them. Every full chunk past position 0 has the same shapes except the compressed-entry index lists, whose width
    follows the chunk's end. So each layer is captured as `Block.begin` (mHC pre + norm, the projections, the
    compressors) and `Block.finish` (wo_a, wo_b, the mHC boundary, the FFN), and `Attention.attend` (the index
    lists, the indexer, the queries' and kv's norm + RoPE, the sparse attention, the ring insert) runs eagerly
    between the two replays, its output copied into a static buffer. The chunk's plan (positions, window lists, RoPE
    rows, visible counts) is made inside the device's first graph from a static start position, and the token ids
    are copied into a static buffer per device. A shorter last chunk, and a first chunk shorter than the window
    (its window lists are shorter), run eagerly (`Transformer.forward_streams`). The same kernels run in the same
    order on the same inputs as in the eager chunk: the same bits. Memory: every layer's `begin` outputs (at Flash
    width ~11 MB: the queries before their norm, the indexer's queries, the compressors' projections) and output
    streams (4 MB) stay in the graphs' pool (measured on an H200: +225 MiB allocated for 4 Flash layers). Needs ops
    without host syncs (`prefill_graphs_apply`: the reference MoE syncs)."""

    def __init__(self, model: Transformer, state: ModelState, chunk: int, warmup: int = 1):
        if state.batch != 1:
            raise ValueError(f"the prefill runner supports batch 1, state has batch {state.batch}")
        if model.embed.weight.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on CUDA devices")
        if chunk < 2 or 2 * chunk > min(state.max_len, model.max_pos):
            raise ValueError(f"prefill graphs of {chunk}-token chunks need room for two chunks in the state "
                             f"({state.max_len} positions)")
        if warmup < 1:
            raise ValueError("CUDA-graph capture needs at least one warm-up run")
        self.model, self.state, self.chunk = model, state, chunk
        model.prepare()
        self.devices = [layer.attn_norm.weight.device for layer in model.layers]
        self.embed_dev = model.embed.weight.device
        uniq = list(dict.fromkeys([self.embed_dev, *self.devices]))
        self.ids = {d: torch.zeros(1, chunk, dtype=torch.int64, device=d) for d in uniq}  # static per device
        self.start = {d: torch.zeros(1, dtype=torch.int64, device=d) for d in dict.fromkeys(self.devices)}
        self.plans: dict = {}  # device -> the plan its first graph makes
        self.o_in: dict = {}  # device -> the attention output buffer its `finish` graphs read
        n = len(self.devices)
        # x_in[i]: layer i's static input where it hops from another device (or the embedding runs elsewhere); None:
        # layer 0 embeds inside its graph, later layers read the previous graph's output in place
        self.x_in: list = [None] * n
        self.x_out: list = [None] * n
        self.begun: list = [None] * n  # layer i's `begin` outputs (carry, AttnStart)
        self.pre: list = []
        self.post: list = []
        self._capture(warmup)

    def applies(self, S: int, p0: int) -> bool:
        """Whether a chunk of S tokens at position p0 runs through the graphs (else forward_streams runs it): a full
        chunk past position 0, or at 0 where the chunk is no shorter than the window (its window lists are then the
        same width as a later chunk's)."""
        return S == self.chunk and (p0 > 0 or self.chunk >= self.model.cfg.sliding_window)

    def _plan(self, dev) -> StepPlan:
        return StepPlan.build(self.start[dev], self.chunk, self.model.cfg.sliding_window, None)

    def _input(self, i: int) -> torch.Tensor:
        if self.x_in[i] is None:
            return self.model.embed_streams(self.ids[self.devices[i]]) if i == 0 else self.x_out[i - 1]
        return self.x_in[i]

    def _begin(self, i: int, plan: StepPlan) -> tuple:
        layer = self.model.layers[i]
        rope = self.model.rope(layer.spec.rope, self.devices[i])
        return layer.begin(self._input(i), plan, self.state.blocks[i], rope, join=True)

    def _set_chunk(self, p0: int) -> None:
        # the plans' host part: the chunk's end (index-list widths); index lists made for another end are dropped
        for plan in self.plans.values():
            plan.end = p0 + self.chunk
            for key in [k for k in plan.visible if isinstance(k, tuple)]:
                del plan.visible[key]

    def _hop_in(self, i: int) -> None:
        if self.x_in[i] is not None:
            hop(self.x_in[i], self.model.embed_streams(self.ids[self.embed_dev]) if i == 0 else self.x_out[i - 1])

    def _capture(self, warmup: int) -> None:
        p0 = self.chunk  # any full chunk after the first: the warm-ups and captures run there
        for t in self.start.values():
            t.fill_(p0)
        pools: dict = {}
        streams = {d: torch.cuda.Stream(d) for d in dict.fromkeys(self.devices)}
        for i, dev in enumerate(self.devices):
            layer, st = self.model.layers[i], self.state.blocks[i]
            prev_dev = self.embed_dev if i == 0 else self.devices[i - 1]
            if prev_dev != dev:
                src = self.model.embed_streams(self.ids[self.embed_dev]) if i == 0 else self.x_out[i - 1]
                self.x_in[i] = torch.zeros(src.shape, dtype=src.dtype, device=dev)
            with torch.cuda.device(dev), torch.no_grad():
                self._hop_in(i)
                main = torch.cuda.current_stream(dev)
                s = torch.cuda.Stream(dev)
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    for _ in range(warmup):  # a plan of its own: the captured one must make its tensors in the graph
                        plan = self._plan(dev)
                        plan.end = p0 + self.chunk
                        carry, a = self._begin(i, plan)
                        layer.finish(layer.attn.attend(a, plan, st), carry, self.ids[dev])
                main.wait_stream(s)
                # every graph of a device shares one pool: they replay in capture order, each reading the outputs
                # that the earlier ones keep referenced
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pools.get(dev), stream=streams[dev]):
                    if dev not in self.plans:
                        self.plans[dev] = self._plan(dev)
                    self.begun[i] = self._begin(i, self.plans[dev])
                pools.setdefault(dev, g.pool())
                g.replay()  # its outputs hold values for the middle's run and the next capture
                self.pre.append(g)
                self._set_chunk(p0)
                o = layer.attn.attend(self.begun[i][1], self.plans[dev], st)
                o_in = self.o_in.setdefault(dev, torch.empty_like(o))
                o_in.copy_(o)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pools[dev], stream=streams[dev]):
                    self.x_out[i] = layer.finish(o_in, self.begun[i][0], self.ids[dev])
                g.replay()
                self.post.append(g)
        for d in dict.fromkeys(self.devices):
            torch.cuda.synchronize(d)
        self.state.reset()

    @torch.no_grad()
    def run(self, ids: torch.Tensor, p0: int, layer_call=None) -> torch.Tensor:
        """ids [1, chunk] (on the embedding's device) at positions p0.. (see applies) -> the final residual streams
        [1, chunk, hc, D] (a graph output: valid until the next run); advances state.pos. layer_call(i, work), if
        given, runs layer i's work (`work()`, after the streams have reached the layer's device; tools time it), in
        the layer's device context."""
        S = ids.shape[1]
        if ids.shape[0] != 1 or not self.applies(S, p0):
            raise ValueError(f"the prefill graphs run [1, {self.chunk}] chunks (past position 0 unless the "
                             f"chunk covers the window), got {list(ids.shape)} at {p0}")
        if p0 + S > self.state.max_len:
            raise ValueError(f"positions {p0}..{p0 + S - 1} exceed the state's max_len {self.state.max_len}")
        if p0 + S > self.model.max_pos:
            raise ValueError(f"positions {p0}..{p0 + S - 1} exceed the model's RoPE table ({self.model.max_pos})")
        self.model.catch_up(self.state)
        for buf in self.ids.values():
            hop(buf, ids)
        for t in self.start.values():
            t.fill_(p0)
        self._set_chunk(p0)
        for i, dev in enumerate(self.devices):
            with torch.cuda.device(dev):
                self._hop_in(i)
                if layer_call is None:
                    self._layer(i, dev)
                else:
                    layer_call(i, lambda i=i, dev=dev: self._layer(i, dev))
        self.state.pos = p0 + S
        return self.x_out[-1]

    def _layer(self, i: int, dev) -> None:
        self.pre[i].replay()
        o = self.model.layers[i].attn.attend(self.begun[i][1], self.plans[dev], self.state.blocks[i])
        self.o_in[dev].copy_(o)
        self.post[i].replay()
