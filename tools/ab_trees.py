#!/usr/bin/env python3
"""Timing A/B of source variants inside the decode layer graphs: the yardstick of a kernel change, kept in the tree.

    python tools/ab_trees.py --variant rows4=rows4.patch --variant c1n2=c1n2.patch --env-variant nopdl=DSV4_PDL=0 \\
        [--contexts 1024,131072] [--rounds 2] [--layers 4] [--replays 100] [--workdir DIR] [--json F]
        [--device cuda:0|cpu] [--tiny]

Variant "head" (this checkout as it is) always runs first; each --variant NAME=PATCH is a copy of this checkout's
files (`git ls-files`, with their working-tree contents; where this is not the top of a git checkout, every file but
hidden folders, caches and build outputs) under --workdir with PATCH applied (`git apply`). A copy carries a marker
file; an existing folder of a variant's name is replaced only if it has one. Each --env-variant NAME=K=V[,K=V...]
runs head's copy with those environment variables set in its worker: a switch the code reads from the environment
(DSV4_PDL=0, say) needs no patch, copy or build (values cannot hold commas; a variable that changes where or whether the
CUDA kernels build, such as DSV4_CACHE, makes that worker build them itself). Each copy's CUDA kernels are built
first, one copy after another (copies with the same kernel sources share a build in the kernel cache). Then the
variants run in turn, --rounds times, each in its own process inside its copy (this script's `--worker`, importing
the copy's dsv4 and tools): the first --layers layers of Flash with random weights (seed 0) on cuda:0, the state
filled to each context, one decode graph per layer, each timed as `bench_decode.py --layer-us` does (the median of 7
runs of --replays back-to-back replays) at ctx-1 and ctx-2 (with a context that is a multiple of 128, every
compressor emits at ctx-1 and none does at ctx-2), and both steps' logits.

Prints, per context and variant, each round's per-layer us and their sum at ctx-1 / ctx-2, and whether the logits
equal head's bit for bit (else their largest difference); --json writes the same, with, for every variant, the
values of the --env-variant variables its worker saw ("env": a value set in this shell shows in head's and the patch
variants' too, and the tool warns about it) and the copy it ran in ("tree"). A benchmark, not a test: compare
figures of one call only. `--device cpu --tiny` runs the same steps eagerly on the CPU with the reference ops (the
tool's own test). Exit 1 when a variant's patch does not apply or its build or run fails; 2 on bad arguments or
without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Parser(argparse.ArgumentParser):
    """argparse's errors in one line (dsv4.cli.Parser's form; not imported from there: a worker must import the dsv4
    of its own copy, not this checkout's)."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


SKIP_DIRS = {"__pycache__", "build", "dist", "out"}
MARKER = ".ab_trees"  # in every copy this tool makes: the only folders it deletes


def tracked_files(src: Path, exclude: Path | None = None) -> list[str]:
    """The checkout's files as git knows them (their working-tree contents are what gets copied); where src is not
    the top of a git checkout (a copy of one), every file but hidden folders, caches and build outputs (and
    `exclude`, the copies' directory, if it lies inside). RuntimeError when that leaves nothing."""
    files = None
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=src, capture_output=True, text=True)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == src.resolve():
            out = subprocess.run(["git", "ls-files", "-z"], cwd=src, check=True, capture_output=True).stdout
            files = [f for f in out.decode().split("\0") if f]
    except (FileNotFoundError, subprocess.CalledProcessError):  # no git here: the walk below
        files = None
    if files is None:
        files = []
        for d, dirs, names in os.walk(src):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith(".") and not x.endswith(".egg-info")
                       and (exclude is None or Path(d, x).resolve() != exclude.resolve())]
            files += [os.path.relpath(os.path.join(d, n), src) for n in names]
        files.sort()
    if not files:
        raise RuntimeError(f"no files to copy in {src}")
    return files


