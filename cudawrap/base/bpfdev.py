"""A cgroup v2 device filter: a BPF_PROG_TYPE_CGROUP_DEVICE program, assembled here, no compiler.

Follows include/uapi/linux/bpf.h. The kernel runs the program on every open and mknod of a
device node by a process of the cgroup (and of its descendants), with a
``struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }`` in r1, where
access_type is ``(BPF_DEVCG_ACC_* << 16) | BPF_DEVCG_DEV_*``; r0 = 1 lets the access through,
0 refuses it (EPERM). The program is attached with BPF_PROG_ATTACH, not a bpf_link: an attach
lasts as long as the cgroup, so the confinement outlives the service that made it.

Attach flags decide whether an ancestor's program still runs below it. With
BPF_F_ALLOW_MULTI on every level, all programs on the path run and each must allow: a child
can only narrow. An ancestor attached with BPF_F_ALLOW_OVERRIDE is replaced by any program
below it (attaching would widen what it refuses), and one attached with no flag refuses
attaches below it (EPERM). ``attach`` reads the ancestors first and refuses both, saying why.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from typing import List, NamedTuple, Tuple

from .devrule import Rule

# enum bpf_cmd
BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16
# enum bpf_prog_type, enum bpf_attach_type
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
# attach flags
BPF_F_ALLOW_OVERRIDE = 1
BPF_F_ALLOW_MULTI = 2
# struct bpf_cgroup_dev_ctx's access_type, low half
BPF_DEVCG_DEV_BLOCK = 1
BPF_DEVCG_DEV_CHAR = 2

# Instruction classes and codes (include/uapi/linux/bpf_common.h, bpf.h)
_LDX_MEM_W = 0x61      # BPF_LDX | BPF_MEM | BPF_W: dst = *(u32 *)(src + off)
_ALU64_AND_K = 0x57    # BPF_ALU64 | BPF_AND | BPF_K
_ALU64_MOV_K = 0xB7    # BPF_ALU64 | BPF_MOV | BPF_K
_JMP_JA = 0x05         # BPF_JMP | BPF_JA
_JMP_JEQ_K = 0x15
_JMP_JGT_K = 0x25
_JMP_JNE_K = 0x55
_JMP_JLT_K = 0xA5      # since 4.14, below the 4.15 that cgroup device programs need
_JMP_EXIT = 0x95
_R0, _R1, _R2, _R3, _R4 = range(5)
_INSN = struct.Struct("<BBhi")

# __NR_bpf of each architecture cudawrap runs on
_SYSCALL = {"x86_64": 321, "aarch64": 280, "ppc64le": 361}

_ALLOW, _DENY = "allow", "deny"


class BpfError(OSError):
    """A bpf(2) command failed; the message says which and what to do."""


class Attached(NamedTuple):
    flags: int
    prog_ids: Tuple[int, ...]


class Program(NamedTuple):
    """A loaded program: its descriptor (kept open by whoever loaded it) and the kernel's id of it."""
    fd: int
    id: int


def _insn(code: int, dst: int = 0, src: int = 0, off: object = 0, imm: int = 0) -> list:
    return [code, dst, src, off, imm]


def assemble(rule: Rule) -> bytes:
    """The program that applies RULE to character devices and lets every block device through.

    Layout: load type, major, minor; not a character device -> allow; each allowed pair ->
    allow; each refused span -> deny; otherwise allow. Jumps name labels, resolved at the end."""
    prog: List[list] = [
        _insn(_LDX_MEM_W, _R2, _R1, 0),
        _insn(_ALU64_AND_K, _R2, imm=0xFFFF),
        _insn(_LDX_MEM_W, _R3, _R1, 4),
        _insn(_LDX_MEM_W, _R4, _R1, 8),
        _insn(_JMP_JNE_K, _R2, off=_ALLOW, imm=BPF_DEVCG_DEV_CHAR),
    ]
    for major, minor in sorted(rule.allowed):
        prog += [_insn(_JMP_JNE_K, _R3, off=1, imm=major),
                 _insn(_JMP_JEQ_K, _R4, off=_ALLOW, imm=minor)]
    for span in rule.refused:
        prog += [_insn(_JMP_JNE_K, _R3, off=3, imm=span.major),
                 _insn(_JMP_JLT_K, _R4, off=2, imm=span.low),
                 _insn(_JMP_JGT_K, _R4, off=1, imm=span.high),
                 _insn(_JMP_JA, off=_DENY)]
    labels = {_ALLOW: len(prog)}
    prog += [_insn(_ALU64_MOV_K, _R0, imm=1), _insn(_JMP_EXIT)]
    if rule.refused:  # the verifier refuses code nothing jumps to
        labels[_DENY] = len(prog)
        prog += [_insn(_ALU64_MOV_K, _R0, imm=0), _insn(_JMP_EXIT)]
    out = bytearray()
    for pc, (code, dst, src, off, imm) in enumerate(prog):
        rel = labels[off] - pc - 1 if isinstance(off, str) else off
        out += _INSN.pack(code, dst | src << 4, rel, imm)
    return bytes(out)


