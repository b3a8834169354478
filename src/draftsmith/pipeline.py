"""Runs the stages of the stage table (stages.py) in order into a run directory: skip what is
done, resume what is half done.

Each stage is a function `run(recipe, run_dir, fp) -> manifest`. A stage's fingerprint
covers its own config section (less the keys its table entry lists as unfingerprinted:
logging cadence, side measurements; and keys added later, while at their default, so a stage
completed before a key existed stays complete), the target, and the output fingerprints of the stages it
reads (manifests.output_fingerprint); a complete manifest with the same fingerprint means the
stage is skipped, unless the table entry's `revisit` says the recipe asks for more (train under a
larger train.max_minutes: it continues from its checkpoint) or for less (it starts over). A stage whose
manifest says `running` with the same fingerprint resumes from what it listed; one with
another fingerprint starts over in a clean folder.

Under torchrun only rank 0 writes the ledger, the manifests and recipe.yaml (distributed.ranks.is_main_rank).
The distributed stages (the table's `distributed`: capture, train) run on every rank; the other
ranks read rank 0's manifests to skip or resume, and after the stage wait until rank 0's ledger says
it finished (or skipped) the stage in this launch, then read its complete manifest. The other stages
(prepare, regenerate, vocab, evaluate, export) run on rank 0 only: the other ranks skip straight to
that wait. Rank 0 failing a stage stops the other ranks with its error.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import yaml

from .distributed.ranks import is_main_rank, process_rank
from .fileio import PREVIOUS_DIR_TAG, aside_path, atomic_write_bytes, atomic_write_text, remove_temp_files, to_jsonable
from .manifests import MANIFEST, fingerprint, load_manifest, output_fingerprint
from .messages import DraftsmithError, log
from .rundir import RECIPE_FILE, Ledger, RunLock, process_cmdline, process_start_time, process_started_at, relative_hint, rerun_command, stage_dir
from .config import Recipe
from .stages import STAGE_TABLE


def sections_of(stage: str, recipe: Recipe) -> tuple[str, ...]:
    """Config sections that a stage's fingerprint covers in this recipe."""
    st = STAGE_TABLE[stage]
    inputs = st.inputs(recipe) if st.inputs else None
    return inputs[0] if inputs else st.sections


def upstream_of(stage: str, recipe: Recipe) -> tuple[str, ...]:
    """A stage's upstream stages in this recipe: a skipped stage is none's (regenerate counts only when
    enabled); a stage's `inputs` may change them (train.online: the token shards and vocab, not capture)."""
    st = STAGE_TABLE[stage]
    inputs = st.inputs(recipe) if st.inputs else None
    return tuple(u for u in (inputs[1] if inputs else st.upstream) if skip_reason(u, recipe) is None)


def skip_reason(stage: str, recipe: Recipe) -> str | None:
    """Why an optional stage does not run in this recipe (None: it runs)."""
    skipped = STAGE_TABLE[stage].skipped
    return skipped(recipe) if skipped else None


def target_fingerprint(recipe: Recipe) -> str:
    """Fingerprint of the target: its config, tokenizer and weight files (names and sizes),
    and the settings that change what it computes. Content hashes of multi-GB weights
    would cost minutes, so weights count by name and size."""
    t = recipe.target
    root = Path(t.path)
    if "<" in str(t.path):  # recipes/gpu.yaml ships a placeholder the user must replace
        raise DraftsmithError(f"target.path {t.path!r} is the recipe's placeholder: set it to your local Hugging Face model folder "
                              "in your copy of the recipe, or pass --target.path DIR")
    if not (root / "config.json").exists():
        raise DraftsmithError(f"{root / 'config.json'}: target model not found{relative_hint(root)}; set target.path to a local "
                              "Hugging Face model folder")
    parts = []
    for p in sorted(root.iterdir()):
        if p.is_file() and not p.name.startswith("."):
            if p.suffix in (".json", ".jinja", ".model", ".txt", ".py"):
                parts.append((p.name, hash_bytes(p.read_bytes())))
            else:
                parts.append((p.name, p.stat().st_size))
    return fingerprint(parts, t.aux_layer_ids, t.dtype)


