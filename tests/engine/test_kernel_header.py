"""csrc/kernels.h declares every function the kernels library exports, and kernels.py's ctypes
table (names, return and argument types) says the same: a mismatch would pass garbage to C."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from engine.native import kernels
from kernel_modes import COMPILED_MODES, cpu_kernels

HEADER = kernels._CSRC / "kernels.h"
_DECLARATION = re.compile(r"^\s*([A-Za-z_][\w\s]*?[\s*]+)(\w+)\s*\(([^)]*)\)\s*;", re.MULTILINE)


def _ctype(c_type: str) -> type | None:
    """The ctypes type kernels.py must use for one C parameter or return type."""
    c_type = " ".join(c_type.replace("const", "").split())
    if "*" in c_type:
        return ctypes.c_void_p  # kernels.py passes tensors' data_ptr() addresses
    return {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}[c_type]


def _parameter_type(parameter: str) -> str:
    """`const float *q` -> `const float *`; `int64_t rows` -> `int64_t`."""
    return parameter.strip().rsplit(None, 1)[0] + (" *" if "*" in parameter else "")


def header_signatures() -> dict[str, tuple[type | None, list[type | None]]]:
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.DOTALL)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    out = {}
    for ret, name, params in _DECLARATION.findall(text):
        args = [] if params.strip() in ("", "void") else [_ctype(_parameter_type(p)) for p in params.split(",")]
        out[name] = (_ctype(ret), args)
    return out


def test_the_header_parser_reads_every_kind_of_declaration():
    declared = header_signatures()
    assert declared["packed_linear_panel"] == (ctypes.c_int64, [])
    assert declared["silu_mul_f32"] == (None, [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2)
    assert declared["paged_decode_attention_f32"][0] is ctypes.c_int


def test_the_ctypes_table_matches_the_header_name_for_name_and_type_for_type():
    declared = header_signatures()
    assert sorted(declared) == sorted(kernels.SIGNATURES)
    for name, (restype, argtypes) in kernels.SIGNATURES.items():
        header_restype, header_argtypes = declared[name]
        assert restype is header_restype, name
        assert len(argtypes) == len(header_argtypes), name
        assert list(argtypes) == header_argtypes, name


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
@pytest.mark.parametrize("mode", COMPILED_MODES)
def test_the_header_declares_every_function_the_library_exports(mode):
    cpu_kernels(mode)  # built and loaded
    listing = subprocess.run(
        ["nm", "-D", "--defined-only", str(kernels.library_path(mode))], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in listing.splitlines() if line.split()[1:2] == ["T"]}
    assert exported == set(header_signatures())
