"""The llama.cpp profiler: llama-batched-bench's output read back (canned output, every way it can be
wrong), and a whole profile through a stand-in tool whose step times follow a known cost model, fitted by
the torch profile's own fit. Runs everywhere: no build needed."""
import json
import re
import sys
import textwrap

import pandas as pd
import pytest

from servingplan.fit.step_model import fit_profile
from servingplan.llamacpp.profile import BenchError, bench_command, call_seconds, parse_bench_output, run_llamacpp_profile
from servingplan.profile.measure import GridPoint

# what the pinned llama-batched-bench prints with --output-format jsonl (batched-bench.cpp): its log on
# stderr, one JSON object a line on stdout, then llama_perf's summary
ROW = ('{{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": {pps}, '
       '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": {pp}, "tg": {tg}, "pl": {pl}, '
       '"n_kv": {n_kv}, "t_pp": {t_pp:f}, "speed_pp": 500.0, "t_tg": {t_tg:f}, "speed_tg": 40.0, "t": 1.0, '
       '"speed": 100.0}}')
PREFILL = GridPoint("prefill", 1, 128, 0)
DECODE = GridPoint("decode", 4, 1, 256)


def prefill_output(times, pp=128):
    return "\n".join(["", *(ROW.format(pps=0, pp=pp, tg=1, pl=1, n_kv=pp + 1, t_pp=t, t_tg=0.02) for t in times),
                      "", "llama_perf_context_print:        load time =     120.00 ms"])


def test_a_prefill_run_gives_one_call_per_row_after_the_warmup_rows():
    rows = parse_bench_output(prefill_output([0.5, 0.25, 0.26, 0.27]), PREFILL, 4)
    assert call_seconds(rows, PREFILL, warmup=1) == [0.25, 0.26, 0.27]


def test_a_decode_run_gives_one_step_its_steps_mean():
    text = ROW.format(pps=1, pp=256, tg=4, pl=4, n_kv=1040, t_pp=0.5, t_tg=0.2)
    assert call_seconds(parse_bench_output(text, DECODE, 1), DECODE, warmup=1) == pytest.approx([0.05])


@pytest.mark.parametrize("text, rows, says", [
    (prefill_output([0.25, 0.26]), 3, "2 result rows, expected 3"),
    ("", 1, "0 result rows, expected 1"),
    (prefill_output([0.25]).replace("0.250000", "nan"), 1, "is not JSON"),
    (prefill_output([0.25]).replace('"t_pp": 0.250000', '"t_pp": "0.25"'), 1, "t_pp = '0.25', must be a finite number"),
    (prefill_output([0.25]).replace('"t_tg"', '"t_tg_missing"'), 1, "t_tg = None"),
    (prefill_output([0.0]), 1, "t_pp = 0.0, must be > 0"),
    (prefill_output([0.25], pp=64), 1, "a result row has pp=64 pl=1, expected pp=128 pl=1"),
    ("[1, 2]\n{not json", 1, "is not JSON"),
])
def test_bad_tool_output_is_one_clear_line(text, rows, says):
    with pytest.raises(BenchError) as refused:
        parse_bench_output(text, PREFILL, rows)
    message = str(refused.value)
    assert says in message and len(message.splitlines()) == 1
    assert message.startswith("llama-batched-bench at prefill B=1 L=128 cached=0")