def hash_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:16]


ADDED_KEYS = {"train.ttt_align_topk": 0, "train.ttt_target_temperature": 1.0, "train.keep_best": "greedy",
              "regenerate.max_turns": None, "evaluate.temperatures": None,
              "evaluate.verify_gemm": "cublas", "evaluate.hybrid_trust_ngram": 0}
"""Keys added after runs existed, each with the value those runs trained at: fingerprinted only when
set to another value, so an older complete run stays complete, and a later change of the key's
default retrains the runs it changes (not only the value of the config's default at the time)."""


HASHED_AT = {"evaluate.check_lossless": True}
"""Keys that never change a stage's output, hashed at one value (their default, so the fingerprints of
runs made while they were hashed as set stay as they were): changing one resumes a half-done stage
instead of starting it over. evaluate.check_lossless: its stop tells the user to turn it off, and the
turns measured so far must survive that (a complete output measured with it off: evaluate.check_verdict)."""


def stage_fingerprint(stage: str, recipe: Recipe, run_dir: Path, parts: dict | None = None) -> str:
    """The stage's fingerprint: a hash of its fingerprint_parts (pass them when already computed)."""
    p = parts if parts is not None else fingerprint_parts(stage, recipe, run_dir)
    return fingerprint(stage, p["config"], p["target"], p["upstream"], p["extra"])


def fingerprint_parts(stage: str, recipe: Recipe, run_dir: Path) -> dict:
    """What a stage's fingerprint hashes: {config (its sections, less what does not change its output),
    target, upstream (each upstream stage's output fingerprint), extra}. The ledger keeps them with
    each start, so a rerun can say what changed (what_changed)."""
    sections = sections_of(stage, recipe)
    up = {}
    for u in upstream_of(stage, recipe):
        m = load_manifest(stage_dir(run_dir, u))
        up[u] = output_fingerprint(m) if m and m.get("status") == "complete" else None
    cfg = {s: to_jsonable(getattr(recipe, s)) for s in sections}
    # logging and side measurements (not the stage's output), and keys added later while at the value older runs had
    for key in (*STAGE_TABLE[stage].unfingerprinted, *ADDED_KEYS):
        section, name = key.split(".")
        if isinstance(cfg.get(section), dict) and (key not in ADDED_KEYS or cfg[section].get(name) == ADDED_KEYS[key]):
            cfg[section].pop(name, None)
    for key, value in HASHED_AT.items():
        section, name = key.split(".")
        if isinstance(cfg.get(section), dict) and name in cfg[section]:
            cfg[section][name] = value
    extra = STAGE_TABLE[stage].extra(recipe) if STAGE_TABLE[stage].extra else None  # e.g. prepare's source content
    return to_jsonable({"config": cfg, "target": target_fingerprint(recipe), "upstream": up, "extra": extra})


def what_changed(stage: str, old: dict, new: dict) -> list[str]:
    """The differences between two fingerprint_parts of a stage, in words: `train.lr 0.003 -> 0.001`,
    `vocab's output`, ... (a key added later reads as the value older runs had, ADDED_KEYS)."""
    def flat(cfg: dict) -> dict:
        return {f"{s}.{k}": v for s, sec in cfg.items() for k, v in (sec.items() if isinstance(sec, dict) else [("", sec)])}

    def show(v: Any) -> str:
        text = json.dumps(v)
        return text if len(text) <= 60 else text[:57] + "..."

    a, b = flat(old.get("config") or {}), flat(new["config"])
    value = lambda cfg, k: cfg.get(k, ADDED_KEYS.get(k))  # noqa: E731 (a key left out of the parts: its older value)
    out = [f"{k} {show(value(a, k))} -> {show(value(b, k))}"
           for k in sorted(a.keys() | b.keys()) if value(a, k) != value(b, k)]
    if old.get("target") != new["target"]:
        out.append("the target (its files, aux_layer_ids or dtype)")
    ups = old.get("upstream") or {}
    out += [f"{u}'s output" for u in new["upstream"] if ups.get(u) != new["upstream"][u]]
    if old.get("extra") != new["extra"]:  # a content hash (prepare), shown by name; or (name, value) or None, shown by value
        pair = lambda e: isinstance(e, list) and len(e) == 2  # noqa: E731
        named = lambda e: e[1] if pair(e) else None  # noqa: E731
        shown = pair(old.get("extra")) or pair(new["extra"])
        out.append(STAGE_TABLE[stage].extra_name + (f" {show(named(old.get('extra')))} -> {show(named(new['extra']))}" if shown else ""))
    return out