_libc = None


def _bpf(cmd: int, attr: ctypes.Array, what: str) -> int:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    nr = _SYSCALL.get(platform.machine())
    if nr is None:
        raise BpfError(errno.ENOSYS, f"bpf(2): no syscall number known for {platform.machine()}")
    ret = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
    if ret < 0:
        err = ctypes.get_errno()
        raise BpfError(err, f"bpf(2) {what}: {os.strerror(err)}")
    return int(ret)


def _attr() -> ctypes.Array:
    return ctypes.create_string_buffer(128)  # union bpf_attr, zeroed: the kernel checks the unused tail is 0


def load(rule: Rule) -> int:
    """A descriptor of RULE's program, loaded (BPF_PROG_LOAD); the caller closes it."""
    code = assemble(rule)
    insns = ctypes.create_string_buffer(code, len(code))
    license = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(1 << 16)
    attr = _attr()
    struct.pack_into("<IIQQIIQ", attr, 0, BPF_PROG_TYPE_CGROUP_DEVICE, len(code) // _INSN.size,
                     ctypes.addressof(insns), ctypes.addressof(license), 1, len(log), ctypes.addressof(log))
    attr[48:48 + 8] = b"cudawrap"  # prog_name, shown by bpftool
    try:
        return _bpf(BPF_PROG_LOAD, attr, "loading the device program")
    except BpfError as e:
        # The verifier's reason is its last line before the statistics ("processed N insns ...").
        said = [line for line in log.value.decode(errors="replace").splitlines()
                if line.strip() and not line.startswith("processed ")]
        raise BpfError(e.errno, f"{e.strerror} ({said[-1]})" if said else e.strerror) from None


def loaded(rule: Rule) -> Program:
    """RULE's program, loaded, with its id (struct bpf_prog_info's second field); the caller closes it."""
    fd = load(rule)
    try:
        info = ctypes.create_string_buffer(8)  # struct bpf_prog_info's head: type, id (the kernel fills what fits)
        attr = _attr()
        struct.pack_into("<IIQ", attr, 0, fd, len(info), ctypes.addressof(info))
        _bpf(BPF_OBJ_GET_INFO_BY_FD, attr, "reading the device program's id")
    except BaseException:
        os.close(fd)
        raise
    return Program(fd, struct.unpack_from("<I", info, 4)[0])


def query(cgroup_fd: int) -> Attached:
    """The device programs attached to this cgroup itself, and their attach flags (BPF_PROG_QUERY)."""
    ids = (ctypes.c_uint32 * 64)()
    attr = _attr()
    struct.pack_into("<IIIIQI", attr, 0, cgroup_fd, BPF_CGROUP_DEVICE, 0, 0, ctypes.addressof(ids), len(ids))
    _bpf(BPF_PROG_QUERY, attr, "reading a cgroup's device programs")
    flags, = struct.unpack_from("<I", attr, 12)
    count, = struct.unpack_from("<I", attr, 24)
    return Attached(flags, tuple(ids[:count]))


def _prog_fd(prog_id: int) -> int:
    attr = _attr()
    struct.pack_into("<I", attr, 0, prog_id)
    return _bpf(BPF_PROG_GET_FD_BY_ID, attr, f"opening device program {prog_id}")


