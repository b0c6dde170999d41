"""Run one of scripts/ under a tracer that stops it at its Nth write in a tree.

    python tests/support/trace_run.py SCRIPT ARG...

Python's audit hooks see every file operation before it happens (open for writing, mkdir,
rename/replace, remove, rmdir, chmod, chown); the ones on paths inside $TRACE_TREE are the
script's steps, counted from 1. Nothing in scripts/ knows about it. Environment:

  TRACE_TREE  the folder whose writes count
  TRACE_LOG   append each step ("N EVENT PATH") to this file
  TRACE_AT    the step to act at (none: just count)
  TRACE_DO    what to do there, before the operation runs: KILL (SIGKILL, the default),
              SIGINT / SIGTERM (sent to itself: Python acts on it at once), an errno name
              (ENOSPC, EIO, EROFS: the operation fails with that error), or WAIT:FILE
              (create FILE.waiting, then wait until FILE exists: a second run can go meanwhile)
"""
import errno
import os
import runpy
import signal
import sys
import time

TREE = os.path.realpath(os.environ["TRACE_TREE"])
LOG, AT, DO = os.environ.get("TRACE_LOG"), int(os.environ.get("TRACE_AT") or 0), os.environ.get("TRACE_DO", "KILL")
PATHS = {"open": (0,), "os.rename": (0, 1), "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,),
         "os.chmod": (0,), "os.chown": (0,), "os.link": (0, 1), "os.symlink": (1,), "os.truncate": (0,)}
DIR_FD = {"os.rename": 2, "os.remove": 1, "os.rmdir": 1, "os.mkdir": 2, "os.chmod": 2, "os.chown": 3}
WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
steps = 0


def where(path, dir_fd):
    """An audited path as an absolute one (an int is an open file; dir_fd: relative to it)."""
    if isinstance(path, int):
        return os.readlink(f"/proc/self/fd/{path}")
    path = os.fsdecode(path)
    if dir_fd is not None and not os.path.isabs(path):
        return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    return os.path.abspath(path)


def hook(event, args):
    global steps
    if event not in PATHS or (event == "open" and not (
            (isinstance(args[1], str) and set(args[1]) & set("wax+")) or (args[1] is None and args[2] & WRITING))):
        return
    dir_fd = args[DIR_FD[event]] if event in DIR_FD else None
    paths = [where(args[i], dir_fd) for i in PATHS[event]]
    if not any(p == TREE or p.startswith(TREE + os.sep) for p in paths):
        return
    steps += 1
    if LOG:
        with open(LOG, "a") as log:
            log.write(f"{steps} {event} {' '.join(paths)}\n")
    if steps != AT:
        return
    if DO == "KILL":
        os.kill(os.getpid(), signal.SIGKILL)
    elif DO.startswith("SIG"):
        os.kill(os.getpid(), getattr(signal, DO))
    elif DO.startswith("WAIT:"):
        open(DO[5:] + ".waiting", "w").close()
        while not os.path.exists(DO[5:]):
            time.sleep(0.02)
    else:
        raise OSError(getattr(errno, DO), f"{os.strerror(getattr(errno, DO))} (injected at step {steps})")


sys.argv = sys.argv[1:]
sys.addaudithook(hook)
runpy.run_path(sys.argv[0], run_name="__main__")