def _changed_since(stage: str, run_dir: Path, m: dict, parts: dict) -> str:
    """Why a stage whose output is for another fingerprint starts over, from the parts its ledger
    start recorded; the generic reason for an output older than that record."""
    for e in reversed(Ledger(run_dir).read()):
        if e.get("event") == "stage_started" and e.get("stage") == stage and e.get("fingerprint") == m["fingerprint"]:
            if e.get("fingerprint_parts"):
                changed = what_changed(stage, e["fingerprint_parts"], parts)
                if changed:
                    return "changed since its output: " + "; ".join(changed)
            break
    return "inputs or config changed"


def stage_status(run_dir: Path, stage: str) -> str:
    m = load_manifest(stage_dir(run_dir, stage))
    return "pending" if m is None else m.get("status", "pending")


def write_recipe(recipe: Recipe, run_dir: Path) -> None:
    """The run's whole recipe, its paths as given: a relative one resolves against the directory a
    command runs from, so the header names the one that wrote it."""
    head = (f"# This run's recipe, written by draftsmith in {Path.cwd()}; its relative paths resolve against the\n"
            "# directory a command runs from.\n")
    atomic_write_text(run_dir / RECIPE_FILE, head + yaml.safe_dump(to_jsonable(recipe), sort_keys=False))


def previous_dir(out_dir: Path) -> Path:
    """Where a complete stage output waits while a new run of that stage replaces it."""
    return aside_path(out_dir, PREVIOUS_DIR_TAG)


def _check_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise DraftsmithError(f"{run_dir}: run_dir is a file, not a folder; set run_dir to a folder (e.g. runs/NAME)")


def _check_stage_dir(out_dir: Path) -> None:
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        kind = "a symlink" if out_dir.is_symlink() else "not a folder"
        raise DraftsmithError(f"{out_dir}: the stage folder is {kind}; move it away (a stage writes only real folders "
                              "inside its run directory) and rerun")


def run_stage(stage: str, recipe: Recipe, force: bool = False, wait_lock: bool = False) -> dict:
    """Run one stage (skipping it when complete for the same inputs). Returns its manifest.

    A complete output that this run replaces (other inputs, or --force) is set aside as
    RUN_DIR/.STAGE.previous, not deleted: it comes back if the new run fails or is interrupted,
    and goes only when the new run has succeeded. The run directory is locked (rundir.RunLock)
    from here to the end of the stage."""
    run_dir = Path(recipe.run_dir)
    _check_run_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    reason = skip_reason(stage, recipe)
    if reason:
        log(f"[{stage}] {reason}")
        return {}  # optional stage, off: no folder, no ledger entry
    lock = RunLock(run_dir, wait=wait_lock) if is_main_rank() else contextlib.nullcontext()
    with lock:
        return _run_stage_locked(stage, recipe, run_dir, force)


