"""MKL's Intel paths on AMD CPUs (#44, the CPU's best setup): wanted only on an AMD x86-64
CPU before torch is imported, the library built once and renamed into place, and, built by
the real compiler and loaded before torch in a fresh process, MKL's code path no worse (on
an AMD CPU with AVX-512: better) with products that stay right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchserve.cli import config_from_args
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


def test_the_library_is_compiled_once_under_a_name_of_its_own_then_renamed(tmp_path: Path) -> None:
    commands: list[list[str]] = []

    def compile_(command: list[str], **kwargs: Any) -> None:
        commands.append(command)
        assert kwargs["input"] == mkl_paths.SOURCE
        output = Path(command[command.index("-o") + 1])
        assert output.name != mkl_paths.NAME  # never the final name while being written
        output.write_bytes(b"library")

    library = mkl_paths.build(tmp_path / "cache", "cc", run=compile_)
    assert library == tmp_path / "cache" / mkl_paths.NAME
    assert library.read_bytes() == b"library"
    assert mkl_paths.build(tmp_path / "cache", "cc", run=compile_) == library
    assert len(commands) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [mkl_paths.NAME]


def test_a_failed_compile_leaves_nothing_behind(tmp_path: Path) -> None:
    def failing(command: list[str], **kwargs: Any) -> None:
        Path(command[command.index("-o") + 1]).write_bytes(b"half")
        raise subprocess.CalledProcessError(1, command)

    with pytest.raises(subprocess.CalledProcessError):
        mkl_paths.build(tmp_path, "cc", run=failing)
    assert list(tmp_path.iterdir()) == []


def test_a_process_that_imported_torch_is_left_as_it_is(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    said = mkl_paths.apply(tmp_path)
    assert "imported before" in said or "not an AMD" in said
    assert list(tmp_path.iterdir()) == []


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


def writes_output(command: list[str], **_: Any) -> None:
    Path(command[command.index("-o") + 1]).write_bytes(b"library")


def test_the_library_is_kept_in_the_cache_and_loaded_from_there(tmp_path: Path) -> None:
    loaded: list[Path] = []
    said = mkl_paths.built_and_loaded(tmp_path, "cc", writes_output, loaded.append)
    assert loaded == [tmp_path / mkl_paths.NAME]
    assert said == str(tmp_path / mkl_paths.NAME)


def test_a_cache_that_cannot_be_written_falls_back_to_a_temporary_folder(tmp_path: Path) -> None:
    (tmp_path / "home").write_text("a file where the cache's parent folder should be")
    loaded: list[Path] = []
    seen: list[bytes] = []

    def load(library: Path) -> None:
        loaded.append(library)
        seen.append(library.read_bytes())  # there while it is loaded

    said = mkl_paths.built_and_loaded(tmp_path / "home" / "cache", "cc", writes_output, load)
    assert said == "built in a temporary folder"
    assert seen == [b"library"]
    assert not loaded[0].exists()  # removed once loaded
    assert not loaded[0].is_relative_to(tmp_path)
