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
     "config error: sweep.policies[0] = 'fifo': allowed: static, continuous, continuous_chunked"),
    (lambda c: c["cost"].__setitem__("price_per_hour", "cheap"),
     "config error: cost.price_per_hour = 'cheap': must be of type number"),
    (lambda c: c["cost"].pop("price_per_hour"), "config error: cost.price_per_hour is missing (required)"),
    (lambda c: c["memory"].__setitem__("budget_gib", 2), "config error: memory.budget_gib is not a known key"),
    (lambda c: c["workload"].__setitem__("rate", 0), "config error: workload.rate = 0: must be > 0"),
    (lambda c: c["workload"]["output"].__setitem__("mean", 300),
     "config error: workload.output.mean = 300: must lie strictly between min (8) and max (256)"),
    (lambda c: c["workload"]["prompt"].__setitem__("min", 600),
     "config error: workload.prompt.min = 600: must be <= workload.prompt.max (512)"),
    (lambda c: c["capacity"].__setitem__("rate_min", 100), "config error: capacity.rate_min = 100: must be <"),
    (lambda c: c["memory"].__setitem__("max_context", 512), "config error: memory.max_context = 512: must cover"),
    (lambda c: c["model"].__setitem__("source", "/no/such/checkpoint"), "config error: model.source = '/no/such"),
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
    check(mutated(lambda c: c.__setitem__("costmodel", {"source": "model.json"})))

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
            check(mutated(lambda c: c.__setitem__("costmodel", {"source": name})))
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