def _run_stage_locked(stage: str, recipe: Recipe, run_dir: Path, force: bool) -> dict:
    ledger = Ledger(run_dir)
    out_dir = stage_dir(run_dir, stage)
    _check_stage_dir(out_dir)
    prev = previous_dir(out_dir)
    if is_main_rank():
        # The run folder's own files an atomic write killed mid-way left (`.recipe.yaml.tmp-PID`, ...): only rank 0
        # writes them, under the run lock. Then a run that replaced a complete output and died before writing
        # anything: that output back.
        remove_temp_files(run_dir)
        for name in STAGE_TABLE:
            d = stage_dir(run_dir, name)
            if previous_dir(d).exists() and not d.exists():
                previous_dir(d).rename(d)
    recipe_path = run_dir / RECIPE_FILE  # written once the checks below pass: a refused command leaves it as it was
    for u in upstream_of(stage, recipe):
        if stage_status(run_dir, u) != "complete":
            if not recipe_path.exists() and is_main_rank():  # nothing to leave as it was: the hint's recipe, this run's
                write_recipe(recipe, run_dir)
            raise DraftsmithError(f"{stage_dir(run_dir, u) / 'manifest.json'}: stage {u} is not complete; run "
                                  f"{rerun_command(u, run_dir, force=False)} first (or {rerun_command('run', run_dir, force=False)})")
    parts = fingerprint_parts(stage, recipe, run_dir)  # what fp hashes, for the ledger (a rerun says what changed)
    fp = stage_fingerprint(stage, recipe, run_dir, parts)
    recipe_before = recipe_path.read_bytes() if recipe_path.exists() else None
    if is_main_rank():
        write_recipe(recipe, run_dir)
    if prev.exists() and is_main_rank() and not force:
        pm = load_manifest(prev)
        if pm is not None and pm.get("status") == "complete" and pm.get("fingerprint") == fp:
            log(f"[{stage}] the complete output set aside in {prev} is for these inputs; put back in place")
            _restore(out_dir, prev, quiet=True)
    m = load_manifest(out_dir)
    done_before = (out_dir / MANIFEST).read_bytes() if m is not None and m["status"] == "complete" else None
    verdict, why = "done", ""
    same = m is not None and m["status"] == "complete" and m["fingerprint"] == fp and not force
    if same and STAGE_TABLE[stage].revisit is not None:  # a key left out of the fingerprint that can still matter
        verdict, why = STAGE_TABLE[stage].revisit(m, recipe)
    if same and verdict == "done":
        log(f"[{stage}] complete for these inputs; skipped")
        ledger.append("stage_skipped", stage=stage, fingerprint=fp)
        return m
    if not is_main_rank() and not STAGE_TABLE[stage].distributed:  # rank 0 alone runs it (every rank writing its files collides)
        log(f"[{stage}] runs on rank 0 only; rank {process_rank()} waits for its complete manifest")
        return wait_for_rank0(run_dir, stage, fp)
    if verdict == "continue":
        log(f"[{stage}] {why}")
    if m is not None and (force or m["fingerprint"] != fp or verdict == "restart") and is_main_rank():
        reason = "--force" if force else why or _changed_since(stage, run_dir, m, parts)
        log(f"[{stage}] {reason}; starting the stage over")
        if m["status"] == "complete" and not prev.exists():
            out_dir.rename(prev)  # kept until the new run succeeds
        else:
            shutil.rmtree(out_dir)  # half-done output of other inputs (a complete one, if any, is in prev)
    resumed = (m is not None and m.get("status") == "running" and m["fingerprint"] == fp and not force) or verdict == "continue"
    if not STAGE_TABLE[stage].distributed and out_dir.is_dir():
        # Files an atomic write killed mid-way left (`.NAME.tmp-PID`): this process alone writes here (rank 0 runs
        # the stage, under the run lock). The distributed stages (capture, train) clear theirs where every rank
        # is past its writes.
        remove_temp_files(out_dir, recursive=True)
    pid = os.getpid()
    ledger.append("stage_started", stage=stage, fingerprint=fp, fingerprint_parts=parts, resumed=resumed, pid=pid,
                  pid_start=process_start_time(pid), cmdline=process_cmdline(pid), run_dir=str(run_dir.resolve()))
    t0 = time.time()
    try:
        manifest = STAGE_TABLE[stage].run(recipe, run_dir, fp)
    except BaseException as e:
        # Refused: bad input the stage found before writing anything, with a complete output set aside. That
        # output comes back unchanged, so the stage stays complete (status: done) and recipe.yaml stays its own.
        refused = isinstance(e, DraftsmithError) and _untouched(out_dir, prev, done_before)
        if is_main_rank() and prev.exists() and not _running_for(stage, out_dir, fp):  # nothing to resume: the old output back
            _restore(out_dir, prev)
        if isinstance(e, KeyboardInterrupt):
            ledger.append("stage_interrupted", stage=stage, seconds=round(time.time() - t0, 3))
        elif refused:
            ledger.append("stage_refused", stage=stage, error=str(e), seconds=round(time.time() - t0, 3))
            if is_main_rank() and recipe_before is not None:
                atomic_write_bytes(recipe_path, recipe_before)
        elif isinstance(e, DraftsmithError):
            ledger.append("stage_failed", stage=stage, error=str(e), seconds=round(time.time() - t0, 3))
        else:
            ledger.append("stage_failed", stage=stage, error=f"{type(e).__name__}: {e}",
                          traceback=traceback.format_exc(limit=5), seconds=round(time.time() - t0, 3))
        raise
    if is_main_rank() and prev.exists():
        shutil.rmtree(prev, ignore_errors=True)
    ledger.append("stage_finished", stage=stage, fingerprint=fp, seconds=round(time.time() - t0, 3),
                  counts=manifest.get("counts", {}), metrics=manifest.get("metrics", {}))
    if not is_main_rank():
        return wait_for_rank0(run_dir, stage, fp)
    return manifest