def make_tree(src: Path, dest: Path, patch: Path | None) -> None:
    """dest = src's tracked files (working-tree contents) with `patch` applied (git apply); raises RuntimeError with
    git's message when the patch does not apply, and when dest exists but is not a copy this tool made."""
    if dest.exists():
        if not (dest / MARKER).is_file():
            raise RuntimeError(f"{dest} exists and is not a copy made by ab_trees: not touching it")
        shutil.rmtree(dest)
    files = tracked_files(src, exclude=dest.parent)
    dest.mkdir(parents=True)
    (dest / MARKER).write_text("a variant copy made by tools/ab_trees.py\n")
    for f in files:
        if not (src / f).is_file():  # deleted in the working tree
            continue
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / f, dest / f)
    if patch is not None and patch.stat().st_size:
        # git reads a patch's paths from the top of the work tree it finds dest in, and skips what lies outside dest
        # without failing: the ceiling keeps it from looking above dest's folder
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.parent.resolve())}
        r = subprocess.run(["git", "apply", "--verbose", "--whitespace=nowarn", str(patch.resolve())], cwd=dest,
                           capture_output=True, text=True, env=env)
        if r.returncode or "Skipped patch" in r.stderr:
            lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith(("error", "Skipped"))]
            raise RuntimeError(f"{patch} does not apply: {lines[0] if lines else 'git apply failed'}")


def parse_variant(spec: str) -> tuple[str, Path]:
    name, sep, patch = spec.partition("=")
    if not sep or not name or not patch or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"--variant wants NAME=PATCH (NAME letters, digits, - or _), got {spec!r}")
    if name == "head":
        raise ValueError("--variant: 'head' is this checkout itself, name the variant otherwise")
    p = Path(patch)
    if not p.is_file():
        raise ValueError(f"--variant {name}: no patch file {patch}")
    return name, p


def parse_env_variant(spec: str) -> tuple[str, dict[str, str]]:
    """NAME=K=V[,K=V...] -> (NAME, {K: V}); ValueError naming what is wrong."""
    name, sep, rest = spec.partition("=")
    pairs = [kv.partition("=") for kv in rest.split(",")] if rest else []
    if (not sep or not re.fullmatch(r"[A-Za-z0-9_-]+", name) or not pairs
            or any(not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k, eq, _ in pairs)):
        raise ValueError(f"--env-variant wants NAME=K=V[,K=V...] (NAME letters, digits, - or _; K an environment "
                         f"variable's name), got {spec!r}")
    if name == "head":
        raise ValueError("--env-variant: 'head' is this checkout itself, name the variant otherwise")
    keys = [k for k, _, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"--env-variant {name}: each variable once, got {spec!r}")
    return name, {k: v for k, _, v in pairs}


def summarize(results: dict, variants: list[str]) -> tuple[list[str], dict]:
    """results[variant][round] = {ctx: {"us1": [...], "us2": [...], "same": bool, "diff": float}} (same: the logits
    are head's first round's bit for bit; diff: their largest difference) -> table lines and the per (ctx, variant)
    summary: each round's sums and whether every round's logits were head's bits."""
    lines, summary = [], {}
    ctxs = sorted({int(c) for v in results.values() for r in v for c in r})
    for ctx in ctxs:
        lines.append(f"context {ctx}: us per layer at ctx-1 | ctx-2 (sum), each round")
        for v in variants:
            rows, sums1, sums2, same, diffs = [], [], [], [], []
            for r in results.get(v, []):
                got = r.get(str(ctx)) or r.get(ctx)
                if got is None:
                    continue
                sums1.append(sum(got["us1"]))
                sums2.append(sum(got["us2"]))
                same.append(got["same"])
                diffs.append(got["diff"])
                rows.append(f"{' / '.join(f'{u:.1f}' for u in got['us1'])} ({sums1[-1]:.1f}) | "
                            f"{' / '.join(f'{u:.1f}' for u in got['us2'])} ({sums2[-1]:.1f})")
            all_same = all(same) if same else None
            if all_same:
                bits = "head" if v == "head" else "same bits"
            else:  # head's later rounds differing from its first: the comparison itself is not to be trusted
                bits = (f"{'head: its rounds differ' if v == 'head' else 'logits differ'}, max "
                        f"{max(diffs):.3g}" if diffs else "no rounds")
            for i, row in enumerate(rows):
                lines.append(f"  {v if i == 0 else '':>12}  {row}" + (f"  [{bits}]" if i == 0 else ""))
            summary[f"{ctx}/{v}"] = {"sum_ctx1": sums1, "sum_ctx2": sums2, "same_bits": all_same}
    return lines, summary


