"""MKL's Intel paths on AMD CPUs (#44, the CPU's best setup): wanted only on an AMD x86-64
CPU before torch is imported, applied by the launcher only where a model may run on a CPU,
the library loaded from a private folder removed after, what was done logged once; and,
built by the real compiler and loaded before torch in a fresh process, MKL's code path no
worse (on an AMD CPU with AVX-512: better) with products that stay right."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from batchserve import cli
from batchserve.cli import config_from_args
from batchserve.config import Config
from batchserve.models import mkl_paths
from batchserve.models.cpu import cpu_flags, cpu_vendor


def test_wanted_only_on_an_amd_x86_64_cpu_with_torch_installed_and_not_imported() -> None:
    amd: dict[str, Any] = {"vendor": "AuthenticAMD", "machine": "x86_64", "modules": {}}
    assert mkl_paths.reason_not(**amd, torch_installed=True) is None
    intel = {**amd, "vendor": "GenuineIntel"}
    assert "not an AMD" in str(mkl_paths.reason_not(**intel, torch_installed=True))
    arm = {**amd, "machine": "aarch64"}
    assert "not an AMD" in str(mkl_paths.reason_not(**arm, torch_installed=True))
    assert "not installed" in str(mkl_paths.reason_not(**amd, torch_installed=False))
    late = {**amd, "modules": {"torch": object()}}
    assert "imported before" in str(mkl_paths.reason_not(**late, torch_installed=True))


def test_the_flag_is_on_by_default_and_can_be_turned_off() -> None:
    assert config_from_args([])[0].mkl_intel_paths is True
    assert config_from_args(["--mkl-intel-paths", "off"])[0].mkl_intel_paths is False


@pytest.mark.parametrize(
    ("args", "applied"),
    [
        ([], False),  # the simulated default: no torch model
        (["--devices", "cuda:0"], False),
        (["--devices", "cpu"], True),
        (["--devices", " cpu "], True),
        (["--devices", "cpu", "--mkl-intel-paths", "off"], False),
    ],
)
def test_the_launcher_applies_it_only_where_a_model_may_run_on_a_cpu(
    args: list[str], applied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[None] = []
    monkeypatch.setattr(mkl_paths, "apply", lambda: calls.append(None) or "")
    cli._mkl_paths(config_from_args(args)[0])
    assert calls == ([None] if applied else [])


def test_a_models_file_may_name_cpu_devices_so_the_launcher_applies_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[None] = []
    monkeypatch.setattr(mkl_paths, "apply", lambda: calls.append(None) or "")
    config = dataclasses.replace(Config(), models=str(tmp_path / "models.toml"))
    cli._mkl_paths(config)
    assert calls == [None]


def writes_output(command: list[str], **kwargs: Any) -> None:
    assert kwargs["input"] == mkl_paths.SOURCE
    Path(command[command.index("-o") + 1]).write_bytes(b"library")


def test_the_library_is_loaded_from_a_private_folder_removed_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    loaded: list[tuple[Path, bytes]] = []
    mkl_paths.built_and_loaded("cc", writes_output, lambda p: loaded.append((p, p.read_bytes())))
    [(library, content)] = loaded
    assert content == b"library"  # there while it is loaded
    assert library.name == mkl_paths.NAME
    assert library.parent.parent == tmp_path
    assert list(tmp_path.iterdir()) == []  # and gone after


def test_a_failed_compile_is_raised_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def failing(command: list[str], **kwargs: Any) -> None:
        Path(command[command.index("-o") + 1]).write_bytes(b"half")
        raise subprocess.CalledProcessError(1, command)

    with pytest.raises(subprocess.CalledProcessError):
        mkl_paths.built_and_loaded("cc", failing, lambda _: pytest.fail("loaded half a file"))
    assert list(tmp_path.iterdir()) == []


def test_what_was_done_is_logged_once_by_the_first_cpu_model(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(mkl_paths, "_record", mkl_paths._Record())
    mkl_paths.report()  # not applied: nothing to say
    monkeypatch.setattr(mkl_paths, "_apply", lambda: "MKL did something")
    assert mkl_paths.apply() == "MKL did something"
    with caplog.at_level(logging.INFO, logger="batchserve.models.mkl_paths"):
        mkl_paths.report()
        mkl_paths.report()
    assert [r.getMessage() for r in caplog.records] == ["MKL did something"]


def test_a_process_that_imported_torch_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setattr(mkl_paths, "_record", mkl_paths._Record())
    said = mkl_paths.apply()
    assert "imported before" in said or "not an AMD" in said
    assert mkl_paths.outcome() == said


def test_the_launchers_imports_leave_torch_unimported() -> None:
    """Else the launcher would always be too late to load the library."""
    probe = "import sys, batchserve.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


PROBE = """
import ctypes, json, os, sys
if sys.argv[1] != "-":
    ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL | os.RTLD_NOW)
import torch
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
torch.manual_seed(0)
a, b = torch.randn(300, 200), torch.randn(200, 100)
error = ((a @ b).double() - a.double() @ b.double()).abs().max().item()
print(json.dumps({"path": lib.mkl_serv_cpu_detect(), "error": error}))
"""


def probe(library: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, library], capture_output=True, text=True, check=True
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_loaded_before_torch_mkl_takes_its_intel_path_and_multiplies_right(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.backends.mkl.is_available():
        pytest.skip("this torch has no MKL")
    compiler = mkl_paths.c_compiler()
    assert compiler is not None, "the tests need a C compiler (torch.compile's tests do too)"
    library = mkl_paths.build(tmp_path, compiler)
    own, intel = probe("-"), probe(str(library))
    assert intel["path"] >= own["path"]
    if cpu_vendor() == "AuthenticAMD" and "avx512f" in cpu_flags():
        assert intel["path"] > own["path"]  # generic AVX2 -> an AVX-512 path
    assert intel["error"] < 1e-3
