"""The process between liverl and a gate command: nothing the gate starts outlives it.

``outcomes.run_gate`` starts ``python -I -S gate_reaper.py STATUS_FD GRACE_S PARENT -- ARGV``
in a session of its own. This process makes itself the *child subreaper* (Linux
``PR_SET_CHILD_SUBREAPER``) and runs ARGV as its child: every descendant that is orphaned,
including one that left the process group with ``setsid`` (which a ``killpg`` never reaches),
is re-parented here, so the whole tree stays findable by parent links under this pid. On
SIGTERM (run_gate's timeout or its end, the parent's death through ``PR_SET_PDEATHSIG``) it
sends the tree SIGTERM, then SIGKILL to what is left after GRACE_S, reaps everything and
exits.

It tells run_gate on STATUS_FD: ``ready`` once its handlers are in place, then ``exit N`` when
ARGV's own process ends (N as a shell reports it: 128+S for signal S, 127 not found, 126 not
runnable). It keeps reaping after that: descendants may still hold the output pipes, which
run_gate waits for until its timeout.

Run with ``-I -S``: standard library only, imported from nowhere else (a short start).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
TIMEOUT_EXIT = 124  # stopped before ARGV's process ended (outcomes.TIMEOUT_EXIT)
KILL_BOUND_S = 10.0  # after SIGKILL: a process stuck in the kernel is given up on, not waited


class Stop(BaseException):
    """SIGTERM (or SIGHUP, SIGINT): end the gate's whole tree now."""


def _stop(signum: int, frame: object) -> None:
    raise Stop


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):  # not Linux: the process group is all there is
        return False


def descendants(root: int) -> list[tuple[int, bool]]:
    """(pid, is a zombie) of every process under ``root`` by parent links, from /proc."""
    children: dict[int, list[tuple[int, bool]]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(b")") + 2 :].split()  # the name may hold spaces
        children.setdefault(int(fields[1]), []).append((int(name), fields[0] == b"Z"))
    found: list[tuple[int, bool]] = []
    todo = [root]
    while todo:
        for pid, zombie in children.get(todo.pop(), ()):
            found.append((pid, zombie))
            todo.append(pid)
    return found


def _reap() -> None:
    """Reap every child that has ended, without waiting."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def end_tree(grace_s: float) -> None:
    """SIGTERM to the process group and every descendant, SIGKILL after ``grace_s`` to what
    lives on, until none is left (or ``KILL_BOUND_S`` after the SIGKILL)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # the group's is not for us,
        signal.signal(sig, signal.SIG_IGN)  # and a second one does not cut the cleanup short
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(0, signal.SIGTERM)
    me = os.getpid()
    termed: set[int] = set()
    kill_at = time.monotonic() + grace_s
    while True:
        _reap()
        tree = descendants(me)
        if not tree:
            return
        now = time.monotonic()
        if now > kill_at + KILL_BOUND_S:
            return
        for pid, zombie in tree:
            if zombie:
                continue  # its parent (ours, or one killed below) reaps it
            if now >= kill_at:
                _signal(pid, signal.SIGKILL)
            elif pid not in termed:
                termed.add(pid)
                _signal(pid, signal.SIGTERM)
                _signal(pid, signal.SIGCONT)  # a stopped process acts on it
        time.sleep(0.02)


def _say(fd: int, line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, f"{line}\n".encode())


def _exec(argv: list[str]) -> None:
    """In the forked child: the gate's own signal dispositions, then ARGV (no shell)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(2, f"{argv[0]}: {exc.strerror or exc}\n".encode("utf-8", "replace"))
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)


def main(args: list[str]) -> int:
    status_fd, grace_s, parent = int(args[0]), float(args[1]), int(args[2])
    argv = args[4:]  # args[3] is "--"
    os.set_inheritable(status_fd, False)  # the gate does not hold it
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _stop)
    code: int | None = None
    try:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            raise Stop  # run_gate died before the death signal was armed
        child = os.fork()
        if child == 0:
            try:
                _exec(argv)
            finally:  # a SIGTERM to the group before the exec
                os._exit(128 + signal.SIGTERM)
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):  # the output pipes close when the gate's tree lets go of them
            os.dup2(null, fd)
        os.close(null)
        _say(status_fd, "ready")
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break  # the tree is gone by itself
            if pid == child:
                code = os.waitstatus_to_exitcode(status)
                code = 128 - code if code < 0 else code
                _say(status_fd, f"exit {code}")
    except Stop:
        end_tree(grace_s)
    return TIMEOUT_EXIT if code is None else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
