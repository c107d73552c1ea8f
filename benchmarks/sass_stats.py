"""Instruction mix of one decode specialisation's SASS (needs ``cuobjdump``, e.g. on the GPU machine).

Run: ``PYTHONPATH=. python3 benchmarks/sass_stats.py bf16 128 nhd 4 none [sm_90]``. Prints the register and spill
report of ptxas and a histogram of the opcodes in the kernel, so a change's effect on instruction count and on
16-byte loads (LDS.128, LDGSTS) can be read without device time.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile

from cupy_paged_attn import _compile


def main() -> None:
    dtype, head_size, layout, heads, bias = sys.argv[1:6]
    arch = sys.argv[6] if len(sys.argv) > 6 else "sm_90"
    spec = _compile.DecodeSpec(dtype, int(head_size), layout, int(heads), bias)
    cubin, _ = _compile.compile_offline("paged_decode.cu", [spec.name_expressions()[0]], arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True).stdout
    opcode = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")
    ops = collections.Counter(m.group(1) for m in opcode.finditer(sass))
    print(f"{spec.key}: {sum(ops.values())} instructions")
    for op, n in ops.most_common(40):
        print(f"{n:6d} {op}")


if __name__ == "__main__":
    main()
