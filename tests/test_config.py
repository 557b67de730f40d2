import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from servingplan.config import ConfigError, check, load

ROOT = Path(__file__).resolve().parent.parent
BASE = yaml.safe_load((ROOT / "config.yaml").read_text())


def mutated(change):
    config = copy.deepcopy(BASE)
    change(config)
    return config


def test_shipped_configs_are_valid():
    load(ROOT / "config.yaml")
    load(ROOT / "config" / "quick.yaml")


@pytest.mark.parametrize("change, expected", [
    (lambda c: c["sweep"]["caps"].__setitem__(1, 0), "config error: sweep.caps[1] = 0: must be >= 1"),
    (lambda c: c["sweep"].__setitem__("policies", ["fifo"]),
     "config error: sweep.policies[0] = 'fifo': allowed: static, continuous, continuous_chunked, llamacpp"),
    (lambda c: c["cost"].__setitem__("price_per_hour", "cheap"),
     "config error: cost.price_per_hour = 'cheap': must be of type number"),
    (lambda c: c["cost"].pop("price_per_hour"), "config error: cost.price_per_hour is missing (required)"),
    (lambda c: c["memory"].__setitem__("budget_gib", 2), "config error: memory.budget_gib is not a known key"),
    (lambda c: c["memory"].__setitem__("kv_memory", "pooled"),
     "config error: memory.kv_memory = 'pooled': allowed: paged, slots"),
    (lambda c: c["hardware"][1].__setitem__("kv_memory", "vllm"),
     "config error: hardware[1].kv_memory = 'vllm': allowed: paged, slots"),
    (lambda c: c["workload"].__setitem__("rate", 0), "config error: workload.rate = 0: must be > 0"),
    (lambda c: c["workload"]["output"].__setitem__("mean", 300),
     "config error: workload.output.mean = 300: must lie strictly between min (8) and max (256)"),
    (lambda c: c["workload"]["prompt"].__setitem__("min", 600),
     "config error: workload.prompt.min = 600: must be <= workload.prompt.max (512)"),
    (lambda c: c["capacity"].__setitem__("rate_min", 100), "config error: capacity.rate_min = 100: must be <"),
    (lambda c: c["memory"].__setitem__("max_context", 512), "config error: memory.max_context = 512: must cover"),
    (lambda c: c["model"].__setitem__("source", "/no/such/checkpoint"), "config error: model.source = '/no/such"),
    (lambda c: c["model"].update(tiny=True, source="/models/gpt2"),
     "config error: model.tiny = true with model.source = '/models/gpt2': the tiny model is a random 2-layer "
     "GPT-2, so model.source must be 'random'"),
])
def test_bad_values_name_key_value_and_what_is_allowed(change, expected):
    with pytest.raises(ConfigError) as err:
        check(mutated(change))
    message = str(err.value)
    assert message.startswith(expected)
    assert "\n" not in message


