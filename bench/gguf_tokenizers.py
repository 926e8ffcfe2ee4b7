"""How faithfully `server.py import-gguf` (engine/gguf_import.py) rebuilds real tokenizers from
GGUF metadata: llama.cpp's source tree ships vocabulary-only GGUF files of real models with test
strings and the token ids the original (Hugging Face) tokenizer gives them
(models/ggml-vocab-<name>.gguf, .inp and .out). Each vocabulary goes through transformers' GGUF
reader and the import's own fix-ups, as the import does, is saved as tokenizer.json, and encodes
every test string.

`python -m bench.gguf_tokenizers` after `make bench-deps` (which unpacks llama.cpp's source).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from engine.gguf_import import _as_llama_cpp_tokenizes

ROOT = Path(__file__).resolve().parents[1]
VOCABS = ROOT / "build" / "llama-cpp" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "models"
NAMES = ("qwen2", "qwen35", "phi-3", "llama-bpe", "llama-spm", "gemma-4")
_SEPARATOR = "\n__ggml_vocab_test__\n"  # llama.cpp's test files put it between strings


def check(name: str) -> tuple[int, int, list[str]]:
    """(strings tokenized as the original does, strings, the first few that differ, shown)."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    gguf = VOCABS / f"ggml-vocab-{name}.gguf"
    with tempfile.TemporaryDirectory() as out:
        AutoTokenizer.from_pretrained(str(VOCABS), gguf_file=gguf.name).save_pretrained(out)
        _as_llama_cpp_tokenizes(GGUFReader(str(gguf)), Path(out) / "tokenizer.json")  # as the import does
        tokenizer = Tokenizer.from_file(str(Path(out) / "tokenizer.json"))
    texts = gguf.with_suffix(".gguf.inp").read_text(encoding="utf-8").split(_SEPARATOR)[:-1]  # one after each
    expected = gguf.with_suffix(".gguf.out").read_text(encoding="utf-8").strip("\n").split("\n")
    differ = []
    for text, ids in zip(texts, expected, strict=True):
        if tokenizer.encode(text, add_special_tokens=False).ids != [int(i) for i in ids.split()]:
            differ.append(repr(text[:24]))
    return len(expected) - len(differ), len(expected), differ[:3]


def main() -> None:
    if not VOCABS.is_dir():
        raise SystemExit(f"{VOCABS} is missing: run `make bench-deps` first")
    print("| vocabulary | same ids as the original | first strings that differ |")
    print("|---|---|---|")
    for name in NAMES:
        try:
            same, total, differ = check(name)
        except Exception as exc:  # transformers cannot read it: the import would refuse it
            print(f"| {name} | not read: {str(exc).splitlines()[0][:80]} | |")
            continue
        print(f"| {name} | {same}/{total} | {', '.join(differ)} |")


if __name__ == "__main__":
    main()
