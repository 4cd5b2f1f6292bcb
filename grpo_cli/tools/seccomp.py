"""The seccomp filter the sandbox loads before model-written code runs (docs/sandbox.md, issue 53).

What it refuses, and why: model-written code has no use for these, and each is a way through a namespace, or
a channel between calls that run at once or one after the other (issue 64):
- keyrings (`add_key`, `keyctl`, `request_key`): the kernel's keyrings are not namespaced, so a call could read
  the trainer's session keyring or leave a key for a later call. One request stays allowed: joining a new,
  empty, anonymous session keyring (`keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)`), which the sandbox's
  bootstraps do first and then load a second filter (`keyring_lock()`) that refuses that too: joining again
  and again would fill the uid's key quota.
- new namespaces (`unshare`, `setns`, and `clone` with any CLONE_NEW* flag): a nested user namespace has every
  capability inside it, enough to mount the cgroup hierarchy and raise the call's own limits. `clone3` passes
  its flags in memory a filter cannot read, so it answers ENOSYS and the C library falls back to `clone`.
- mounts and roots (`mount`, `umount2`, `pivot_root`, `chroot`, the new mount API), kernel modules, kexec,
  reboot, swap, quotas, accounting, the kernel log, BPF, perf events, userfaultfd, io_uring (its requests
  bypass this filter), `ptrace`, and file handles (`open_by_handle_at` can step out of a bind mount).
- host state no namespace covers: sockets of any family but AF_UNIX, AF_INET and AF_INET6 (an AF_VSOCK port is
  the host's; EAFNOSUPPORT), file locks (`flock`, fcntl's record, OFD and lease commands: a lock on a read-only
  bind is seen by every call and the host; ENOLCK), dnotify and inotify (a watch on /usr sees what another
  call reads), the page cache's residency (`fadvise64`, `readahead`, `mincore`, `cachestat`, RWF_NOWAIT reads
  and writes; madvise's WILLNEED, COLD and PAGEOUT), POSIX message queues, `F_SETPIPE_SZ` (pipe pages
  count against the uid), and `sysinfo` (the host's task count and free memory, which another call moves).

Every refused call fails with an error number (EPERM unless said above); the process is not killed, so the code reads an
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
    # state every call shares with the others and the host (issue 64): page-cache residency of the read-only
    # binds, inotify watches on them (IN_ACCESS would tell one call what another read), POSIX message queues
    # (their bytes count against the uid), and advice to other processes' memory
    "fadvise64", "readahead", "mincore", "cachestat", "inotify_init", "inotify_init1", "fanotify_init",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr", "process_madvise",
    "sysinfo",  # the host's task count and free memory, which another call moves at will (its /proc files are masked)
)
KEYRING_CALLS = ("add_key", "keyctl", "request_key")
KEYCTL_JOIN_SESSION_KEYRING = 1
CLONE_NEW_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6 (inside the call's own empty network namespace)
LOCK_COMMANDS = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026)
# fcntl: F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW (record locks on a read-only bind are
# seen by every call and the host), F_SETLEASE, F_GETLEASE, F_NOTIFY (dnotify: another call's reads in /usr)
F_SETPIPE_SZ = 1031  # a pipe's size is charged to the uid's pipe pages
RWF_NOWAIT = 0x8  # preadv2/pwritev2: "only if cached", a page-cache probe
MADVISE_CACHE = (3, 20, 21)  # MADV_WILLNEED, MADV_COLD, MADV_PAGEOUT: loading or evicting shared file pages
LOW_32 = 0xFFFFFFFF  # int arguments: the kernel reads only their low 32 bits, so the filter compares those

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE, SCMP_CMP_EQ, SCMP_CMP_GE, SCMP_CMP_MASKED_EQ = 1, 4, 6, 7


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


Rule = tuple[int, str, tuple[tuple[int, int, int, int], ...]]  # (action, system call, argument comparisons)


def _sandbox_rules() -> list[Rule]:
    """bwrap's filter: every refused call above, keyctl but for one request, and the argument-level refusals."""
    refuse, rules = _errno(errno.EPERM), []
    rules += [(refuse, name, ()) for name in REFUSED if name != "keyctl"]
    # keyctl: refused unless it joins a new anonymous session keyring (operation 1 with a NULL name); the
    # bootstrap that does so then loads keyring_lock(), so the join happens once per call (issue 64)
    rules += [(refuse, "keyctl", ((0, SCMP_CMP_NE, KEYCTL_JOIN_SESSION_KEYRING, 0),)),
              (refuse, "keyctl", ((0, SCMP_CMP_EQ, KEYCTL_JOIN_SESSION_KEYRING, 0), (1, SCMP_CMP_NE, 0, 0)))]
    rules += [(refuse, "clone", ((0, SCMP_CMP_MASKED_EQ, flag, flag),)) for flag in CLONE_NEW_FLAGS]
    rules += [(_errno(errno.ENOSYS), "clone3", ())]  # its flags are in memory a filter cannot read
    # sockets: AF_UNIX and the internet families only (AF_VSOCK, AF_NETLINK, AF_PACKET, ... refused); a family
    # past the table, high bits included, is refused whole (GE, not GT: libseccomp 2.5.4 compiles a 64-bit GT
    # as >= on the low word)
    no_family = _errno(errno.EAFNOSUPPORT)
    for name in ("socket", "socketpair"):
        rules += [(no_family, name, ((0, SCMP_CMP_GE, max(SOCKET_FAMILIES) + 1, 0),))]
        rules += [(no_family, name, ((0, SCMP_CMP_EQ, family, 0),))
                  for family in range(max(SOCKET_FAMILIES)) if family not in SOCKET_FAMILIES]
    no_lock = _errno(errno.ENOLCK)
    rules += [(no_lock, "flock", ())]
    rules += [(no_lock, "fcntl", ((1, SCMP_CMP_MASKED_EQ, LOW_32, command),)) for command in LOCK_COMMANDS]
    rules += [(refuse, "fcntl", ((1, SCMP_CMP_MASKED_EQ, LOW_32, F_SETPIPE_SZ),))]
    rules += [(_errno(errno.EOPNOTSUPP), name, ((5, SCMP_CMP_MASKED_EQ, RWF_NOWAIT, RWF_NOWAIT),))
              for name in ("preadv2", "pwritev2")]
    rules += [(refuse, "madvise", ((2, SCMP_CMP_MASKED_EQ, LOW_32, advice),)) for advice in MADVISE_CACHE]
    return rules


