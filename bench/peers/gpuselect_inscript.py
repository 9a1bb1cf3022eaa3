"""gpuselect as its README's first example uses it: called at the top of the job's own script.

    from gpuselect import gpuselect
    gpuselect()   # CUDA_VISIBLE_DEVICES is now set
    ...           # the rest of the script

Here "the rest of the script" is the stand-in CUDA program, run in this same process
(``runpy``), as the lines after the call would be. The same compatibility shim as for
the CLI answers the NVML calls the fake library lacks (see gpuselect_compat.py).

Usage: python gpuselect_inscript.py [PROGRAM.py [ARGS...]]; without PROGRAM the script
ends after the call (a launch's own cost: interpreter, import, selection).
"""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpuselect_compat  # noqa: E402,F401  (patches pynvml; runs nothing on import)
from gpuselect import gpuselect  # noqa: E402

gpuselect()
if len(sys.argv) > 1:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
