"""The sandbox's first process: it makes fresh user, mount, PID, network, IPC and UTS namespaces.

`archon.agents.sandbox` starts it as `python -I -S -c <this file's text>`. It opens what the
sandbox will show of the host, unshares the namespaces (unshare(2) through ctypes) and waits while
the process that started it maps its user: root inside is an unprivileged user outside (nobody,
65534, when the trainer is root; the trainer's own user otherwise), so that RLIMIT_NPROC binds and
no file of the trainer's user is the sandbox's. It then forks PID 1 of the new PID namespace, which
builds a file system of its own:

    /                    a read-only tmpfs holding only what is listed below
    /usr /bin /lib ...   the host's, bound read-only (symlinks stay symlinks)
    <python prefix>      the interpreter's installation, bound read-only at its own path
    /etc                 a few files the C library reads, and a passwd naming only root
    /dev                 null, zero, full, random, urandom; /dev/shm points into the scratch
    /proc                a new procfs of the PID namespace (left out where the kernel refuses it)
    /scratch             a tmpfs of `scratch_mb`: the working directory, $HOME and $TMPDIR

The host's root is then detached (pivot_root): the run directory, $HOME and other calls' scratch are
not there to be named. The program itself runs in a child with no capabilities at all (the bounding
set emptied, no_new_privs set), so it cannot undo a mount, and under the RLIMITs. This process makes
itself non-dumpable, so the program cannot open its descriptors or trace it through /proc.

It reads one JSON request line on stdin ({"code", "deadline", "cpu_s", "memory", "file_size",
"processes", "scratch_mb", "max_bytes", "paths", "blocked"}), writes {"unshared": true} once the
namespaces exist, reads "mapped" once its user is mapped, and writes one JSON reply line on stdout
({"returncode", "stopped", "cpu_s", "stdout", "stdout_chars", "stderr", "stderr_chars"}). When it
ends, so does every process left in its PID namespace, and its tmpfs with them. It ends when the
program does, at the wall-clock limit, or when its stdin closes (the process that started it died).

It does not import archon (it runs with -I -S and cannot see the working tree): it is sent as text.
"""

import ctypes
import json
import os
import resource
import select
import signal
import stat
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    16384,
    1 << 18,
)
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PIVOT_ROOT_SYSCALL = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
DEVICES = ("null", "zero", "full", "random", "urandom")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "localtime", "nsswitch.conf", "mime.types")
HOST_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SCRATCH = "/scratch"

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
libc.syscall.restype = ctypes.c_long


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source, target: str, fstype, flags: int, data=None) -> None:
    encode = lambda value: None if value is None else value.encode()  # noqa: E731
    check(libc.mount(encode(source), target.encode(), encode(fstype), flags, encode(data)), f"mount {target}")


def locked_flags(fd: int) -> int:
    """The mount flags of the mount holding `fd` that a bind in a user namespace must keep."""
    flags = os.statvfs(fd).f_flag
    kept = 0
    for statvfs_flag, mount_flag in ((8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME), (4096, MS_RELATIME)):
        if flags & statvfs_flag:
            kept |= mount_flag
    return kept


