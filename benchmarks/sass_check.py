"""Where a kernel's weight loads sit relative to its griddepcontrol.wait, in the SASS (GPU machine:
needs cuobjdump). python benchmarks/sass_check.py OUT_DIR"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.dtypes import DType


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, spec in (("gemv_qkv", S.GemvSpec(1, 4096, 1024, DType.BF16, norm=True, coop_norm=True)),
                       ("gemv_down", S.GemvSpec(1, 1024, 3072, DType.BF16, epilogue=S.Epilogue(residual=True)))):
        ck = K.build(spec, "sm_90")
        cub = out / f"{name}.cubin"
        cub.write_bytes(ck.cubin)
        sass = subprocess.run(["cuobjdump", "-sass", str(cub)], capture_output=True, text=True).stdout
        (out / f"{name}.sass").write_text(sass)
        lines = [ln.strip() for ln in sass.splitlines() if "/*" in ln]
        keep = [i for i, ln in enumerate(lines) if any(t in ln for t in ("LDG", "ACQ", "DEP", "GRID", "WAIT", "PREEXIT", "BAR"))]
        print(f"== {name}: {len(lines)} instructions")
        for i in keep[:40]:
            print(i, lines[i][:110])
    return 0


if __name__ == "__main__":
    sys.exit(main())