def _untouched(out_dir: Path, prev: Path, done_before: bytes | None) -> bool:
    """Whether a run that stopped wrote nothing over a stage that was complete (its manifest's bytes
    `done_before`): the output set aside and the new folder absent or still empty (capture clears it
    before its disk check), or, continuing in place (a revisit), the complete manifest as it was.
    Such a stop is a refusal: the stage stays done."""
    if done_before is None:
        return False
    if prev.exists():
        return not out_dir.exists() or not any(out_dir.iterdir())
    return (out_dir / MANIFEST).is_file() and (out_dir / MANIFEST).read_bytes() == done_before


def _running_for(stage: str, out_dir: Path, fp: str) -> bool:
    """True when out_dir holds a half-done run for `fp` that a rerun can resume (worth keeping): shards
    it listed, or the stage's partial output (Stage.partial: evaluate's measured turns)."""
    try:
        m = load_manifest(out_dir)
    except DraftsmithError:
        return False
    partial = STAGE_TABLE[stage].partial
    return (m is not None and m.get("status") == "running" and m.get("fingerprint") == fp
            and (bool(m.get("shards")) or (partial is not None and _nonempty(out_dir / partial))))


def _nonempty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _restore(out_dir: Path, prev: Path, quiet: bool = False) -> None:
    """Put the complete output set aside back in place of a failed (or other inputs') run's."""
    if not prev.exists():
        return
    shutil.rmtree(out_dir, ignore_errors=True)
    prev.rename(out_dir)
    if not quiet:
        log(f"[pipeline] the new run did not finish; the previous complete output is back in {out_dir}")


RANK0_WAIT_S = 3600.0
"""How long a rank other than 0 waits for rank 0 to finish a stage while rank 0 writes nothing in the
stage's folder or the ledger (DRAFTSMITH_RANK0_WAIT_S overrides it). torchrun stops every rank
when one fails, so this only bounds a rank 0 that hangs; a long stage that rank 0 runs alone
(regenerate, evaluate) keeps the other ranks waiting as long as it writes its shards or progress."""


LAUNCHED_AT = process_started_at()
"""When this process started: rank 0's ledger events at or after it belong to this launch (torchrun
starts every rank before any of them can finish a stage)."""

RANK0_DONE, RANK0_STOPPED = ("stage_finished", "stage_skipped"), ("stage_failed", "stage_refused", "stage_interrupted")


