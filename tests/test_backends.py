"""Loading user backends by path, the simulated backend's contract, and device specs."""

from __future__ import annotations

import sys

import pytest

from batchserve.config import Config
from batchserve.errors import StartupError
from batchserve.models.backends import (
    SimulatedDevice,
    SimulatedFault,
    device_factory,
    simulate,
)
from batchserve.models.device_names import parse_devices
from batchserve.models.specs import BatchFn, DeviceFactory, default_spec

from . import sample_models


def factory_for(
    config: Config,
    names: list[str],
    fn: BatchFn | None = None,
    fn_per_device: DeviceFactory | None = None,
) -> DeviceFactory:
    """The default model's factory, as the flags describe it."""
    return device_factory(config, default_spec(config), names, fn=fn, fn_per_device=fn_per_device)


def test_simulated_device_reverses_each_input_in_order():
    device = SimulatedDevice("sim:0", 0.0, 100)
    assert device(["abc", "", "héllo"]) == ["cba", "", "olléh"]
    assert simulate("abc") == "cba"


@pytest.mark.parametrize("size", [0, 101])
def test_simulated_device_rejects_batches_outside_the_limit(size):
    with pytest.raises(ValueError, match="limit is 1 to 100"):
        SimulatedDevice("sim:0", 0.0, 100)(["x"] * size)


def test_simulated_device_rejects_a_concurrent_call():
    device = SimulatedDevice("sim:0", 0.0, 100)
    device._busy.acquire()  # another batch call is inside the device
    with pytest.raises(RuntimeError, match="two batch calls at once"):
        device(["x"])


def test_shared_fn_is_the_same_on_every_device():
    factory = factory_for(Config(fn="tests.sample_models:shout"), ["sim:0", "sim:1"])
    assert factory("sim:0") is factory("sim:1") is sample_models.shout


def test_per_device_factory_is_called_with_each_device_name():
    config = Config(fn_per_device="tests.sample_models:tagged")
    factory = factory_for(config, ["cpu"])
    assert factory("cpu")(["a"]) == ["cpu:a"]
    assert factory("sim:3")(["a"]) == ["sim:3:a"]


def test_python_callables_come_before_the_configured_paths():
    config = Config(fn="tests.sample_models:shout")
    assert factory_for(config, ["cpu"], fn=sample_models.tagged("x"))("cpu")(["a"]) == ["x:a"]
    factory = factory_for(Config(), ["cpu"], fn_per_device=sample_models.tagged)
    assert factory("cpu")(["a"]) == ["cpu:a"]
    with pytest.raises(StartupError, match="not both"):
        factory_for(Config(), ["cpu"], fn=sample_models.shout, fn_per_device=sample_models.tagged)


def test_without_a_model_only_sim_devices_serve_the_simulated_backend():
    simulated = factory_for(Config(sim_latency_ms=0, sim_fail_rate=1.0), ["sim:0"])("sim:0")
    with pytest.raises(SimulatedFault):
        simulated(["x"])  # the chaos settings reach the simulated device
    with pytest.raises(StartupError, match="needs a model"):
        factory_for(Config(devices="cpu"), ["cpu"])


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("no_colon", "expected package.module:attribute"),
        ("tests.no_such_module:fn", "cannot import tests.no_such_module"),
        ("tests.sample_models:missing", "has no attribute missing"),
        ("tests.sample_models:TinyModel.nope", "has no attribute TinyModel.nope"),
    ],
)
def test_bad_paths_stop_start_up_with_one_line(path, fragment):
    with pytest.raises(StartupError, match=fragment) as caught:
        factory_for(Config(fn=path), ["cpu"])
    assert "\n" not in str(caught.value)


def test_a_factory_returning_a_non_callable_is_refused():
    config = Config(fn_per_device="tests.sample_models:not_a_function")
    with pytest.raises(StartupError, match="returned int for cpu"):
        factory_for(config, ["cpu"])("cpu")


def test_a_torch_model_runs_batched_on_cpu():
    run = sample_models.torch_model("cpu")
    inputs = ["alpha", "beta", "gamma"]
    expected = [str(int(sample_models.TinyModel()(sample_models.encode([t]))[0])) for t in inputs]
    assert run(inputs) == expected


def test_device_specs():
    assert parse_devices("sim:3") == ["sim:0", "sim:1", "sim:2"]
    assert parse_devices("cpu") == ["cpu"]


@pytest.mark.parametrize("spec", ["sim:0", "gpu", "cuda:x", "cpu,cpu", ""])
def test_bad_device_specs(spec):
    with pytest.raises(StartupError):
        parse_devices(spec)


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:0,cuda:1"])
def test_cuda_without_a_visible_gpu_says_so(spec):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(StartupError, match="torch is installed but sees no CUDA device"):
        parse_devices(spec)


def test_cuda_without_torch_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(StartupError, match="needs torch, which is not installed"):
        parse_devices("cuda")
