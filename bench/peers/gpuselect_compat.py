"""Run gpuselect 0.1.4's CLI unchanged on the simulated machine.

gpuselect reads fan speed, power, temperature, performance state and clock event
reasons from every GPU. A real driver has those calls; the fake libnvidia-ml.so.1 does
not (pynvml raises FunctionNotFound), which would make gpuselect fail for a reason no
real machine has. This wrapper answers only those calls, and only when the library lacks
them, with the values of an idle GPU; everything gpuselect decides on (utilization,
memory, process count) still comes from NVML. Utilization on a MIG-mode GPU stays
NotSupported, as with the real driver, so gpuselect fails there as it would for real.

Usage: python gpuselect_compat.py [gpuselect options] -- CMD ...
"""
import pynvml

_IDLE = {
    "nvmlDeviceGetFanSpeed": 0,
    "nvmlDeviceGetEnforcedPowerLimit": 0,
    "nvmlDeviceGetPerformanceState": 8,
    "nvmlDeviceGetPowerUsage": 0,
    "nvmlDeviceGetTemperature": 30,
    "nvmlDeviceGetCurrentClocksEventReasons": pynvml.nvmlClocksEventReasonGpuIdle,
}


def _fallback(name, value):
    real = getattr(pynvml, name)

    def call(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except pynvml.NVMLError_FunctionNotFound:
            return value

    return call


for _name, _value in _IDLE.items():
    setattr(pynvml, _name, _fallback(_name, _value))

from gpuselect.nvmlgpuselect import main  # noqa: E402

if __name__ == "__main__":
    main()
