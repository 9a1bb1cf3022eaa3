"""A run's devices, the general way: the shim comes here when its fast path (cudawrap/__init__.py)
cannot serve the run; `cudawrap run` and the API lease through obtain().

general.py finds the real program, leases its devices and execs it; inherited.py narrows a
wrapped parent's lease to the child's CUDA_VISIBLE_DEVICES; client.py asks the service; grant.py
is what each of them gives the run. This door hands on what callers use and defines nothing.
"""
from .general import exec_failed, exec_program, fail, find_link, is_script_text, main, obtain  # noqa: F401
from .grant import CVD, Grant  # noqa: F401
