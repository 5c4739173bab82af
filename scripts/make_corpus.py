"""Build the demo model's corpus: the Python standard library sources shipped with this interpreter.

Run: .venv/bin/python scripts/make_corpus.py [--out .cache/demo-corpus] [--vocab-size 4096]

Writes OUT/ with
  tokenizer.json   byte-level BPE trained here with the `tokenizers` package; eos token `<|endoftext|>` (id 0)
  train.bin        uint16 token stream of the training files, each file preceded by eos
  val.bin          the same for the held-out files (split by file: a hash of the path picks ~4% of files)
  corpus.json      source, Python version, file/byte/token counts, sha256 of every output, the val file list

Deterministic: files are read in sorted order, the split is a hash of the relative path, BPE training is run
single-threaded; the same stdlib gives byte-identical outputs (the sha256s in corpus.json say so).

Which files: every *.py under `sysconfig.get_paths()["stdlib"]`, tests included (they double the corpus), except
site-packages, __pycache__, the build-specific `_sysconfigdata_*` and `config-*`, and files that are not UTF-8
or are not valid Python for this interpreter (`ast.parse`; drops lib2to3's Python-2 test data and the
deliberately broken `badsyntax_*` test files). Line endings are normalised to "\\n".
The PSF licence of the sources permits this use; the corpus itself is not committed (it lives under .cache/).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import sys
import sysconfig
import time
import warnings

EOS = "<|endoftext|>"
VAL_PERCENT = 4  # files whose path hash falls below this percentage form the validation split
_SKIP_DIRS = {"site-packages", "__pycache__", "dist-packages"}


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_val(relpath: str) -> bool:
    """The split by file: a stable hash of the '/'-separated relative path."""
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:4], "big")
    return h % 100 < VAL_PERCENT


def list_sources(root: str) -> list[str]:
    """Relative '/'-separated paths of the candidate *.py files under root, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not (rel_dir == "." and d.startswith("config-"))
        )
        for f in filenames:
            if f.endswith(".py") and not f.startswith("_sysconfigdata_"):
                out.append(os.path.normpath(os.path.join(rel_dir, f)).replace(os.sep, "/"))
    return sorted(out)


def read_source(path: str) -> str | None:
    """The file's text with "\\n" line endings, or None when it is not UTF-8 or not valid Python here."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences etc. in old test files
            ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    return text


def collect(root: str, limit: int | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """[(relpath, text)] of the kept files (sorted) and the relpaths that were dropped."""
    kept, dropped = [], []
    for rel in list_sources(root):
        text = read_source(os.path.join(root, rel))
        if text is None or not text.strip():
            dropped.append(rel)
        else:
            kept.append((rel, text))
            if limit is not None and len(kept) >= limit:
                break
    return kept, dropped


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenization: runs of indentation become tokens) with eos = id 0."""
    os.environ["RAYON_NUM_THREADS"] = "1"  # one thread: merge order cannot depend on scheduling
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_stream(tok, texts: list[str]):
    import numpy as np

    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.append(eos)
        ids.extend(enc.ids)
    if tok.get_vocab_size() > 65535:
        raise ValueError("vocab does not fit uint16")
    return np.asarray(ids, np.uint16)


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def build_corpus(
    out_dir: str, *, root: str | None = None, vocab_size: int = 4096, limit: int | None = None, quiet: bool = False
) -> dict:
    """Writes tokenizer.json, train.bin, val.bin and corpus.json into out_dir; returns the corpus record.
    `limit` keeps only the first N kept files (tests)."""
    t0 = time.time()
    root = root or stdlib_dir()
    files, dropped = collect(root, limit)
    train = [(r, t) for r, t in files if not is_val(r)]
    val = [(r, t) for r, t in files if is_val(r)]
    if not train or not val:  # tiny limits: force one file of each
        train, val = files[:-1], files[-1:]
    tok = train_tokenizer([t for _, t in train], vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    train_ids = encode_stream(tok, [t for _, t in train])
    val_ids = encode_stream(tok, [t for _, t in val])
    train_ids.tofile(os.path.join(out_dir, "train.bin"))
    val_ids.tofile(os.path.join(out_dir, "val.bin"))

    def nbytes(fs):
        return sum(len(t.encode()) for _, t in fs)

    rec = {
        "source": "Python standard library sources (*.py) shipped with the interpreter, tests included; PSF licence",
        "stdlib_dir": root,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "selection": "all *.py except site-packages/, __pycache__/, config-*/, _sysconfigdata_*; dropped: not "
        "UTF-8, empty, or not parsed by ast.parse",
        "split": f"by file: sha256(relative path) % 100 < {VAL_PERCENT} -> validation",
        "vocab_size": tok.get_vocab_size(),
        "tokenizer": f"byte-level BPE (tokenizers {_tokenizers_version()}), GPT-2 pre-tokenizer regex, "
        f"min_frequency 2, special token {EOS!r} = id {tok.token_to_id(EOS)}",
        "eos_token": EOS,
        "eos_token_id": tok.token_to_id(EOS),
        "dtype": "uint16",
        "files": {"train": len(train), "val": len(val), "dropped": len(dropped)},
        "bytes": {"train": nbytes(train), "val": nbytes(val)},
        "tokens": {"train": int(train_ids.size), "val": int(val_ids.size)},
        "bytes_per_token": round(nbytes(train) / max(1, train_ids.size - len(train)), 3),
        "sha256": {f: _sha(os.path.join(out_dir, f)) for f in ("tokenizer.json", "train.bin", "val.bin")},
        "val_files": [r for r, _ in val],
        "dropped_files": dropped,
        "build_seconds": round(time.time() - t0, 1),
    }
    with open(os.path.join(out_dir, "corpus.json"), "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")
    if not quiet:
        print(
            f"corpus: {rec['files']} files, {rec['bytes']} bytes, {rec['tokens']} tokens, vocab "
            f"{rec['vocab_size']}, {rec['bytes_per_token']} bytes/token, {rec['build_seconds']} s -> {out_dir}"
        )
    return rec


def _tokenizers_version() -> str:
    import tokenizers

    return tokenizers.__version__


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".cache/demo-corpus", help="output directory (default .cache/demo-corpus)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--stdlib", default=None, help="stdlib directory (default: this interpreter's)")
    args = p.parse_args(argv)
    build_corpus(args.out, root=args.stdlib, vocab_size=args.vocab_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
