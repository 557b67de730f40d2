"""The engine's step functions before and after a change: decode and prefill step times and the serving
process's peak resident memory, for two source trees, measured back to back on this machine.

    .venv/bin/python benchmarks/bench_engine_steps.py --before TREE --after TREE [--rounds 5] [--json OUT]

A TREE is a checkout of this project, e.g. the commit before a change: `git worktree add /tmp/before
<commit>`; `--after .` is the working tree. Each tree's own servingplan is imported in a fresh process
(PYTHONPATH=TREE), so the two run the same shapes through their own step functions
(servingplan.profile.kvpool, or servingplan.serving.kvpool in a tree from before the
package by stage) and KV pool, with GPT-2 small's random weights (config defaults), all
cores, and the allocator setting the engine runs under.

- Step times: decode at B = 1, 8 and 32 at contexts 128 and 512 (ragged like the profile's batches:
  servingplan.profile.measure.decode_lengths) and prefill of 128 and 512 tokens. Each round runs one
  process per tree, the order alternating (AB, BA, ...); a process times each shape `--repeats` times
  after a warm-up call and keeps the median. Per shape it prints both trees' medians over rounds, the
  after/before ratio taken round by round (median, min and max), and the run-to-run noise: the spread
  of the before tree's round values (max / min - 1). A shape is slower beyond the noise when its
  median ratio exceeds 1 + that spread.
- The machine's drift: every worker also times a float32 GEMM and a 256 MiB copy, the same work in
  both trees, before its shapes (and after them, kept in the JSON); the spread of the readings before
  the shapes over the run is printed.
- Memory: one process per tree and cap (1, 8, 32) serves the worst case: every slot holds a full
  context (`--context`, default config memory.max_context, 768) and one decode step runs over all of
  them. Its peak resident memory (VmHWM) is set against weights + cap x per-slot KV + the runtime
  overhead measured at cap 1 (peak at cap 1 minus weights and one slot's KV).

Exits 0 whatever it measures (the benchmark reports, it does not judge); 2 on bad input. Run it on a
quiet machine: the timings are only as steady as the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DECODE_SHAPES = [(batch, context) for batch in (1, 8, 32) for context in (128, 512)]
PREFILL_LENGTHS = (128, 512)
MEMORY_CAPS = (1, 8, 32)
DEFAULT_CONTEXT = 768
SEED = 0


# Where a tree keeps the step functions, the thread setting, the model loader and the profile's batch
# shapes: the package by stage (since 70ce2c8), or the flat package before it, so that a change can be
# measured across the move
LAYOUTS = {
    "servingplan/profile/kvpool.py": {"kvpool": "servingplan.profile.kvpool", "machine": "servingplan.profile.machine",
                                      "model": "servingplan.profile.model", "measure": "servingplan.profile.measure"},
    "servingplan/serving/kvpool.py": {"kvpool": "servingplan.serving.kvpool", "machine": "servingplan.profiling.machine",
                                      "model": "servingplan.profiling.model", "measure": "servingplan.profiling.measure"},
}


def tree_layout(tree: Path) -> dict | None:
    """The module names of `tree`'s layout (LAYOUTS), None where it holds neither."""
    return next((modules for marker, modules in LAYOUTS.items() if (tree / marker).is_file()), None)


# -- the worker: runs inside one tree's servingplan ------------------------------------------------
def _modules() -> dict:
    """This worker's tree's modules, by name (kvpool, machine, model, measure)."""
    import importlib

    import servingplan
    layout = tree_layout(Path(servingplan.__file__).resolve().parent.parent)
    return {name: importlib.import_module(module) for name, module in layout.items()}


def _load():
    import torch
    modules = _modules()
    modules["kvpool"].configure_allocator()
    modules["machine"].configure_threads(0)
    torch.manual_seed(SEED)
    return modules["model"].load_model("random", SEED)[0]