def _attach_cmd(cmd: int, cgroup_fd: int, prog_fd: int, flags: int, what: str) -> None:
    attr = _attr()
    struct.pack_into("<IIII", attr, 0, cgroup_fd, prog_fd, BPF_CGROUP_DEVICE, flags)
    _bpf(cmd, attr, what)


def _open_dir(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def ancestors_problem(mount: str, cgroup: str) -> str:
    """Why a device program attached to CGROUP (a directory under the v2 MOUNT) with
    BPF_F_ALLOW_MULTI would not keep every ancestor's refusals, or "" where it would."""
    rel = os.path.relpath(cgroup, mount)
    parts = [] if rel == "." else rel.split(os.sep)
    for depth in range(len(parts)):
        where = os.path.join(mount, *parts[:depth])
        fd = _open_dir(where)
        try:
            got = query(fd)
        finally:
            os.close(fd)
        if not got.prog_ids or got.flags & BPF_F_ALLOW_MULTI:
            continue
        if got.flags & BPF_F_ALLOW_OVERRIDE:
            return (f"{where} has a device program attached with BPF_F_ALLOW_OVERRIDE: one attached below it "
                    f"would replace it and widen what it refuses")
        return f"{where} has a device program attached with no flag, which refuses any below it"
    return ""


def confine(mount: str, cgroup: str, rule: Rule, program: "Program | None" = None) -> None:
    """Make RULE the device filter of CGROUP: attach its program (BPF_F_ALLOW_MULTI; PROGRAM,
    RULE's loaded already, else loaded here), then detach those attached before (PROGRAM
    itself, attached there already, stays). Stateless, so that a restarted service narrows
    what a crashed one attached: while both are attached both apply, so the cgroup is never
    wider than either."""
    problem = ancestors_problem(mount, cgroup)
    if problem:
        raise BpfError(errno.EPERM, f"cannot confine {cgroup}: {problem}")
    cfd = _open_dir(cgroup)
    try:
        before = query(cfd).prog_ids
        if program is None:
            attach(cfd, rule, BPF_F_ALLOW_MULTI, cgroup)
        elif program.id not in before:
            _attach_cmd(BPF_PROG_ATTACH, cfd, program.fd, BPF_F_ALLOW_MULTI, f"attaching the device program to {cgroup}")
        for prog_id in before:
            if program is None or prog_id != program.id:
                _detach(cfd, prog_id, cgroup)
    finally:
        os.close(cfd)


def replace(cgroup: str, new: Program, old: Program) -> None:
    """CGROUP's program OLD (attached there by this process) replaced by NEW, by descriptor:
    NEW attached first (BPF_F_ALLOW_MULTI), so that it is never wider than either. Where a
    run's grant waits for it: no load, no query, no walk of the ancestors (confine read them
    when it attached OLD; only root attaches programs)."""
    cfd = _open_dir(cgroup)
    try:
        _attach_cmd(BPF_PROG_ATTACH, cfd, new.fd, BPF_F_ALLOW_MULTI, f"attaching the device program to {cgroup}")
        _attach_cmd(BPF_PROG_DETACH, cfd, old.fd, 0, f"detaching the device program it replaces from {cgroup}")
    finally:
        os.close(cfd)


def attach(cgroup_fd: int, rule: Rule, flags: int, cgroup: str) -> None:
    """Load RULE's program and attach it to the cgroup open as CGROUP_FD with FLAGS, as it is."""
    pfd = load(rule)
    try:
        _attach_cmd(BPF_PROG_ATTACH, cgroup_fd, pfd, flags, f"attaching the device program to {cgroup}")
    finally:
        os.close(pfd)


def _detach(cgroup_fd: int, prog_id: int, cgroup: str) -> None:
    try:
        pfd = _prog_fd(prog_id)
    except BpfError as e:
        if e.errno == errno.ENOENT:  # detached meanwhile
            return
        raise
    try:
        _attach_cmd(BPF_PROG_DETACH, cgroup_fd, pfd, 0, f"detaching device program {prog_id} from {cgroup}")
    except BpfError as e:
        if e.errno != errno.ENOENT:
            raise
    finally:
        os.close(pfd)


def attached(cgroup: str) -> Attached:
    fd = _open_dir(cgroup)
    try:
        return query(fd)
    finally:
        os.close(fd)
