"""The run directory: each stage's folder, the commands a fix names, the run lock and the ledger."""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from .distributed.ranks import is_main_rank
from .fileio import append_jsonl, read_jsonl, to_jsonable
from .messages import DraftsmithError, log

LEDGER = "ledger.jsonl"




STAGE_DIRS = {"prepare": "data", "regenerate": "regen", "evaluate": "eval"}
"""Stage name -> its folder in the run directory (DESIGN.md §2), where the two differ."""


def relative_hint(path: str | Path) -> str:
    """For a not-found error: where a relative path was looked for ("" for an absolute one). A run
    folder's recipe.yaml keeps the paths as given, relative to where the run was started."""
    return "" if Path(path).expanduser().is_absolute() else f" (relative to the current directory {Path.cwd()})"


def stage_dir(run_dir: str | Path, stage: str) -> Path:
    return Path(run_dir) / STAGE_DIRS.get(stage, stage)


RECIPE_FILE = "recipe.yaml"
"""The run's resolved recipe in its run directory (pipeline.write_recipe): a recipe any command takes."""


def stage_command(stage: str, run_dir: str | Path, force: bool = False) -> str:
    """`draftsmith STAGE RUN_DIR/recipe.yaml [--force]`: a stage (or `run`) on the run's resolved recipe,
    which the pipeline writes before a stage starts, the path shell-quoted where it needs it, so the
    command can be pasted as is."""
    return f"draftsmith {stage} {shlex.quote(str(Path(run_dir) / RECIPE_FILE))}{' --force' if force else ''}"


def rerun_command(stage: str, run_dir: str | Path, force: bool = True) -> str:
    """The command an error's fix names, in backticks: stage_command, with --force by default."""
    return f"`{stage_command(stage, run_dir, force)}`"


def run_dir_of(path: str | Path, levels: int = 4) -> Optional[Path]:
    """The run directory that holds `path` (a stage folder or a file in one): the nearest folder at
    most `levels` up, `path` itself included, with the run's recipe.yaml in it. None outside a run."""
    p = Path(path)
    for d in [p, *p.parents][:levels + 1]:
        if (d / RECIPE_FILE).is_file():
            return d
    return None


def fix_command(stage: str, path: str | Path, force: bool = True, then: Sequence[str] = (), levels: int = 4) -> str:
    """A fix naming whole commands for a file or folder of a run: `draftsmith STAGE RUN/recipe.yaml
    --force`, then `draftsmith THEN RUN/recipe.yaml --force` for each later stage to redo. Outside a
    run directory (a file given by hand) the recipe is left for the user to name."""
    run_dir = run_dir_of(path, levels)
    if run_dir is None:
        return ", then ".join(f"`draftsmith {s} RECIPE.yaml{' --force' if force else ''}` (with that run's recipe)"
                             for s in (stage, *then))
    return ", then ".join(rerun_command(s, run_dir, force) for s in (stage, *then))


def redo_stage_hint(directory: str | Path, manifest: Any) -> str:
    """The fix for a stage folder whose files are damaged: the command that redoes that stage (its
    manifest names it; trusted only when the run directory's folder for that stage is `directory`),
    then the command that stopped. Else (no run, an edited `stage`): delete the folder, rerun its stage."""
    directory = Path(directory)
    stage = manifest.get("stage") if isinstance(manifest, dict) else None
    run_dir = run_dir_of(directory.parent, 0)
    if isinstance(stage, str) and run_dir is not None and stage_dir(run_dir, stage) == directory:
        return f"redo the stage with {rerun_command(stage, run_dir)}, then rerun the command that stopped here"
    return f"delete {directory} and rerun its stage"


def token_stage(recipe, run_dir: str | Path) -> tuple[Path, str]:
    """(folder, stage) of the token shards that capture, vocab and online training read: regen/
    when regenerate is enabled, else data/. `recipe` is a config.Recipe."""
    stage = "regenerate" if recipe.regenerate.enabled else "prepare"
    return stage_dir(run_dir, stage), stage



LOCK = ".lock"
_held_locks: dict[str, list] = {}  # resolved run dir -> [open lock file, depth]: re-entrant within a process


def process_start_time(pid: int) -> Optional[int]:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat field 22), or None
    where /proc is missing or the process is gone. With the PID it names one process: a PID the
    kernel hands to a later process comes with a later start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_started_at() -> float:
    """When this process started, in seconds since the epoch (/proc/stat's boot time, whole seconds,
    plus the start in clock ticks: never later than the true start); where /proc is missing, now."""
    try:
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
        ticks = process_start_time(os.getpid())
        if ticks is not None:
            return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return time.time()


def process_cmdline(pid: int) -> Optional[str]:
    """The command line of process `pid` (arguments joined by spaces), or None."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def _lock_holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        return f"pid {h['pid']} (`{h.get('command', '?')}`, since {time.strftime('%H:%M:%S', time.localtime(h['started_at']))})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


class RunLock:
    """An exclusive lock on a run directory (flock on RUN_DIR/.lock), held while a stage runs, so
    two processes never run stages in one run directory at once. The holder writes its pid and
    command into the file; a second process names them in its error, or waits (`wait=True`).
    Re-entrant within a process (`run` holds it across its stages). The kernel drops the lock
    when the holder dies, so a killed run never leaves a stale lock."""

    def __init__(self, run_dir: str | Path, wait: bool = False, poll_s: float = 0.5):
        self.run_dir, self.wait, self.poll_s = Path(run_dir), wait, poll_s
        self.key = str(self.run_dir.resolve())

    def __enter__(self) -> "RunLock":
        import fcntl  # why here: POSIX only; imported where a lock is taken

        if self.key in _held_locks:
            _held_locks[self.key][1] += 1
            return self
        path = self.run_dir / LOCK
        f = open(path, "a+")
        told = False
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not self.wait:
                    f.close()
                    raise DraftsmithError(f"{self.run_dir}: run directory is locked by {_lock_holder(path)}; wait for it to "
                                          "finish (or add --wait-lock to wait), or use another run_dir") from None
                if not told:
                    log(f"[lock] {self.run_dir} is held by {_lock_holder(path)}; waiting (--wait-lock)")
                    told = True
                time.sleep(self.poll_s)
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "pid_start": process_start_time(os.getpid()),
                            "command": (process_cmdline(os.getpid()) or " ".join(sys.argv))[:300], "started_at": time.time()}))
        f.flush()
        _held_locks[self.key] = [f, 1]
        return self

    def __exit__(self, *exc) -> None:
        entry = _held_locks[self.key]
        entry[1] -= 1
        if entry[1] == 0:
            del _held_locks[self.key]
            entry[0].close()  # closing the file releases the flock




class Ledger:
    """Append-only JSONL log of what happened in a run: stage events, measurements, decisions.

    Only rank 0 appends (one line per event under torchrun, not one per rank); every rank reads."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LEDGER

    def append(self, event: str, **fields: Any) -> None:
        if not is_main_rank():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rec = {"time": round(time.time(), 3), "event": event, **to_jsonable(fields)}
        try:
            append_jsonl(self.path, rec)
        except OSError as e:  # a full disk must not hide the error being reported; read() skips a torn line
            log(f"warning: {self.path}: cannot append {event!r} ({e.strerror or e})")

    def read(self) -> list[dict]:
        """All complete records; a torn last line (a crash mid-append) is ignored."""
        return read_jsonl(self.path)