def test_cli_check_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(mutated(lambda c: c["sweep"].__setitem__("seeds", -1))))
    proc = subprocess.run([sys.executable, "-m", "servingplan.config", str(bad)], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "config error: sweep.seeds = -1: must be >= 1"


@pytest.mark.parametrize("change, expected", [
    (lambda c: c["sweep"].__setitem__("chunk_budget", "all_tokens"),
     "config error: sweep.chunk_budget = 'all_tokens': allowed: prompt_tokens, step_tokens"),
    (lambda c: c["sweep"].update(chunk_budget="step_tokens", chunk_sizes=[16, 512]),
     "config error: sweep.chunk_sizes = [16, 512]: with sweep.chunk_budget step_tokens every chunk must be >= the "
     "largest cap (sweep.caps: 32)"),
    (lambda c: c["sweep"].update(chunk_budget="step_tokens", caps=[1, 2], chunk_size=3, chunk_sizes=[64]),
     "config error: sweep.chunk_size = 3: with sweep.chunk_budget step_tokens every chunk must be >= the largest "
     "cap (validation.cap: 8)"),
])
def test_a_step_token_budget_must_leave_room_beside_the_decodes(change, expected):
    with pytest.raises(ConfigError) as err:
        check(mutated(change))
    assert str(err.value).startswith(expected)


def test_chunk_budget_is_optional_and_step_tokens_with_room_is_valid():
    check(mutated(lambda c: c["sweep"].pop("chunk_budget")))
    check(mutated(lambda c: c["sweep"].update(chunk_budget="step_tokens", chunk_sizes=[32, 512])))


def test_a_cost_model_file_is_checked_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the path is read from the directory snakemake runs in
    good = {"schema_version": 1, "name": "elsewhere", "decode": {"fixed_s": 0.01, "per_seq_s": 0.0,
            "per_ctx_token_s": 0.0}, "prefill": {"fixed_s": 0.0, "per_token_s": 1e-5}}
    Path("model.json").write_text(json.dumps(good))
    imported = lambda c: c.update(costmodel={"source": "model.json"}, hardware=[])  # noqa: E731
    check(mutated(imported))
    with pytest.raises(ConfigError) as err:
        check(mutated(lambda c: c.__setitem__("costmodel", {"source": "model.json"})))
    assert str(err.value).startswith("config error: hardware = [2 targets]: needs costmodel.source 'profile' "
                                     "(here 'model.json')")

    for text, expected in [
        (None, "config error: costmodel.source = 'missing.json': no such file (from "),
        ("{not json", "config error: costmodel.source = 'bad.json': not a JSON document (Expecting property name"),
        (json.dumps({**good, "prefill": {"fixed_s": 0.0, "per_token_s": -1}}),
         "config error: costmodel.source = 'bad.json': cost model prefill.per_token_s = -1: must be a finite number"),
    ]:
        name = "missing.json" if text is None else "bad.json"
        if text is not None:
            Path(name).write_text(text)
        with pytest.raises(ConfigError) as err:
            check(mutated(lambda c: c.update(costmodel={"source": name}, hardware=[])))
        assert str(err.value).startswith(expected)
        assert "\n" not in str(err.value)


def test_cpu_is_the_default_device_and_cuda_is_refused_without_a_gpu():
    check(mutated(lambda c: c["model"].pop("device")))
    check(mutated(lambda c: c["model"].__setitem__("device", "cpu")))
    with pytest.raises(ConfigError) as err:
        check(mutated(lambda c: c["model"].__setitem__("device", "tpu")))
    assert str(err.value) == "config error: model.device = 'tpu': allowed: cpu, cuda"
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: cuda is allowed")
    with pytest.raises(ConfigError) as err:
        check(mutated(lambda c: c["model"].__setitem__("device", "cuda")))
    assert str(err.value) == ("config error: model.device = 'cuda': torch sees no CUDA GPU on this machine "
                              "(torch.cuda.is_available() is False); use 'cpu'")


def test_the_shipped_configs_raise_no_warning():
    assert check(copy.deepcopy(BASE)) == []
    assert check(yaml.safe_load((ROOT / "config" / "quick.yaml").read_text())) == []


def test_a_validation_cap_beyond_the_memory_budget_is_warned_about_in_one_line():
    # GPT-2 small: 0.498 GB of weights and 56.6 MB of KV per 768-token sequence: 0.97 GB holds 8 sequences
    config = mutated(lambda c: c["memory"].update(budget_gb=0.97))
    config["validation"]["cap"] = 9
    [warning] = check(config)
    assert warning.startswith("config warning: validation.cap = 9: memory.budget_gb = 0.97 reserves "
                              "memory.max_context for only 8 sequences")
    config["validation"]["cap"] = 8
    assert check(config) == []


def write_trace(path: Path, seconds_apart: float, prompt: int = 100, reply: int = 50) -> Path:
    path.write_text("arrival_s,prompt_tokens,output_tokens\n"
                    + "".join(f"{i * seconds_apart},{prompt},{reply}\n" for i in range(21)))
    return path


def with_trace(trace: dict) -> dict:
    return mutated(lambda c: c["workload"].__setitem__("trace", trace))


def test_a_trace_rate_other_than_the_workload_rate_is_refused(tmp_path):
    path = str(write_trace(tmp_path / "t.csv", 0.5))
    with pytest.raises(ConfigError) as err:
        check(with_trace({"path": path, "rate": 3.0}))
    assert str(err.value) == ("config error: workload.trace.rate = 3.0: the pipeline replays the trace at "
                              "workload.rate (6.0) as today's load, so it must equal that or be left out")
    assert check(with_trace({"path": path, "rate": 6.0})) == []


def test_a_trace_whose_own_rate_differs_from_the_workload_rate_is_warned_about(tmp_path):
    # 21 requests over 10 s: 2.1 req/s, replayed at workload.rate 6
    path = str(write_trace(tmp_path / "slow.csv", 0.5))
    assert check(with_trace({"path": path})) == [
        f"config warning: workload.trace.path = '{path}' arrives at 2.1 req/s on average; the pipeline replays it "
        "at workload.rate (6 req/s) as today's load"]
    at_six = str(write_trace(tmp_path / "six.csv", 21 / 6 / 20))
    assert check(with_trace({"path": at_six})) == []


def test_a_trace_request_longer_than_the_max_context_is_refused(tmp_path):
    path = str(write_trace(tmp_path / "long.csv", 1 / 6, prompt=700, reply=69))
    with pytest.raises(ConfigError) as err:
        check(with_trace({"path": path}))
    assert str(err.value) == (f"config error: workload.trace.path = '{path}': trace {path}: 21 of 21 requests need "
                              "more than 768 tokens (prompt + reply; the longest 769); set too_long to skip or clip "
                              "them")


def test_the_cli_check_prints_warnings_and_passes(tmp_path):
    config = with_trace({"path": str(write_trace(tmp_path / "slow.csv", 0.5))})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "servingplan.config", str(tmp_path / "c.yaml")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout == "config ok\n"
    assert proc.stderr.startswith("config warning: workload.trace.path =") and len(proc.stderr.splitlines()) == 1


# engine: llamacpp and its section (config/llamacpp.yaml): every key's bounds and each cross-field rule
LLAMACPP = {**copy.deepcopy(BASE), **yaml.safe_load((ROOT / "config" / "llamacpp.yaml").read_text())}


def llamacpp_with(change):
    config = copy.deepcopy(LLAMACPP)
    change(config)
    return config


def test_the_llamacpp_overlay_is_valid():
    assert check(copy.deepcopy(LLAMACPP)) == []


@pytest.mark.parametrize("change, expected", [
    (lambda c: c.__setitem__("engine", "vllm"), "config error: engine = 'vllm': allowed: torch, llamacpp"),
    (lambda c: c["llamacpp"].__setitem__("threads", -1), "config error: llamacpp.threads = -1: must be >= 0"),
    (lambda c: c["llamacpp"].__setitem__("threads", 1024), "config error: llamacpp.threads = 1024: must be at most"),
    (lambda c: c["llamacpp"].__setitem__("n_batch", float("nan")), "config error: llamacpp.n_batch = nan: must be a finite"),
    (lambda c: c["llamacpp"].__setitem__("n_batch", 2048.0), "config error: llamacpp.n_batch = 2048.0: must be of type integer"),
    (lambda c: c["llamacpp"].__setitem__("n_ubatch", 0), "config error: llamacpp.n_ubatch = 0: must be >= 1"),
    (lambda c: c["llamacpp"].__setitem__("n_ubatch", 4096), "config error: llamacpp.n_ubatch = 4096: must be <= llamacpp.n_batch"),
    (lambda c: c["llamacpp"].update(n_batch=256, n_ubatch=256),
     "config error: llamacpp.n_batch = 256: must be >= the longest profiled prompt (512"),
    (lambda c: c["llamacpp"].__setitem__("split_n_batch", 70000), "config error: llamacpp.split_n_batch = 70000: must be <= 65536"),
    (lambda c: c["llamacpp"].__setitem__("split_n_batch", 8), "config error: llamacpp.split_n_batch = 8: must exceed validation.cap (8)"),
    (lambda c: c["llamacpp"].__setitem__("split_n_batch", 600), "config error: llamacpp.split_n_batch = 600: must exceed"),
    (lambda c: c["llamacpp"].pop("split_n_batch"), "config error: llamacpp.split_n_batch is missing (required)"),
    (lambda c: c["llamacpp"].__setitem__("nbatch", 1), "config error: llamacpp.nbatch is not a known key"),
    (lambda c: c.pop("llamacpp"), "config error: llamacpp is missing (required with engine: llamacpp)"),
    (lambda c: c.__setitem__("engine", "torch"), "config error: llamacpp = {...}: read only with engine: llamacpp"),
    (lambda c: c["model"].__setitem__("device", "cuda"), "config error: engine = 'llamacpp' with model.device = 'cuda'"),
    (lambda c: c["costmodel"].__setitem__("source", "config.yaml"), "config error: costmodel.source = 'config.yaml'"),
])
def test_llamacpp_settings_are_refused_in_one_line(change, expected):
    with pytest.raises(ConfigError) as refused:
        check(llamacpp_with(change))
    assert str(refused.value).startswith(expected), str(refused.value)
    assert len(str(refused.value).splitlines()) == 1


def test_each_machine_names_how_its_engine_holds_kv():
    from servingplan.plan.hardware import kv_memory_of, memory_for
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    # this machine: the project's slot engine; a GPU target: vLLM's paged pool; a CPU target: llama.cpp's slots
    assert kv_memory_of(config, "here") == {"model": "slots", "basis": "default_this_engine"}
    assert kv_memory_of(config, "nvidia-t4") == {"model": "paged", "basis": "default_gpu"}
    assert kv_memory_of(config, "laptop-ryzen7-7840u") == {"model": "slots", "basis": "default_cpu"}
    config["hardware"][1]["kv_memory"] = "slots"
    config["memory"]["kv_memory"] = "paged"
    assert kv_memory_of(config, "nvidia-t4") == {"model": "slots", "basis": "configured"}
    assert memory_for(config, "here")["kv_memory"] == "paged"
