"""`draftsmith doctor [RECIPE] [--kill-stale]`: will this run work here, before it costs hours?

Checks, each ok / warn / fail / info:
    versions   Python, torch, transformers against the ranges draftsmith is tested with
    gpus       every visible GPU and its free memory
    disk       free disk at run_dir against the capture size (tokens x bytes per token)
    memory     target weights + drafter against the free memory of the device they load on
    processes  draftsmith processes recorded in the run's ledger (pid, start time, command line
               and run dir of each stage_started) that are still alive as that same process: only
               those, never a search by process name, never a reused PID. --kill-stale
               sends SIGTERM to the ones whose stage has ended or was started again since.
Exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Optional

import torch
from packaging.version import Version

from .fileio import read_json
from .manifests import load_manifest
from .messages import DraftsmithError
from .rundir import Ledger, process_cmdline, process_start_time, relative_hint, stage_dir
from .compat import TESTED
from .config import parse_recipe
from .costmodel import drafter_params, target_spec
from .data.shards import bytes_per_token
from .distributed.group import resolve_device

ICON = {"ok": "✅", "warn": "⚠️ ", "fail": "❌", "info": "ℹ️ "}


def check(name: str, status: str, detail: str, **data: Any) -> dict:
    return {"check": name, "status": status, "detail": detail, **data}


def _within(version: str, lo: str, hi: str) -> bool:
    v = Version(version).release
    return Version(lo).release <= v[:len(Version(lo).release)] and v[:len(Version(hi).release)] <= Version(hi).release


def check_versions() -> list[dict]:
    out = []
    for name, (lo, hi) in TESTED.items():
        try:
            v = platform.python_version() if name == "python" else version(name)
        except PackageNotFoundError:
            out.append(check(name, "fail", f"{name} is not installed; pip install '{name}>={lo}'"))
            continue
        rng = lo if lo == hi else f"{lo}–{hi}"
        ok = _within(v, lo, hi)
        out.append(check(name, "ok" if ok else "warn", f"{name} {v}" + ("" if ok else f", outside the tested {rng}; "
                                                                         "it may work, but report problems with these versions"),
                         version=v, tested=[lo, hi]))
    return out


def gpus() -> list[dict]:
    """Visible CUDA GPUs: index, name, free and total memory in bytes."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append({"index": i, "name": torch.cuda.get_device_name(i), "free": free, "total": total})
    return out


def check_gpus(found: list[dict]) -> list[dict]:
    if not found:
        return [check("gpus", "info", "no CUDA GPU visible; stages run on CPU (fine for the quickstart)")]
    out = []
    for g in found:
        share = g["free"] / g["total"]
        out.append(check(f"gpu {g['index']}", "ok" if share > 0.9 else "warn",
                         f"{g['name']}: {g['free'] / 2**30:.1f} of {g['total'] / 2**30:.1f} GiB free"
                         + ("" if share > 0.9 else "; something else holds GPU memory (see processes below, or nvidia-smi)"),
                         free=g["free"], total=g["total"]))
    return out


