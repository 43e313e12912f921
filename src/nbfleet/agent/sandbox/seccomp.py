"""The sandbox's syscall filter, built with libseccomp (through pyseccomp).

It blocks what Docker's default profile blocks for an unprivileged container: the
syscalls that reach kernel code a notebook never needs and that escapes have used
(mounts, keys, BPF, kernel modules, kexec, ptrace, namespaces, io_uring, clocks,
NUMA and handle-based file access). Everything else is allowed: a denylist, so
Python, NumPy, PyTorch and pip keep working. Docker's profile is an allowlist;
the list here is the part of its refusals that applies to a process that has no
capabilities anyway (the namespaces already take those away), so the filter is
the second line behind the user namespace, not the only one.

A denied syscall fails with EPERM, as under Docker; ``clone3`` fails with ENOSYS so
that the C library falls back to ``clone``, whose namespace flags the filter can
read. Syscalls of another architecture (32-bit ``int 0x80`` on x86-64) kill the
process: libseccomp's default for a foreign architecture.
"""

from __future__ import annotations

import errno
import os

#: Refused outright (EPERM). Names unknown to this kernel's libseccomp are skipped.
BLOCKED = (
    # mounting and pivoting: the mount namespace's layout is the agent's decision
    "mount", "umount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr", "chroot",
    # entering or making namespaces (clone's flags are checked below)
    "setns", "unshare",
    # kernel keyrings, BPF, perf, modules, kexec, reboot, swap, quotas, accounting
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "init_module",
    "finit_module", "delete_module", "create_module", "query_module", "get_kernel_syms",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "quotactl",
    "quotactl_fd", "acct", "syslog", "vhangup", "lookup_dcookie", "nfsservctl", "uselib",
    "ustat", "sysfs", "_sysctl",
    # another process's memory and handles
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "process_madvise",
    # file handles bypass the mount namespace's view
    "name_to_handle_at", "open_by_handle_at",
    # clocks and hardware ports
    "settimeofday", "stime", "clock_settime", "clock_adjtime", "adjtimex", "ioperm", "iopl",
    # NUMA placement and page faults in user space (a common exploit primitive)
    "mbind", "set_mempolicy", "get_mempolicy", "move_pages", "migrate_pages", "userfaultfd",
    # io_uring bypasses seccomp for the operations it performs
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # legacy and unused
    "vm86", "vm86old", "afs_syscall", "tuxcall", "vserver", "security", "lsm_set_self_attr",
    "fanotify_init",
)

#: ``clone`` with any of these flags makes a namespace: refused.
NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
    0x00000080,  # CLONE_NEWTIME
)

#: ``personality`` may not switch off address-space randomisation or make data
#: executable (ADDR_NO_RANDOMIZE, MMAP_PAGE_ZERO, ADDR_COMPAT_LAYOUT, READ_IMPLIES_EXEC).
PERSONALITY_FLAGS = (0x0040000, 0x0100000, 0x0200000, 0x0400000)

#: ioctl TIOCSTI pushes characters into a terminal's input: refused.
TIOCSTI = 0x5412


class SeccompUnavailable(RuntimeError):
    """libseccomp (the C library) cannot be loaded here."""


def write_filter(path: str) -> list[str]:
    """Compile the filter to BPF at ``path`` (mode 0600), for ``bwrap --seccomp``.

    Returns the blocked syscalls this kernel knows, for the start-up report.
    """
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as exc:  # pyseccomp loads libseccomp.so.2 with ctypes
        raise SeccompUnavailable(f"libseccomp is not available: {exc}") from exc
    deny = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    blocked = []
    for name in BLOCKED:
        try:
            rules.add_rule(deny, name)
        except (ValueError, RuntimeError, OSError):
            continue  # not a syscall on this architecture
        blocked.append(name)
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in NAMESPACE_FLAGS:
        rules.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    for flag in PERSONALITY_FLAGS:
        rules.add_rule(deny, "personality", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(deny, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        rules.export_bpf(handle)
    return [*blocked, "clone3", "clone (namespace flags)", "ioctl TIOCSTI"]