def wall_us(fn, n: int, runs: int = 7) -> float:
    """Median over `runs` of the mean wall-clock microseconds of fn() over n calls (one warm call first): the CPU's
    stand-in for bench_decode.median_us."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / n)
    return statistics.median(times)


def worker(args) -> int:
    """One variant's timing, in its own copy (the cwd): prints one JSON line {"us": {ctx: {us1, us2}}, "env": the
    --report-env variables' values here, "tree": the cwd} and saves the logits."""
    sys.path.insert(0, os.getcwd())
    sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
    import torch

    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("error: ab_trees needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    from bench_decode import fill_state, median_us

    from dsv4 import ops
    from dsv4.config import ModelConfig
    from dsv4.graphs import DecodeRunner
    from dsv4.model.layers import Numerics, set_overlap
    from dsv4.model.transformer import Transformer
    from dsv4.testing import randomize_
    from dsv4.writer import FLASH_CONFIG, TINY_CONFIG, truncate_layers

    ctxs = [int(c) for c in args.contexts.split(",")]
    ops.configure("ref" if cpu else "fast", "cpu" if cpu else "cuda", {})
    set_overlap(not cpu)
    raw = truncate_layers(TINY_CONFIG if args.tiny else FLASH_CONFIG, args.layers)
    raw["compress_ratios"] = raw["compress_ratios"][: args.layers]
    raw["num_nextn_predict_layers"] = 0
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_dict(raw), Numerics("reference", torch.bfloat16), max_pos=max(ctxs))
    model.place([args.device])
    randomize_(model, seed=0)
    out = {}
    for ctx in ctxs:
        state = model.new_state(ctx)
        fill_state(state, ctx - 1, seed=ctx)
        runner = DecodeRunner(model, state, use_graphs=not cpu)
        us = {}
        for key, pos in (("us1", ctx - 1), ("us2", ctx - 2)):
            for _ in range(2):
                runner.step(1, pos)
            us[key] = [wall_us(runner.layer_fn(i, pos), args.replays) if cpu else
                       median_us(runner.layer_fn(i, pos), args.replays, runner.devices[i])
                       for i in range(len(model.layers))]
        logits = []
        for pos in (ctx - 1, ctx - 2):
            fill_state(state, ctx - 1, seed=ctx)
            logits.append(runner.step(1, pos).float().cpu())
        torch.save(logits, f"{args.out}.{ctx}.pt")
        out[ctx] = us
        runner = None
    # the environment the variant ran with (what an --env-variant sets; each key the parent asked about)
    seen = {k: os.environ.get(k) for k in (args.report_env.split(",") if args.report_env else [])}
    print(json.dumps({"us": out, "env": seen, "tree": os.getcwd()}))
    return 0