def test_the_commands_time_what_llama_server_runs():
    settings = {"threads": 2, "n_batch": 2048, "n_ubatch": 512}
    prefill = bench_command(PREFILL, 4, settings, "m.gguf", "bench")
    decode = bench_command(DECODE, 4, settings, "m.gguf", "bench")
    for command in (prefill, decode):
        assert command[command.index("-ub") + 1] == "512" and command[command.index("-ctk") + 1] == "f32"
        assert "-kvu" not in command                  # each decoding sequence reads its own cached tokens
    assert prefill[prefill.index("-npp") + 1] == "128,128,128,128" and prefill[prefill.index("-npl") + 1] == "1"
    assert "-pps" in decode and decode[decode.index("-npl") + 1] == "4" and decode[decode.index("-ntg") + 1] == "4"
    # a chunk after cached tokens: prompts of the cached tokens and of one chunk more, decoded in chunks
    chunk = bench_command(GridPoint("prefill_cached", 1, 64, 128), 2, settings, "m.gguf", "bench")
    assert chunk[chunk.index("-npp") + 1] == "128,192,128,192" and chunk[chunk.index("-npl") + 1] == "1"
    assert chunk[chunk.index("-b") + 1] == "64" and chunk[chunk.index("-ub") + 1] == "64"
    assert chunk[chunk.index("-c") + 1] == str(192 + 1 + 256)
    wide = bench_command(GridPoint("prefill_cached", 1, 1024, 1024), 1, settings, "m.gguf", "bench")
    assert wide[wide.index("-b") + 1] == "1024" and wide[wide.index("-ub") + 1] == "512"
    for cached in (0, 32, 96):
        with pytest.raises(ValueError, match=f"after {cached} cached: the cached tokens must be a positive whole "
                                             f"number of chunks"):
            bench_command(GridPoint("prefill_cached", 1, 64, cached), 1, settings, "m.gguf", "bench")


CHUNK = GridPoint("prefill_cached", 1, 64, 128)


def pair_output(pairs):
    return "\n".join(ROW.format(pps=0, pp=pp, tg=1, pl=1, n_kv=pp + 1, t_pp=t, t_tg=0.02)
                     for shorter, longer in pairs for pp, t in ((128, shorter), (192, longer)))


def test_a_chunk_after_cached_tokens_is_each_pairs_difference_after_the_warmup_pairs():
    rows = parse_bench_output(pair_output([(0.5, 0.9), (0.3, 0.45), (0.31, 0.47), (0.29, 0.44)]), CHUNK, 8)
    assert call_seconds(rows, CHUNK, warmup=1) == pytest.approx([0.15, 0.16, 0.15])
    with pytest.raises(BenchError, match="a result row has pp=128 pl=1, expected pp=192 pl=1"):
        parse_bench_output(pair_output([(0.3, 0.45)]).replace('"pp": 192', '"pp": 128'), CHUNK, 2)
    from servingplan.llamacpp.profile import UnorderedPair
    with pytest.raises(UnorderedPair, match="a prompt of 192 tokens took no longer than one of 128"):
        call_seconds(parse_bench_output(pair_output([(0.3, 0.45), (0.5, 0.45)]), CHUNK, 4), CHUNK, warmup=1)
    # a warm-up pair out of order is dropped like any warm-up
    assert call_seconds(parse_bench_output(pair_output([(0.5, 0.45), (0.3, 0.45)]), CHUNK, 4), CHUNK,
                        warmup=1) == pytest.approx([0.15])


# a stand-in llama-batched-bench: a prefill call of L tokens after P cached takes P0 + P1 L + P3 L P, and a
# prompt is decoded in calls of -b tokens, as the tool does; a decode step of B sequences of context T takes
# A + B_ B + C B T; it prints the rows the real tool prints for the arguments it gets
P0, P1, P3, A, B_, C = 0.004, 2e-4, 2e-6, 0.01, 0.002, 1e-6
FAKE = textwrap.dedent(f"""\
    #!{sys.executable}
    import json, sys
    args = sys.argv[1:]
    def values(flag):
        return [int(v) for v in args[args.index(flag) + 1].split(",")]
    assert "--output-format" in args and "-m" in args
    print("llama_model_loader: (the tool's log)", file=sys.stderr)
    n_batch = values("-b")[0]
    for pp in values("-npp"):
        for tg in values("-ntg"):
            for pl in values("-npl"):
                t_pp = sum({P0} + {P1} * min(n_batch, pp - done) + {P3} * min(n_batch, pp - done) * done
                           for done in range(0, pp, n_batch))
                t_tg = tg * ({A} + {B_} * pl + {C} * pl * pp)
                print(json.dumps({{"pp": pp, "tg": tg, "pl": pl, "t_pp": t_pp, "t_tg": t_tg}}))
    """)