def _median_seconds(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def machine_reference(repeats: int) -> dict:
    """The same work in every worker whatever its tree: a float32 GEMM and a 256 MiB copy. Their spread
    across the workers is how far the machine's own speed moved during the benchmark."""
    import torch
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    source, target = torch.empty(2**26), torch.empty(2**26)
    return {"gemm_s": _median_seconds(lambda: a @ b, repeats),
            "copy_s": _median_seconds(lambda: target.copy_(source), repeats)}


def worker_steps(repeats: int) -> dict:
    import torch
    modules = _modules()
    KVPool, decode_step, prefill_step = (getattr(modules["kvpool"], name) for name in ("KVPool", "decode_step", "prefill_step"))
    decode_lengths = modules["measure"].decode_lengths
    model = _load()
    config = model.config
    generator = torch.Generator().manual_seed(SEED)
    longest = max(max(c for _, c in DECODE_SHAPES) + 1, max(PREFILL_LENGTHS))
    pool = KVPool(config, max(b for b, _ in DECODE_SHAPES), longest)
    for tensor in (pool.keys, pool.values):
        tensor.normal_(generator=generator)
    out = {"reference before": machine_reference(repeats)}
    for batch, context in DECODE_SHAPES:
        lengths = decode_lengths(batch, context)
        ids = torch.randint(config.vocab_size, (batch, 1), generator=generator)
        out[f"decode B{batch} ctx{context}"] = _median_seconds(lambda: decode_step(model, pool, lengths, ids),
                                                               repeats)
    for length in PREFILL_LENGTHS:
        ids = torch.randint(config.vocab_size, (1, length), generator=generator)
        out[f"prefill {length}"] = _median_seconds(lambda: prefill_step(model, pool, 0, ids, 0), repeats)
    out["reference after"] = machine_reference(repeats)
    return out


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker_memory(cap: int, context: int) -> dict:
    import torch
    modules = _modules()
    KVPool, decode_step, prefill_step = (getattr(modules["kvpool"], name) for name in ("KVPool", "decode_step", "prefill_step"))
    model = _load()
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # the last token of a full context is generated, never fed back: context - 1 entries are stored
    pool = KVPool(config, cap, context - 1)
    prompt = torch.randint(config.vocab_size, (1, context - 2), generator=torch.Generator().manual_seed(SEED))
    prefill_step(model, pool, 0, prompt, 0)
    for slot in range(1, cap):   # the same entries in every slot: the memory of cap prefills, in one
        pool.keys[:, slot].copy_(pool.keys[:, 0])
        pool.values[:, slot].copy_(pool.values[:, 0])
    decode_step(model, pool, torch.full((cap,), context - 2), torch.zeros(cap, 1, dtype=torch.long))
    slot_kv = 2 * config.n_layer * config.n_embd * 4 * context
    return {"peak_rss_bytes": _vm_hwm_bytes(), "weights_bytes": weights, "slot_kv_bytes": slot_kv}


# -- the driver ------------------------------------------------------------------------------------
def run_worker(tree: Path, args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", *args], env=env,
                          cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench_engine_steps: the worker in {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(reply["source"]).resolve().is_relative_to(tree):
        raise SystemExit(f"bench_engine_steps: the worker for {tree} imported servingplan from {reply['source']}")
    return reply["result"]


def machine_drift(rounds: dict[str, list[dict]]) -> dict:
    """max / min - 1 of each machine reference over the workers' readings before their shapes. The readings
    after the shapes are kept in the JSON but not counted: they also carry the state the tree's own steps
    left in the process (the copying tree's heap made the same 256 MiB copy 25% slower there), which is
    not the machine's speed."""
    readings = [worker["reference before"] for workers in rounds.values() for worker in workers]
    return {kind: max(r[kind] for r in readings) / min(r[kind] for r in readings) - 1 for kind in ("gemm_s", "copy_s")}


def step_table(before: list[dict], after: list[dict]) -> list[dict]:
    rows = []
    for shape in (name for name in before[0] if not name.startswith("reference")):
        b = [r[shape] for r in before]
        a = [r[shape] for r in after]
        ratios = [x / y for x, y in zip(a, b)]
        noise = max(b) / min(b) - 1
        median_ratio = statistics.median(ratios)
        rows.append({"shape": shape, "before_ms": 1e3 * statistics.median(b), "after_ms": 1e3 * statistics.median(a),
                     "ratio_median": median_ratio, "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "speedup": 1 / median_ratio, "noise": noise, "slower_beyond_noise": median_ratio > 1 + noise})
    return rows


def memory_table(by_tree: dict[str, dict[int, dict]]) -> list[dict]:
    rows = []
    for tree, caps in by_tree.items():
        one = caps[min(caps)]
        overhead = one["peak_rss_bytes"] - one["weights_bytes"] - one["slot_kv_bytes"]
        for cap, reading in sorted(caps.items()):
            arithmetic = reading["weights_bytes"] + cap * reading["slot_kv_bytes"]
            expected = arithmetic + overhead
            rows.append({"tree": tree, "cap": cap, "peak_rss_gb": reading["peak_rss_bytes"] / 1e9,
                         "weights_plus_kv_gb": arithmetic / 1e9, "runtime_at_cap1_gb": overhead / 1e9,
                         "expected_gb": expected / 1e9,
                         "error_vs_expected": reading["peak_rss_bytes"] / expected - 1})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path)
    parser.add_argument("--after", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, *rest = args.worker
        result = (worker_steps(int(rest[0])) if kind == "steps"
                  else worker_memory(int(rest[0]), int(rest[1])))
        import servingplan
        print(json.dumps({"source": servingplan.__file__, "result": result}))
        return 0
    for name in ("before", "after"):
        tree = getattr(args, name)
        if tree is None or tree_layout(tree) is None:
            print(f"bench_engine_steps: --{name} {tree}: must be a checkout of this project "
                  f"(holding {' or '.join(LAYOUTS)})", file=sys.stderr)
            return 2
    if not 2 <= args.rounds <= 50 or not 1 <= args.repeats <= 50 or not 16 <= args.context <= 1024:
        print(f"bench_engine_steps: --rounds {args.rounds} --repeats {args.repeats} --context {args.context}: "
              "rounds 2-50, repeats 1-50, context 16-1024 (GPT-2's positions)", file=sys.stderr)
        return 2
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    started = time.time()
    rounds = {"before": [], "after": []}
    for index in range(args.rounds):
        order = ("before", "after") if index % 2 == 0 else ("after", "before")
        for name in order:
            rounds[name].append(run_worker(trees[name], ["steps", str(args.repeats)]))
        print(f"round {index + 1}/{args.rounds} done ({time.time() - started:.0f} s)", file=sys.stderr)
    memory = {name: {} for name in trees}
    for cap in MEMORY_CAPS:
        for name in trees:
            memory[name][cap] = run_worker(trees[name], ["memory", str(cap), str(args.context)])
    steps, mem, drift = step_table(rounds["before"], rounds["after"]), memory_table(memory), machine_drift(rounds)
    print(f"Engine steps, before = {trees['before']}, after = {trees['after']}; {args.rounds} rounds x "
          f"{args.repeats} calls per shape, {time.time() - started:.0f} s in all, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"The machine's own speed moved {100 * drift['gemm_s']:.1f}% (a float32 GEMM) and "
          f"{100 * drift['copy_s']:.1f}% (a 256 MiB copy) across the workers' readings")
    print("| shape | before ms | after ms | after/before (median, min-max) | speed-up | noise | slower beyond noise |")
    print("|---|---|---|---|---|---|---|")
    for r in steps:
        print(f"| {r['shape']} | {r['before_ms']:.1f} | {r['after_ms']:.1f} | {r['ratio_median']:.3f} "
              f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | {r['speedup']:.2f}x | {100 * r['noise']:.1f}% | "
              f"{'yes' if r['slower_beyond_noise'] else 'no'} |")
    print(f"\nPeak resident memory at a full context of {args.context} tokens per slot")
    print("| tree | cap | peak RSS GB | weights + cap x slot KV GB | runtime at cap 1 GB | expected GB | error |")
    print("|---|---|---|---|---|---|---|")
    for r in mem:
        print(f"| {r['tree']} | {r['cap']} | {r['peak_rss_gb']:.3f} | {r['weights_plus_kv_gb']:.3f} | "
              f"{r['runtime_at_cap1_gb']:.3f} | {r['expected_gb']:.3f} | {100 * r['error_vs_expected']:+.1f}% |")
    if args.json:
        args.json.write_text(json.dumps({"steps": steps, "memory": mem, "machine_drift": drift, "rounds": rounds},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