def main(argv=None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=PATCH",
                   help="a variant: this checkout with PATCH applied (repeatable; 'head' always runs)")
    p.add_argument("--env-variant", action="append", default=[], metavar="NAME=K=V[,K=V...]",
                   help="a variant: head's copy run with these environment variables set (repeatable)")
    p.add_argument("--contexts", default="1024", help="comma list of contexts (default: 1024)")
    p.add_argument("--rounds", type=int, default=2, help="times each variant runs, alternated (default: 2)")
    p.add_argument("--layers", type=int, default=4, help="first N layers of Flash (default 4: SWA, SWA, CSA, HCA)")
    p.add_argument("--replays", type=int, default=100, help="back-to-back replays per timing (default: 100)")
    p.add_argument("--workdir", default=None, help="where the copies go (default: a new temporary directory)")
    p.add_argument("--device", default="cuda:0",
                   help="cuda:N, or cpu: eager steps of the reference ops timed by the wall clock, to check the tool "
                        "itself (default: cuda:0)")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny test model's layers (dsv4.writer.TINY_CONFIG, up to 4) instead of Flash's")
    p.add_argument("--json", metavar="F", help="write the results as JSON to F")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--report-env", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        try:
            ctxs = [int(c) for c in args.contexts.split(",")]
        except ValueError:
            raise ValueError(f"--contexts must be a comma list of integers, got {args.contexts!r}") from None
        if not ctxs or min(ctxs) < 2 or args.rounds < 1 or args.layers < 1 or args.replays < 1:
            raise ValueError("--contexts must be >= 2 and --rounds / --layers / --replays >= 1")
        if args.device != "cpu" and not args.device.startswith("cuda"):
            raise ValueError(f"--device must be cuda[:N] or cpu, got {args.device!r}")
        if args.device == "cpu" and not args.tiny:
            raise ValueError("--device cpu runs the tiny test model only: add --tiny (Flash's layers take minutes a "
                             "step there)")
        if args.layers > (4 if args.tiny else 43):
            raise ValueError(f"--layers: at most {4 if args.tiny else 43}")
        variants = [parse_variant(v) for v in args.variant]
        env_variants = [parse_env_variant(v) for v in args.env_variant]
        named = [n for n, _ in variants] + [n for n, _ in env_variants]
        if len(set(named)) != len(named):
            raise ValueError("--variant / --env-variant: each NAME once")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.worker:
        return worker(args)
    if args.workdir and (Path(args.workdir).resolve() == ROOT or Path(args.workdir).resolve() in ROOT.parents):
        print(f"error: --workdir {Path(args.workdir).resolve()} holds this checkout: name a folder of its own",
              file=sys.stderr)
        return 2
    if args.workdir and Path(args.workdir).exists() and not Path(args.workdir).is_dir():
        print(f"error: --workdir {args.workdir} is not a folder", file=sys.stderr)
        return 2

    import torch

    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("error: ab_trees needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    work = (Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dsv4_ab_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"variant copies in {work}", file=sys.stderr)
    names = ["head"] + [n for n, _ in variants] + [n for n, _ in env_variants]
    envs = dict(env_variants)
    keys = sorted({k for e in envs.values() for k in e})
    for k in keys:
        if k in os.environ:
            print(f"warning: {k} is set in this shell ({os.environ[k]!r}): head and the patch variants run with it too",
                  file=sys.stderr)
    trees = {}
    try:
        for name, patch in [("head", None)] + variants:
            trees[name] = work / name
            make_tree(ROOT, trees[name], patch)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name in envs:  # head's copy, its own environment
        trees[name] = trees["head"]
    for name in [n for n in names if n not in envs] if not cpu else []:
        # one build at a time: copies with the same kernel sources share a cache entry
        print(f"building {name} ...", file=sys.stderr, flush=True)
        r = subprocess.run([sys.executable, "-c", "from dsv4.kernels import cuda; import sys; "
                            "sys.exit(0 if cuda.load() is not None else 1)"], cwd=trees[name])
        if r.returncode:
            print(f"error: variant {name}: its CUDA kernels did not build", file=sys.stderr)
            return 1
    results: dict = {n: [] for n in names}
    seen_env: dict = {}
    seen_tree: dict = {}
    for rnd in range(args.rounds):
        for name in names:
            out = work / f"{name}.r{rnd}"
            r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "--contexts",
                                args.contexts, "--layers", str(args.layers), "--replays", str(args.replays), "--out",
                                str(out), "--device", args.device, "--report-env", ",".join(keys)]
                               + (["--tiny"] if args.tiny else []),
                               cwd=trees[name], capture_output=True, text=True, env={**os.environ, **envs.get(name, {})})
            if r.returncode:
                tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"error: variant {name}, round {rnd + 1}: {tail}", file=sys.stderr)
                return 1
            line = json.loads(r.stdout.strip().splitlines()[-1])
            got, seen_env[name], seen_tree[name] = line["us"], line["env"], line["tree"]
            for ctx in ctxs:
                mine = torch.load(f"{out}.{ctx}.pt")
                ref = torch.load(f"{work / 'head.r0'}.{ctx}.pt")
                pairs = list(zip(mine, ref))
                got[str(ctx)]["same"] = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in pairs)
                got[str(ctx)]["diff"] = max(float((a - b).abs().nan_to_num(float("inf")).max()) for a, b in pairs)
            results[name].append(got)
            print(f"{name} round {rnd + 1}: " + ", ".join(
                f"{c}: {sum(got[str(c)]['us1']):.1f} / {sum(got[str(c)]['us2']):.1f} us" for c in ctxs),
                file=sys.stderr, flush=True)
    lines, summary = summarize(results, names)
    for name, env in envs.items():
        lines.append(f"{name}: head's code with " + ", ".join(f"{k}={v}" for k, v in env.items()))
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": "cpu" if cpu else torch.cuda.get_device_name(0),
                                               "model": "tiny" if args.tiny else "flash", "layers": args.layers,
                                               "replays": args.replays, "results": results, "summary": summary,
                                               "env": seen_env, "tree": seen_tree}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
