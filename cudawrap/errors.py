"""One base exception; each subclass carries the exit code the shim or CLI returns.

Errors are caught in exactly two places, the shim's ``main`` and the CLI root, and
printed there as one line (plus an optional ``hint:`` line).
"""

import posix
TYPE_CHECKING = False  # the shim imports this module and `import typing` costs ~10 ms
if TYPE_CHECKING:
    from typing import Optional


class CudawrapError(Exception):
    """Something cudawrap could not do, said in one line."""

    exit_code: int = posix.EX_SOFTWARE

    def __init__(self, message: str, hint: "Optional[str]" = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(CudawrapError):
    """A command-line value is wrong."""

    exit_code = posix.EX_USAGE  # 64


class DataError(CudawrapError):
    """A file cudawrap reads (registry, id list) is malformed."""

    exit_code = posix.EX_DATAERR  # 65


class StateError(CudawrapError):
    """What is on disk is not what the registry says, or not what an operation needs."""

    exit_code = posix.EX_DATAERR  # 65


class NoDeviceError(CudawrapError):
    """No device became free within the wait limit, or none can ever satisfy the request."""

    exit_code = posix.EX_TEMPFAIL  # 75


class NotPermitted(CudawrapError):
    """The caller lacks the privilege an operation needs."""

    exit_code = posix.EX_NOPERM  # 77


class ConfigError(CudawrapError):
    """The configuration file cannot be used as written."""

    exit_code = posix.EX_CONFIG  # 78

    def __init__(self, message: str, hint: "Optional[str]" = None) -> None:
        # The line says what and where; what to do is the same for every such file.
        super().__init__(message, hint or "correct what it names (a file of the administrator's: ask them to); "
                                          "`cudawrap config` reads it back")


class ProgramNotFound(CudawrapError):
    """The real program behind a shim is missing; reads like the shell's own error."""

    exit_code = 127


class CannotExecute(CudawrapError):
    """The real program exists but cannot be run: the shell's "found but cannot execute"."""

    exit_code = 126


class Interrupted(CudawrapError):
    """Ctrl-C while waiting: the shell's convention for death by SIGINT."""

    exit_code = 128 + 2

    def __init__(self, message: str, hint: "Optional[str]" = None, exit_code: int = 128 + 2) -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code  # 128 + the signal, as the shell reports it


class NvmlUnavailable(CudawrapError):
    """No NVIDIA driver or NVML library; the policy decides whether this is fatal."""

    exit_code = posix.EX_UNAVAILABLE  # 69


class MpsUnavailable(CudawrapError):
    """NVIDIA MPS cannot be used: nvidia-cuda-mps-control is missing, or a control daemon did not start or stop."""

    exit_code = posix.EX_UNAVAILABLE  # 69


class ServiceUnavailable(CudawrapError):
    """The service, this install's only arbiter, does not answer."""

    exit_code = posix.EX_UNAVAILABLE  # 69


class RunsWaiting(CudawrapError):
    """Runs wait where a switch between the install's ways (or a service's start) would
    strand them: nothing changed; try again once none waits."""

    exit_code = posix.EX_TEMPFAIL  # 75


class SlurmUnavailable(CudawrapError):
    """The service cannot learn from Slurm which GPUs a client's job has (scontrol failed)."""

    exit_code = posix.EX_UNAVAILABLE  # 69


class NotConfined(CudawrapError):
    """Under [confine] runs = true, the service could not put this run in a cgroup of its own, so it granted nothing."""

    exit_code = posix.EX_OSERR  # 71


class SetupError(CudawrapError):
    """A directory or file the installation provides is missing or unsafe."""

    exit_code = posix.EX_OSFILE  # 72


class CannotWrite(CudawrapError):
    """A file cudawrap keeps cannot be written: the filesystem is full, over quota or read-only."""

    exit_code = posix.EX_CANTCREAT  # 73

    @classmethod
    def from_os_error(cls, exc: "OSError", where: str) -> "CannotWrite":
        path = exc.filename or where
        return cls(f"cannot write {path}: {exc.strerror or exc}",
                   hint=f"free space on the filesystem of {where} (`df {where}`), then try again")