def available_ram() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _existing(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def capture_estimate(recipe, spec) -> tuple[Optional[int], str]:
    """(bytes the capture stage will write, how the figure was obtained)."""
    run_dir = Path(recipe.run_dir)
    n_aux = len(recipe.target.aux_layer_ids or [0, 0, 0])
    bpt = bytes_per_token(n_aux, spec.hidden_size, recipe.capture.storage_dtype)
    data = load_manifest(stage_dir(run_dir, "prepare"))
    if data and data.get("status") == "complete" and data.get("counts", {}).get("tokens") is not None:
        tokens = int(data["counts"]["tokens"])
        return tokens * bpt, f"{tokens:,} tokens ({stage_dir(run_dir, 'prepare') / 'manifest.json'}) x {bpt:,} bytes/token"
    p = recipe.prepare
    if p.max_samples:
        tokens = p.max_samples * p.max_length
        return tokens * bpt, f"at most {tokens:,} tokens (prepare.max_samples x max_length, not prepared yet) x {bpt:,} bytes/token"
    return None, f"{bpt:,} bytes/token; token count unknown until `draftsmith prepare` (set prepare.max_samples to bound it)"


def check_disk(recipe, spec) -> dict:
    run_dir = Path(recipe.run_dir)
    free = shutil.disk_usage(_existing(run_dir)).free
    if recipe.train.online:
        return check("disk", "ok", f"train.online: no capture is written (the target runs inside training); "
                     f"{free / 2**30:.1f} GiB free at {run_dir}", free=free)
    cap = load_manifest(stage_dir(run_dir, "capture"))
    if cap and cap.get("status") == "complete":
        return check("disk", "ok", f"capture is complete; {free / 2**30:.1f} GiB free at {run_dir}", free=free)
    need, how = capture_estimate(recipe, spec)
    if need is None:
        return check("disk", "info", f"{free / 2**30:.1f} GiB free at {run_dir}; capture needs {how}", free=free)
    status = "fail" if need > free else "warn" if need > 0.8 * free else "ok"
    fix = {"fail": "; free disk, move run_dir, or use capture.storage_dtype float8_e4m3 / fewer prepare.max_samples",
           "warn": "; little room is left for checkpoints"}.get(status, "")
    return check("disk", status, f"capture needs {need / 2**30:.2f} GiB ({how}); {free / 2**30:.1f} GiB free at {run_dir}{fix}",
                 free=free, need=need)


def check_memory(recipe, spec, cfg: dict, found: list[dict]) -> dict:
    """Target weights + drafter (bf16 for inference; 16 bytes/param more when training: fp32 master,
    gradient, Adam moments) against the free memory where the target loads."""
    try:
        dev = resolve_device(recipe.target.device)
    except DraftsmithError as e:
        return check("memory", "fail", str(e))
    bits = {"float32": 32, "bfloat16": 16, "float16": 16}.get(recipe.target.dtype, 16 if dev.type == "cuda" else 32)
    quantized = spec.expert_bytes_per_param < 2 or spec.dense_bytes_per_param < 2
    tspec = spec if quantized and bits == 16 else target_spec(cfg, weight_bits=bits)
    target_b = tspec.weight_bytes()
    dparams = drafter_params(spec, min(recipe.vocab.draft_vocab_size, spec.vocab_size), cfg)
    drafter_b = (dparams + spec.vocab_size * spec.hidden_size) * 2 + dparams * 16
    if dev.type == "cuda":
        use = found if recipe.target.device_map else found[dev.index or 0:(dev.index or 0) + 1]
        free, where = sum(g["free"] for g in use), f"free on {len(use)} GPU(s)"
    else:
        free, where = available_ram(), "available RAM"
    need = target_b + drafter_b
    status = "fail" if need > free else "warn" if need > 0.9 * free else "ok"
    fix = {"fail": "; use more GPUs (target.device_map: auto), a quantized checkpoint, or a larger machine",
           "warn": "; activations and the KV cache need room too"}.get(status, "")
    return check("memory", status, f"target {target_b / 2**30:.2f} GiB + drafter {drafter_b / 2**30:.2f} GiB "
                 f"(training) vs {free / 2**30:.1f} GiB {where}{fix}", need=need, free=free)


# ----------------------------------------------------------------------------- processes


def _gpu_memory_by_pid() -> dict[int, int]:
    """MiB of GPU memory per process, from nvidia-smi (empty without it)."""
    if not shutil.which("nvidia-smi"):
        return {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    mem: dict[int, int] = {}
    for line in out.splitlines():
        try:
            pid, mib = (int(x) for x in line.split(","))
            mem[pid] = mem.get(pid, 0) + mib
        except ValueError:
            continue
    return mem


def identity_matches(e: dict, pid: int) -> Optional[str]:
    """The live command line of `pid` when it is the very process the ledger event `e` recorded:
    same PID, same start time (/proc/PID/stat) and same command line. None otherwise: gone, or
    the kernel gave the PID to another process since (a reused PID starts later)."""
    cmd = process_cmdline(pid)
    if cmd is None or e.get("pid_start") is None or e.get("cmdline") is None:
        return None
    if process_start_time(pid) != e["pid_start"] or cmd != e["cmdline"]:
        return None
    return cmd


def recorded_processes(run_dir: Path) -> list[dict]:
    """Alive draftsmith processes among the PIDs this run's ledger recorded (stage_started events).

    A PID counts only while it is the process that was recorded: its start time and command line
    must match the ledger's (and the event's run directory this one), so a reused PID or another
    run's process is never listed, never signalled. Each: pid, stage (the last it started),
    cmdline, stale (that stage has ended, or was started again under another PID, since) or not."""
    events = Ledger(run_dir).read()
    last_start = {e["pid"]: i for i, e in enumerate(events) if e.get("event") == "stage_started" and isinstance(e.get("pid"), int)}
    here = str(run_dir.resolve())
    out = []
    for pid, i in last_start.items():  # one `draftsmith run` PID runs many stages: judge it by its last
        e = events[i]
        if pid == os.getpid() or pid <= 1:
            continue
        if e.get("run_dir") is not None and e["run_dir"] != here:
            continue  # a ledger copied from another run directory
        m = load_manifest(stage_dir(run_dir, e["stage"])) if stage_dir(run_dir, e["stage"]).is_dir() else None
        host = ((m or {}).get("hardware") or {}).get("host")
        if host and host != socket.gethostname():
            continue  # a PID of another machine means nothing here
        cmd = identity_matches(e, pid)
        if cmd is None:
            continue  # gone, recorded without its identity, or the PID now belongs to another process
        later = [x for x in events[i + 1:] if x.get("stage") == e["stage"]]
        stale = any(x["event"] in ("stage_finished", "stage_failed", "stage_refused", "stage_interrupted") or
                    (x["event"] == "stage_started" and x.get("pid") != pid) for x in later)
        out.append({"pid": int(pid), "stage": e["stage"], "cmdline": cmd[:200], "stale": stale,
                    "pid_start": e["pid_start"], "event": e})
    return out


def check_processes(run_dir: Path, kill_stale: bool = False) -> list[dict]:
    procs = recorded_processes(run_dir)
    if not procs:
        return [check("processes", "ok", f"no live draftsmith process recorded in {run_dir / 'ledger.jsonl'}")]
    mem = _gpu_memory_by_pid()
    out = []
    for p in procs:
        e = p.pop("event")
        gpu = f", {mem[p['pid']]} MiB of GPU memory" if p["pid"] in mem else ""
        if p["stale"] and kill_stale:
            if identity_matches(e, p["pid"]) is None:  # checked again right before the signal
                out.append(check("processes", "ok", f"pid {p['pid']} exited or changed identity; nothing signalled", **p))
                continue
            try:
                os.kill(p["pid"], signal.SIGTERM)
                out.append(check("processes", "ok", f"sent SIGTERM to stale pid {p['pid']} ({p['stage']}{gpu})", **p))
            except OSError as e:
                out.append(check("processes", "fail", f"cannot stop pid {p['pid']}: {e.strerror}", **p))
        elif p["stale"]:
            out.append(check("processes", "warn", f"pid {p['pid']} ({p['stage']}{gpu}) outlived its stage: "
                             f"`draftsmith doctor --kill-stale` stops it (or kill {p['pid']})", **p))
        else:
            out.append(check("processes", "info", f"pid {p['pid']} is running {p['stage']}{gpu}", **p))
    return out


# ----------------------------------------------------------------------------- all


def diagnose(recipe=None, kill_stale: bool = False) -> list[dict]:
    found = gpus()
    checks = check_versions() + check_gpus(found)
    if recipe is None:
        return checks
    cfg_path = Path(recipe.target.path) / "config.json"
    if cfg_path.exists():
        cfg = read_json(cfg_path)
        if not isinstance(cfg, dict):
            raise DraftsmithError(f"{cfg_path}: not a model config (a JSON {type(cfg).__name__}, not an object); "
                                  "re-download the model or fix config.json")
        spec = target_spec(cfg)
        checks += [check_disk(recipe, spec), check_memory(recipe, spec, cfg, found)]
    else:
        checks.append(check("target", "fail", f"{cfg_path}: not found{relative_hint(cfg_path)}; set target.path to a local "
                                              "Hugging Face model folder"))
    run_dir = Path(recipe.run_dir)
    if run_dir.is_dir():
        checks += check_processes(run_dir, kill_stale)
    return checks


def main(argv: list[str]) -> int:
    """`draftsmith doctor [RECIPE.yaml] [--section.key value ...] [--kill-stale] [--json]`."""
    p = argparse.ArgumentParser(prog="draftsmith doctor", description=__doc__.split("\n")[0],
                                usage="%(prog)s [RECIPE.yaml] [--section.key value ...] [--kill-stale] [--json]",
                                epilog="With a recipe (a YAML file first, or recipe keys as --section.key value) the run's disk, "
                                       "memory fit and recorded processes are checked too.")
    p.add_argument("--kill-stale", action="store_true", help="SIGTERM live draftsmith PIDs of this run whose stage has ended")
    p.add_argument("--json", action="store_true", help="print JSON")
    a, rest = p.parse_known_args(argv)
    recipe = None
    if rest:
        recipe, _ = parse_recipe(rest, prog="draftsmith doctor")
    checks = diagnose(recipe, a.kill_stale)
    if a.json:
        print(json.dumps(checks, indent=2))
    else:
        for c in checks:
            print(f"{ICON[c['status']]} {c['check']:<13} {c['detail']}")
    return 1 if any(c["status"] == "fail" for c in checks) else 0