def test_a_profile_through_the_tool_fits_the_cost_model_it_follows(tmp_path):
    fake = tmp_path / "llama-batched-bench"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    settings = {"warmup": 1, "rounds": 2, "repeats": 2, "reference_interval_s": 0.0, "reference_decode": [2, 64],
                "reference_prefill": 32, "prefill_lengths": [16, 32, 64, 128], "prefill_batches": [1, 2],
                "decode_batches": [1, 2, 4, 8], "decode_contexts": [16, 64, 256], "probe_bytes": 1 << 20,
                "gemm_size": 64, "cached_prefill": [(16, 32), (32, 32), (16, 64), (32, 64)]}
    profile = run_llamacpp_profile(gguf, settings, {"threads": 1, "n_batch": 256, "n_ubatch": 128}, seed=0,
                                   tiny=True, progress=False, binary=fake)
    points, samples, meta = profile.points, profile.samples, profile.meta
    assert set(points["kind"]) == {"prefill", "prefill_cached", "decode"} and len(points) == 4 + 4 + 4 * 3
    assert meta["engine"] == "llamacpp" and meta["settings"]["ctx_mode"] == "padded_max"
    assert meta["speed"]["trace"] and set(samples.groupby("point_id")["round"].nunique()) == {2}
    decode = points[points["kind"] == "decode"]
    # the stand-in's step times come back exactly (a decode call is one of its R steps)
    assert decode["median_s"].to_numpy() == pytest.approx(
        (A + B_ * decode["batch"] + C * decode["batch"] * decode["cached"]).to_numpy(), rel=1e-9)
    fit = fit_profile(points, samples, json.loads(json.dumps(meta, default=str)), 0.25, 0.05, 0)
    model = fit.cost_model
    assert model.ctx_mode == "padded_max" and model.name.startswith("measured-llamacpp-")
    assert model.prefill_time(100) == pytest.approx(P0 + P1 * 100, rel=1e-3)
    # the chunks after cached tokens, each a pair's difference, inform the cached-token term
    cached = points[points["kind"] == "prefill_cached"]
    assert cached["median_s"].to_numpy() == pytest.approx(
        (P0 + P1 * cached["prompt_len"] + P3 * cached["prompt_len"] * cached["cached"]).to_numpy(), rel=1e-6)
    assert model.prefill_time(32, 64) == pytest.approx(P0 + P1 * 32 + P3 * 32 * 64, rel=1e-3)
    assert meta["settings"]["cached_prefill"] == [[16, 32], [32, 32], [16, 64], [32, 64]]
    assert model.decode_time(6, 6 * 200.0, 200.0) == pytest.approx(A + B_ * 6 + C * 6 * 200, rel=1e-3)


def test_a_tool_that_fails_is_one_clear_line(tmp_path):
    fake = tmp_path / "llama-batched-bench"
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint('error: unable to load model', file=sys.stderr)\nsys.exit(1)\n")
    fake.chmod(0o755)
    from servingplan.llamacpp.profile import run_bench
    with pytest.raises(BenchError, match=r"^llama-batched-bench exited with 1 at prefill B=1 L=128 cached=0: "
                                         r"error: unable to load model$"):
        run_bench(PREFILL, {"threads": 1, "n_batch": 256, "n_ubatch": 128, "warmup": 1, "repeats": 1},
                  tmp_path / "m.gguf", fake)


