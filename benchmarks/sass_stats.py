"""Instruction mix of one decode specialisation's SASS, compiled offline (no GPU needed).

Needs ``cuobjdump``: the CUDA toolkit's, or the ``nvidia-cuda-cuobjdump`` wheel's (``pip install
nvidia-cuda-cuobjdump``; its ``nvidia/cu13/bin`` is searched after ``PATH``). Run from the repository root::

    PYTHONPATH=. python3 benchmarks/sass_stats.py fp32 bf16 128 nhd 4 none          # FP32 kernel, 4 heads per CTA
    PYTHONPATH=. python3 benchmarks/sass_stats.py tc bf16 128 nhd dense 8           # tensor cores, 8 rows per CTA
    PYTHONPATH=. python3 benchmarks/sass_stats.py tc bf16 128 nhd dense 8 --define CPA_BIAS_RING=2 --arch sm_80

Prints the kernel's registers, spills and shared memory (``cuobjdump -res-usage``), a histogram of its opcodes, and
each loop of more than ``--loop-min`` instructions (a backward branch and its target) with its size and its memory
and matrix instructions, so a change's effect on the instruction stream and on 16-byte loads (LDS.128, LDGSTS) can be
read without device time. (An unrolled loop counts every copy of its body: the tensor-core decode with a dense or
ragged bias unrolls its tile loop by the bias ring's depth.)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cupy_paged_attn import _compile

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
PREDICATE = re.compile(r"^@!?U?P\w+\s+")
BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
#: Opcode families counted per loop.
LOOP_OPS = ("HMMA", "LDGSTS", "LDG", "LDSM", "LDS", "STS", "BAR", "MUFU", "FFMA", "FMUL", "IMAD", "ISETP", "SEL", "BRA")


def find_cuobjdump() -> str:
    """``cuobjdump`` on PATH, else the one in the nvidia-cuda-cuobjdump wheel."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for entry in sys.path:
        for bin_dir in Path(entry or ".").glob("nvidia/cu*/bin"):
            if (bin_dir / "cuobjdump").is_file():
                return str(bin_dir / "cuobjdump")
    raise SystemExit("sass_stats: no cuobjdump on PATH or in an installed nvidia-cuda-cuobjdump wheel")


def compile_spec(args: argparse.Namespace) -> tuple[str, str, bytes]:
    """(spec key, kernel file, cubin) of the specialisation the arguments name."""
    _compile._COMPILE_OPTIONS = (*_compile._COMPILE_OPTIONS, *(f"-D{d}" for d in args.define))
    if args.kernel == "fp32":
        dtype, head_size, layout, heads, bias = args.spec
        spec: _compile.DecodeSpec | _compile.PrefillSpec = _compile.DecodeSpec(
            dtype, int(head_size), layout, int(heads), bias, args.cluster)
        filename = "paged_decode.cu"
    else:
        dtype, head_size, layout, bias, rows = args.spec
        spec = _compile.PrefillSpec(dtype, int(head_size), layout, bias, int(rows))
        filename = "paged_prefill.cu"
    cubin, _ = _compile.compile_offline(filename, [spec.name_expressions()[0]], args.arch)
    # CuPy's getCUBIN drops the image's last byte (a cubin whose program headers end the file then fails to load
    # in cuobjdump); the padding restores it, and trailing zeros are harmless to an ELF reader.
    return spec.key, filename, bytes(cubin) + b"\0" * 8


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction without its predicate) of each line of a kernel's SASS."""
    return [(int(m.group(1), 16), PREDICATE.sub("", m.group(2))) for m in INSTRUCTION.finditer(sass)]


def family(instruction: str) -> str:
    return instruction.split()[0].split(".")[0]


def loops(code: list[tuple[int, str]], min_size: int) -> list[tuple[int, int, collections.Counter[str]]]:
    """(first address, last address, opcode families) of each backward branch's body of at least ``min_size``."""
    index = {address: i for i, (address, _) in enumerate(code)}
    found = []
    for i, (address, text) in enumerate(code):
        m = BRANCH.search(text)
        if m and int(m.group(1), 16) < address and int(m.group(1), 16) in index:
            body = code[index[int(m.group(1), 16)]:i + 1]
            if len(body) >= min_size:
                found.append((body[0][0], address, collections.Counter(family(t) for _, t in body)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=("fp32", "tc"), help="paged_decode.cu's FP32 kernel or the tensor-core one")
    parser.add_argument("spec", nargs=5, help="fp32: DTYPE HEAD LAYOUT HEADS_PER_CTA BIAS; tc: DTYPE HEAD LAYOUT "
                                              "BIAS ROWS (8 or 16)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--cluster", action="store_true", help="fp32: the kernel that combines partitions in clusters")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--loop-min", type=int, default=150, help="smallest loop body reported (instructions)")
    args = parser.parse_args(argv)
    key, _, cubin = compile_spec(args)
    tool = find_cuobjdump()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        Path(path).write_bytes(cubin)
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    code = instructions(sass)
    ops = collections.Counter(text.split()[0] for _, text in code)
    print(f"{key} ({args.arch}{''.join(' -D' + d for d in args.define)}): {len(code)} instructions")
    function = ""
    for line in usage.splitlines():
        if line.strip().startswith("Function "):
            function = line.strip().removeprefix("Function ").rstrip(":")
        elif "REG:" in line:
            print(f"  {function[:60]}: {line.strip()}")
    for first, last, families in loops(code, args.loop_min):
        counts = " ".join(f"{op} {families[op]}" for op in LOOP_OPS if families[op])
        print(f"  loop {first:#06x}-{last:#06x}: {sum(families.values())} instructions; {counts}")
    for op, n in ops.most_common(40):
        print(f"{n:6d} {op}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