def _compile(rules: list[Rule]) -> bytes:
    """Classic BPF for `rules` over a default of allow, for this machine's architecture. OSError when libseccomp
    is missing or refuses a rule."""
    lib = _library()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("libseccomp could not make a filter")
    try:
        for action, name, compares in rules:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:  # not a system call on this architecture (e.g. iopl on arm64): nothing to refuse
                continue
            array = (_ArgCmp * max(len(compares), 1))(*(_ArgCmp(*c) for c in compares))
            if (code := lib.seccomp_rule_add_array(ctx, action, number, len(compares), array)) < 0:
                raise OSError(f"libseccomp refused the rule for {name} ({os.strerror(-code)})")
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


@functools.cache
def program() -> bytes:
    """The compiled filter bwrap loads (`--seccomp FD`), built once per process."""
    return _compile(_sandbox_rules())


@functools.cache
def keyring_lock() -> bytes:
    """A second filter the sandbox's bootstraps load right after their one keyring join: every keyring call
    refused from then on, so code cannot keep joining new keyrings to fill its uid's key quota (issue 64)."""
    return _compile([(_errno(errno.EPERM), name, ()) for name in KEYRING_CALLS])


def filter_fd() -> int:
    """A new readable fd holding the filter, for one bwrap (`--seccomp FD`, which reads it to the end). The
    caller passes it to the child and closes it."""
    fd = os.memfd_create("grpo-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# First thing in the sandbox's Python bootstraps (the python tool's, a worker's): a new, empty, anonymous session
# keyring, the one keyctl request bwrap's seccomp filter lets through, so the call does not even possess the
# trainer's (docs/sandbox.md); then a second filter (seccomp.keyring_lock) that refuses every keyring call, that
# join included, so code cannot keep joining keyrings to fill its uid's key quota (issue 64). keyctl's number:
# x86-64 250, arm64 219. It calls libc through `_ctypes` itself: importing the `ctypes` package costs a harmless
# call 6 ms of its ~35 (issue 53). `_F(("name", _D))` is a libc function returning a C long, `_L(n)` a C long
# argument; the python tool's bootstrap uses them for prctl too.
_LIBC_BOOT = """import _ctypes as _c, os as _o
class _L(_c._SimpleCData):
    _type_ = "l"
class _C(_c._SimpleCData):
    _type_ = "c"
class _F(_c.CFuncPtr):
    _flags_ = _c.FUNCFLAG_CDECL
    _restype_ = _L
class _D:
    _handle = _c.dlopen(None, 0)
def _bytes(data):
    class _A(_c.Array):
        _type_ = _C
        _length_ = len(data)
    return _A.from_buffer_copy(data)
"""

_KEYRING_JOIN = """_n = {"x86_64": 250, "aarch64": 219}.get(_o.uname().machine)
if _n is None or _F(("syscall", _D))(_L(_n), _L(1), _L(0)) < 0:
    raise SystemExit("sandbox: cannot join a new session keyring")
"""

_KEYRING_LOCK = """_lock = _bytes(bytes.fromhex("%s"))
_prog = _bytes((len(_lock) // 8).to_bytes(8, "little") + _c.addressof(_lock).to_bytes(8, "little"))
if _F(("prctl", _D))(_L(22), _L(2), _L(_c.addressof(_prog))) < 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    raise SystemExit("sandbox: cannot load the keyring lock")
"""

@functools.cache
def keyring_boot(lock: bool = True) -> str:
    """The start of a Python bootstrap: join a fresh session keyring, then (`lock`, inside the sandbox, where
    bwrap has set no_new_privs) refuse every keyring call (seccomp.keyring_lock, compiled here and carried in
    the text). OSError without libseccomp."""
    return _LIBC_BOOT + _KEYRING_JOIN + (_KEYRING_LOCK % keyring_lock().hex() if lock else "")