def open_sources(paths: list) -> dict:
    """What the sandbox shows of the host, opened while this process still has the trainer's user
    (the sandbox's own user may not reach them: /root is 0700): each path -> an O_PATH descriptor,
    or the target of a symlink."""
    sources = {}
    wanted = (*HOST_DIRS, *paths, *("/etc/" + name for name in ETC_FILES), *("/dev/" + name for name in DEVICES))
    for path in wanted:
        if os.path.islink(path):
            sources[path] = os.readlink(path)
        elif os.path.exists(path):
            sources[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
    return sources


def bind_read_only(path: str, source, root: str, devices: bool = False) -> None:
    """`path` visible at the same path under `root` (`source`: see open_sources), read-only and with
    its device nodes unusable unless `devices`; a symlink is copied as a symlink."""
    target = root + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if isinstance(source, str):
        if not os.path.lexists(target):
            os.symlink(source, target)
        return
    if stat.S_ISDIR(os.fstat(source).st_mode):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "a").close()
    try:
        mount(f"/proc/self/fd/{source}", target, None, MS_BIND)
    except OSError:  # a mount with mounts of its own over it binds only with them
        mount(f"/proc/self/fd/{source}", target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | (0 if devices else MS_NODEV) | locked_flags(source)
    mount(None, target, None, flags)


def open_captures(root: str, file_size: int) -> list:
    """Two files for the program's stdout and stderr on a tmpfs of their own, detached at once: only
    the open descriptors reach them, and they do not count against the scratch."""
    where = root + "/.captures"
    os.makedirs(where)
    mount("tmpfs", where, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={2 * file_size + 2**20},mode=0700")
    captures = []
    for name in ("stdout", "stderr"):
        captures.append(os.open(f"{where}/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(f"{where}/{name}")
    check(libc.umount2(where.encode(), MNT_DETACH), "detach the captures")
    os.rmdir(where)
    return captures


def build_root(root: str, sources: dict, scratch_mb: int, file_size: int) -> list:
    """The sandbox's file system (see the module doc), built at `root` and then made `/`; the
    descriptors of the program's two capture files (see open_captures)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    captures = open_captures(root, file_size)
    os.makedirs(root + "/etc")
    os.makedirs(root + "/dev")
    for path, source in sources.items():
        bind_read_only(path, source, root, devices=path.startswith("/dev/"))
        if not isinstance(source, str):
            os.close(source)
    with open(root + "/etc/passwd", "w") as file:
        file.write(f"root:x:0:0:sandbox:{SCRATCH}:/bin/sh\n")
    with open(root + "/etc/group", "w") as file:
        file.write("root:x:0:\n")
    os.symlink(SCRATCH, root + "/dev/shm")
    os.makedirs(root + SCRATCH)
    mount("tmpfs", root + SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch_mb}m,mode=0777")
    os.makedirs(root + "/proc")
    try:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:  # a kernel that refuses procfs here: the program runs without /proc
        pass
    os.chdir(root)
    syscall = PIVOT_ROOT_SYSCALL[os.uname().machine]
    check(libc.syscall(syscall, b".", b"."), "pivot_root")  # the old root now lies under the new one
    check(libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(SCRATCH)
    return captures


def drop_privileges() -> None:
    """No capabilities now or after exec, and none to be gained."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    check(libc.capset(header, data), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


BOOTSTRAP = r"""
import sys, traceback
blocked = frozenset(sys.argv[1].split(","))

def refuse(event, args):
    if event in blocked:
        raise PermissionError(f"{event} is refused: the sandbox allows no network access and starts no programs")

sys.addaudithook(refuse)
try:
    with open("main.py", encoding="utf-8") as file:
        code = compile(file.read(), "main.py", "exec")
    exec(code, {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as exc:
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
"""


def start_program(request: dict, stdout: int, stderr: int) -> int:
    """Fork the program's process: stdio on /dev/null and the two capture files, the RLIMITs, no capabilities."""
    pid = os.fork()
    if pid:
        return pid
    try:
        devnull = os.open("/dev/null", os.O_RDONLY)
        for fd, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)
        os.setsid()
        limits = (
            (resource.RLIMIT_CPU, request["cpu_s"], request["cpu_s"] + 1),
            (resource.RLIMIT_AS, request["memory"], request["memory"]),
            (resource.RLIMIT_FSIZE, request["file_size"], request["file_size"]),
            (resource.RLIMIT_NPROC, request["processes"], request["processes"]),
            (resource.RLIMIT_CORE, 0, 0),
        )
        for which, soft, hard in limits:
            resource.setrlimit(which, (soft, hard))
        drop_privileges()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": SCRATCH, "LANG": "C.UTF-8"}
        env["OPENBLAS_NUM_THREADS"] = "1"
        os.execve(sys.executable, [sys.executable, "-I", "-X", "utf8", "-c", BOOTSTRAP, request["blocked"]], env)
    except BaseException as exc:  # noqa: BLE001 - reported on the program's stderr
        os.write(2, f"the sandbox could not start the program: {exc}\n".encode())
    os._exit(127)


def read_capture(fd: int, max_bytes: int) -> tuple:
    """(up to max_bytes of a capture file as text, its length in characters, estimated from its size
    when it was not read whole)."""
    size = os.fstat(fd).st_size
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while len(data) < min(size, max_bytes) and (chunk := os.read(fd, max_bytes - len(data))):
        data += chunk
    text = data.decode("utf-8", errors="replace")
    return text, len(text) + size - len(data)


def supervise(pid: int, deadline: float) -> tuple:
    """Wait for the program until `deadline` (time.monotonic(), a clock every process shares):
    (its wait status, its CPU seconds, "timeout" | "parent_died" | None)."""
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stopped = None
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return status, usage.ru_utime + usage.ru_stime, stopped
        remaining = deadline - time.monotonic()
        if remaining <= 0 and stopped is None:
            stopped = "timeout"
        if stopped is None:
            readable, _, _ = select.select([0, wakeup_r], [], [], remaining)
            if 0 in readable and not os.read(0, 1 << 16):
                stopped = "parent_died"
            if wakeup_r in readable:
                os.read(wakeup_r, 1 << 10)
        if stopped is not None:
            for target in (-pid, pid):  # its process group, and itself if it had not made one yet
                try:
                    os.kill(target, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _, status, usage = os.wait4(pid, 0)
            return status, usage.ru_utime + usage.ru_stime, stopped


def enter_namespaces(paths: list) -> dict:
    """Unshare the namespaces, open what the sandbox shows of the host (see open_sources), have the
    process that started this one map the user (it answers "mapped" on stdin), and fork: the child
    goes on as PID 1 of the new PID namespace, root of the new user namespace, with the sources;
    this process waits for it and exits as it did."""
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    check(libc.unshare(flags), "unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | ...)")
    sources = open_sources(paths)  # in the new mount namespace (a bind takes only its own mounts)
    os.write(1, b'{"unshared": true}\n')
    if sys.stdin.readline().strip() != "mapped":
        os._exit(1)
    pid = os.fork()
    if pid:
        os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) & 0xFF)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    return sources


def main() -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    request = json.loads(sys.stdin.readline())
    sources = enter_namespaces(request["paths"])
    reply = os.dup(1)
    captures = build_root("/tmp", sources, request["scratch_mb"], request["file_size"])
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    with open("main.py", "w", encoding="utf-8") as file:
        file.write(request["code"])
    pid = start_program(request, *captures)
    status, cpu_s, stopped = supervise(pid, request["deadline"])
    result = {"returncode": os.waitstatus_to_exitcode(status), "stopped": stopped, "cpu_s": cpu_s}
    for name, fd in zip(("stdout", "stderr"), captures):
        result[name], result[f"{name}_chars"] = read_capture(fd, request["max_bytes"])
    with os.fdopen(reply, "wb") as stream:
        stream.write((json.dumps(result) + "\n").encode())


if __name__ == "__main__":
    main()
