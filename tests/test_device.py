"""model.device: the CPU path is the tested one and never waits on a GPU; on CUDA every timed call
waits for the GPU before the clock is read, and the fingerprint of a GPU profile is its own."""
import numpy as np
import pytest
import torch

from servingplan import device as device_module
from servingplan.engine import Engine
from servingplan.profile import machine
from servingplan.profile import kvpool
from servingplan.profile.measure import GridPoint, point_call, pool_for
from servingplan.profile.model import load_model
from servingplan.simulate.workload import Trace

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128, "vocab_size": 1000}


@pytest.fixture
def synchronizations(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


def test_wait_for_synchronises_cuda_and_does_nothing_on_the_cpu(synchronizations):
    device_module.wait_for(torch.device("cpu"))
    assert synchronizations == []
    device_module.wait_for(torch.device("cuda", 0))
    assert synchronizations == [torch.device("cuda", 0)]


def test_the_cpu_path_puts_everything_on_the_cpu_and_never_waits_on_a_gpu(synchronizations, monkeypatch):
    waited = []
    monkeypatch.setattr(kvpool, "wait_for", lambda device: waited.append(device))
    model, meta = load_model("random", 0, TINY)
    assert meta["device"] == "cpu" and device_module.model_device(model).type == "cpu"
    generator = torch.Generator().manual_seed(0)
    points = [GridPoint("prefill", 1, 16, 0), GridPoint("decode", 2, 1, 16)]
    pool = pool_for(model.config, points, generator)
    assert pool.keys.device.type == "cpu"
    with torch.inference_mode():
        for point in points:
            point_call(model, pool, point, generator)()
    # each step function waits for its device once, before it returns to whoever times it
    assert waited == [torch.device("cpu")] * 2

    trace = Trace(np.array([0.0, 0.01]), np.array([5, 9]), np.array([3, 2]))
    run = Engine(model, "continuous", 2, threads=1).run(trace, max_wall_s=30)
    assert run.result.finished.all()
    assert len(waited) > 2 and all(d.type == "cpu" for d in waited)
    assert synchronizations == []


def test_a_gpu_profile_has_a_fingerprint_of_its_own():
    assert machine.fingerprint(1) == machine.fingerprint(1, "cpu")
    assert machine.fingerprint(1, "cuda") != machine.fingerprint(1)