def _last_write(*paths: Path) -> float:
    """The latest modification time among `paths` and the files in the folders among them (0 when none exists)."""
    times = []
    for path in paths:
        try:
            times.append(path.stat().st_mtime)
            if path.is_dir():
                with os.scandir(path) as it:
                    times += [e.stat(follow_symlinks=False).st_mtime for e in it]
        except OSError:  # missing, or an entry replaced while listing: no progress seen there this time
            pass
    return max(times, default=0.0)


def _rank0_event(ledger: Ledger, stage: str) -> Optional[dict]:
    """Rank 0's last ledger event of this launch that ends `stage` (finished, skipped, failed, refused, interrupted)."""
    for e in reversed(ledger.read()):
        if e.get("stage") == stage and e.get("event") in RANK0_DONE + RANK0_STOPPED and e.get("time", 0) >= LAUNCHED_AT:
            return e
    return None


def wait_for_rank0(run_dir: Path, stage: str, fp: str, poll_s: float = 0.5) -> dict:
    """On a rank other than 0: rank 0's manifest of `stage`, once rank 0's ledger says that it finished
    or skipped the stage in this launch. Rank 0 alone writes manifests, so the next stage's upstream
    check must not run before it; and a complete manifest of an earlier launch that rank 0 is about to
    replace (--force, other inputs) is not the answer. Rank 0 failing the stage stops this rank at once
    with its error. The limit counts from rank 0's last write in the stage's folder or the ledger (a
    stage it runs alone can take hours)."""
    out_dir, ledger = stage_dir(run_dir, stage), Ledger(run_dir)
    limit = float(os.environ.get("DRAFTSMITH_RANK0_WAIT_S", RANK0_WAIT_S))
    seen, deadline = _last_write(out_dir, ledger.path), time.monotonic() + limit
    while True:
        e = _rank0_event(ledger, stage)
        if e is not None and e["event"] in RANK0_STOPPED:
            why = e.get("error") or "interrupted"
            raise DraftsmithError(f"{ledger.path}: rank 0's stage {stage} {e['event'].removeprefix('stage_')} ({why}); "
                                  f"rank {process_rank()} stops too. Fix rank 0's error, then rerun the command")
        if e is not None:
            m = load_manifest(out_dir)
            if m is not None and m.get("status") == "complete" and m.get("fingerprint") == fp:
                return m
            got = "no complete manifest" if m is None or m.get("status") != "complete" else f"fingerprint {m.get('fingerprint')}"
            raise DraftsmithError(f"{out_dir / 'manifest.json'}: rank 0 {e['event'].removeprefix('stage_')} stage {stage} with "
                                  f"{got}, but rank {process_rank()} computed fingerprint {fp}: the ranks see different "
                                  "inputs (recipe, files or package versions); give every rank the same, then rerun")
        now, last = time.monotonic(), _last_write(out_dir, ledger.path)
        if last != seen:  # rank 0 is at work
            seen, deadline = last, now + limit
        if now >= deadline:
            raise DraftsmithError(f"{out_dir / 'manifest.json'}: rank {process_rank()} waits for rank 0 to finish stage "
                                  f"{stage}, but rank 0 wrote nothing in {out_dir} or the ledger for {limit:g} s; check "
                                  "rank 0's log, then rerun (set DRAFTSMITH_RANK0_WAIT_S to wait longer)")
        time.sleep(poll_s)


def run_all(recipe: Recipe, force: bool = False, wait_lock: bool = False) -> dict[str, dict]:
    """Every stage of the table in order (`draftsmith run`); each skipped when complete. Returns
    the manifests by stage. The run directory stays locked from the first stage to the last."""
    run_dir = Path(recipe.run_dir)
    _check_run_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with (RunLock(run_dir, wait=wait_lock) if is_main_rank() else contextlib.nullcontext()):
        return {stage: run_stage(stage, recipe, force=force) for stage in STAGE_TABLE}
