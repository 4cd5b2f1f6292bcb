"""The seccomp filter the sandbox loads before model-written code runs (docs/sandbox.md, issue 53).

What it refuses, and why: model-written code has no use for these, and each is a way through a namespace:
- keyrings (`add_key`, `keyctl`, `request_key`): the kernel's keyrings are not namespaced, so a call could read
  the trainer's session keyring or leave a key for a later call. One request stays allowed: joining a new,
  empty, anonymous session keyring (`keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)`), which the sandbox's
  bootstraps do first.
- new namespaces (`unshare`, `setns`, and `clone` with any CLONE_NEW* flag): a nested user namespace has every
  capability inside it, enough to mount the cgroup hierarchy and raise the call's own limits. `clone3` passes
  its flags in memory a filter cannot read, so it answers ENOSYS and the C library falls back to `clone`.
- mounts and roots (`mount`, `umount2`, `pivot_root`, `chroot`, the new mount API), kernel modules, kexec,
  reboot, swap, quotas, accounting, the kernel log, BPF, perf events, userfaultfd, io_uring (its requests
  bypass this filter), `ptrace`, and file handles (`open_by_handle_at` can step out of a bind mount).

Every refused call fails with EPERM (ENOSYS for clone3); the process is not killed, so the code reads an
ordinary OSError. The filter is compiled by libseccomp (loaded with ctypes; Debian's `libseccomp2`, which
bubblewrap itself depends on) once per process, for this machine's architecture only: a call made through
another architecture's entry (int 0x80 on x86-64) kills the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

REFUSED = (
    "add_key", "keyctl", "request_key",
    "unshare", "setns",
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "quotactl", "acct", "syslog", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "ptrace", "process_vm_readv", "process_vm_writev",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "iopl", "ioperm",
)
KEYCTL_JOIN_SESSION_KEYRING = 1
CLONE_NEW_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE, SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 1, 4, 7


def _errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise OSError(f"libseccomp is not installed ({e}); on Debian and Ubuntu: apt-get install libseccomp2") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


@functools.cache
def program() -> bytes:
    """The compiled filter (classic BPF, as bwrap's `--seccomp FD` reads it), built once per process. OSError
    when libseccomp is missing or refuses a rule."""
    lib = _library()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("libseccomp could not make a filter")

    def rule(action: int, name: str, *compares: tuple[int, int, int, int]) -> None:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # not a system call on this architecture (e.g. iopl on arm64): nothing to refuse
            return
        array = (_ArgCmp * max(len(compares), 1))(*(_ArgCmp(*c) for c in compares))
        if (code := lib.seccomp_rule_add_array(ctx, action, number, len(compares), array)) < 0:
            raise OSError(f"libseccomp refused the rule for {name} ({os.strerror(-code)})")

    try:
        for name in REFUSED:
            if name != "keyctl":
                rule(_errno(errno.EPERM), name)
        # keyctl: refused unless it joins a new anonymous session keyring (operation 1 with a NULL name)
        rule(_errno(errno.EPERM), "keyctl", (0, SCMP_CMP_NE, KEYCTL_JOIN_SESSION_KEYRING, 0))
        rule(_errno(errno.EPERM), "keyctl", (0, SCMP_CMP_EQ, KEYCTL_JOIN_SESSION_KEYRING, 0),
             (1, SCMP_CMP_NE, 0, 0))
        for flag in CLONE_NEW_FLAGS:  # clone(flags, ...): any new namespace
            rule(_errno(errno.EPERM), "clone", (0, SCMP_CMP_MASKED_EQ, flag, flag))
        rule(_errno(errno.ENOSYS), "clone3")
        read_fd, write_fd = os.pipe()
        try:
            if (code := lib.seccomp_export_bpf(ctx, write_fd)) < 0:
                raise OSError(f"libseccomp could not export the filter ({os.strerror(-code)})")
            os.close(write_fd)
            write_fd = -1
            chunks = []
            while chunk := os.read(read_fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
    finally:
        lib.seccomp_release(ctx)


def filter_fd() -> int:
    """A new readable fd holding the filter, for one bwrap (`--seccomp FD`, which reads it to the end). The
    caller passes it to the child and closes it."""
    fd = os.memfd_create("grpo-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