@pytest.mark.parametrize("lost_runs, ok", [(2, True), (7, True), (8, False)])
def test_a_run_whose_rows_the_tools_logger_lost_is_run_again_at_most_eight_times(tmp_path, lost_runs, ok,
                                                                                  monkeypatch):
    """llama.cpp's asynchronous logger can lose the tool's last lines at exit: such a run is run again."""
    from servingplan.llamacpp import profile
    from servingplan.llamacpp.profile import BENCH_ATTEMPTS, MissingRows, run_bench
    assert BENCH_ATTEMPTS == 8
    pauses = []
    monkeypatch.setattr(profile, "pause_before_rerun", pauses.append)
    runs = tmp_path / "runs"
    fake = tmp_path / "llama-batched-bench"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        from pathlib import Path
        runs = Path({str(runs)!r})
        runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
        if len(runs.read_text()) > {lost_runs}:
            print({ROW.format(pps=0, pp=128, tg=1, pl=1, n_kv=129, t_pp=0.25, t_tg=0.02)!r})
        """))
    fake.chmod(0o755)
    settings = {"threads": 1, "n_batch": 256, "n_ubatch": 128, "warmup": 0, "repeats": 1}
    if ok:
        assert run_bench(PREFILL, settings, tmp_path / "m.gguf", fake) == [0.25]
    else:
        with pytest.raises(MissingRows, match="0 result rows, expected 1"):
            run_bench(PREFILL, settings, tmp_path / "m.gguf", fake)
    assert len(runs.read_text()) == min(lost_runs + 1, BENCH_ATTEMPTS)
    # each rerun waits longer than the one before, so a spell of losses on a busy machine can pass
    assert pauses == list(range(1, min(lost_runs + 1, BENCH_ATTEMPTS)))


def test_a_run_with_a_pair_out_of_order_is_run_again(tmp_path, monkeypatch):
    """A machine stall during a pair's shorter prompt can leave it no shorter than the longer: run again."""
    from servingplan.llamacpp import profile
    from servingplan.llamacpp.profile import run_bench
    monkeypatch.setattr(profile, "pause_before_rerun", lambda attempt: None)
    runs = tmp_path / "runs"
    fake = tmp_path / "llama-batched-bench"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        from pathlib import Path
        runs = Path({str(runs)!r})
        runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
        print({pair_output([(0.3, 0.45), (0.6, 0.46)])!r} if len(runs.read_text()) == 1 else {pair_output([(0.3, 0.45), (0.3, 0.46)])!r})
        """))
    fake.chmod(0o755)
    settings = {"threads": 1, "n_batch": 256, "n_ubatch": 128, "warmup": 1, "repeats": 1}
    assert run_bench(CHUNK, settings, tmp_path / "m.gguf", fake) == pytest.approx([0.16])
    assert runs.read_text() == "xx"


@pytest.mark.parametrize("cached_prefill, says", [
    ([(16, 24)], "a chunk of 16 tokens after 24 cached: the cached tokens must be a positive whole number of chunks"),
    ([(128, 256)], "a chunk after cached tokens spans 384 positions, the model has 256"),
])
def test_a_chunk_the_tool_cannot_time_is_refused_before_anything_is_timed(tmp_path, cached_prefill, says):
    fake = tmp_path / "llama-batched-bench"
    fake.write_text(f"#!{sys.executable}\nraise SystemExit('timed')\n")
    fake.chmod(0o755)
    settings = {"warmup": 1, "rounds": 1, "repeats": 1, "reference_interval_s": 0.0, "reference_decode": [2, 16],
                "reference_prefill": 16, "prefill_lengths": [16], "prefill_batches": [1], "decode_batches": [1],
                "decode_contexts": [16], "probe_bytes": 1 << 20, "gemm_size": 64, "cached_prefill": cached_prefill}
    with pytest.raises(ValueError, match=f"^llama.cpp profile: {re.escape(says)}$"):
        run_llamacpp_profile(tmp_path / "m.gguf", settings, {"threads": 1, "n_batch": 256, "n_ubatch": 128}, seed=0,
                             tiny=True, progress=False, binary=fake)
