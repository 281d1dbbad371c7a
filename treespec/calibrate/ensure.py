"""The local calibration ``builder="auto"`` reads, measured where this machine has none.

``ensure_calibration(target, drafter, batches=...)`` is what ``treespec generate --budget auto``,
the demo, ``treespec serve --budget auto`` and the benchmarks call before planning: it reuses
the cached file when its target timings fit this machine, measures what it lacks (a new or
replaced drafter, the acceptance at T = 1, the generator's loop costs, batched passes for the
server's batch sizes) and says on ``out`` what it measures, about how long, and where it
writes the file.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def ensure_calibration(target, drafter_name: str, out=sys.stderr, batches: Sequence[int] = ()):
    """The target's calibration for ``builder="auto"``, measured now (with a progress bar) and
    cached if this machine has none for this model, dtype and linear path. A drafter the cached
    file never measured, or measured with weights other than the shipped checkpoint it loads
    now (a new head), is measured again, the target's timings kept. Parts a cached calibration
    lacks are added: the drafter's acceptance at T = 1, the generator's loop costs, batched
    passes at ``batches`` (the server's auto at B > 1). Returns its path."""
    from treespec.calibrate.drafters import calibration_prompts
    from treespec.calibrate.passes import pass_time_disagrees
    from treespec.planning.calibration import target_calibration_path

    path = target_calibration_path(target)
    held_out = calibration_prompts()   # the demo uses the first questions, these are the last
    cal, why = _cached_calibration(path, target)
    measured_now = cal is None
    if measured_now:
        how_long = (f"{len(target.passes.buckets)} graphs (one per node bucket) compile first: seconds each "
                    "from Inductor's disk cache, minutes each without it" if target.passes is not None
                    else "about a minute")
        print(f"[{why}: measuring it once, {how_long}; cached at {path}]", file=out, flush=True)
        cal = _measure_calibration(target, drafter_name, held_out, out)
        cal.save(path)
    elif why := _drafter_unmeasured(cal, target, drafter_name):
        print(f"[{why}: measuring {drafter_name} on this machine, about a minute; the target's "
              f"timings are kept; cached at {path}]", file=out, flush=True)
        cal = _measure_calibration(target, drafter_name, held_out, out, cal.without_drafter(drafter_name))
        cal.save(path)
    cal = _complete_calibration(cal, path, target, drafter_name, held_out, batches, out)
    if not measured_now and (stale := pass_time_disagrees(cal, target.model, passes=target.passes)):   # measured under another load
        print(f"[the calibration at {path} {stale}: it was probably measured while the machine "
              "was busier or quieter than now, and builder='auto' sizes trees from it. Delete the "
              "file to measure it again on a quiet machine]", file=out, flush=True)
    return path


def _cached_calibration(path, target):
    """(the cached calibration if its target timings fit this machine, else None; why not)."""
    from treespec.planning import Calibration, machine_mismatch

    if not path.exists():
        passes = ", compiled passes" if target.passes is not None else ""
        return None, f"no calibration of {target.name} ({target.speed_path.split(' (')[0]}{passes}) on this machine"
    from treespec.planning.calibration import DamagedCalibration

    try:
        cached = Calibration.load(path)
    except DamagedCalibration as e:   # truncated or hand-edited: measured again and rewritten
        return None, f"{e}; rebuilding it"
    stale = machine_mismatch(cached, target.device)
    if stale is not None:  # e.g. a home directory shared by an AVX-512 and an AVX2 machine
        return None, f"the cached calibration of {target.name} does not fit this machine ({stale})"
    if cached.timing_noise is None:  # auto's minimum gain reads the spread of the timings
        return None, f"the cached calibration of {target.name} predates timing spreads"
    return cached, ""


def _drafter_unmeasured(cal, target, drafter_name: str) -> str:
    """Why ``cal`` cannot serve ``drafter_name`` as it is now ("" if it can): never measured, or
    measured with weights other than the shipped checkpoint it loads today (a new head)."""
    from treespec.drafters import split_drafter_key
    from treespec.drafters.feature import shipped_checksum

    if drafter_name not in cal.acceptance:
        return f"the cached calibration of {target.name} has no measurement of drafter {drafter_name!r}"
    now, then = shipped_checksum(target, *split_drafter_key(drafter_name)), cal.weights.get(drafter_name)
    if now is not None and then != now:
        was = f"checkpoint {_checksum_text(then)}" if then else "weights it did not record"
        return (f"the cached calibration of {target.name} measured drafter {drafter_name!r} with {was}; "
                f"the shipped checkpoint is now {_checksum_text(now)}")
    return ""


def _checksum_text(checksum: str) -> str:
    """A weights checksum as a note shows it: 12 hex digits, and "as 8-bit blocks" for a head
    rounded to them (``+int8``)."""
    head, _, rounded = checksum.partition("+")
    return head[:12] + (f" (as {rounded.replace('int8', '8-bit blocks')})" if rounded else "")


def _measure_calibration(target, drafter_name: str, held_out, out, cal=None):
    """A new calibration (or ``cal``, the target's timings kept): the target's pass curve, two
    generic drafter curves, the drafter's pass times, the generator's loop and the drafter's
    acceptances, with a progress bar on ``out``."""
    from tqdm.auto import tqdm

    from treespec.calibrate.drafters import ACCEPTANCE_TEMPERATURES, acceptance_keys, calibrate_drafter
    from treespec.calibrate.passes import calibrate

    target_stages = 3 if cal is None else 0
    stages = target_stages + 2 + sum(len(acceptance_keys(drafter_name, t)) for t in ACCEPTANCE_TEMPERATURES)
    bar = tqdm(total=stages, desc="calibrating", unit="stage", file=out)

    def step(message: str) -> None:
        bar.set_postfix_str(message.split(":")[0])
        bar.update(1)

    try:
        if cal is None:
            ns = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
            layers = target.model.config.num_hidden_layers
            cal = calibrate(target.model, target.name, ns=ns, context=128, n_rep=5,
                            early_exit_layers=min(4, layers), progress=step, passes=target.passes)
        return calibrate_drafter(cal, drafter_name, target, held_out, progress=step)
    finally:
        bar.close()


def _complete_calibration(cal, path, target, drafter_name: str, held_out, batches, out):
    """``cal`` with what it lacked for ``drafter_name`` and ``batches`` measured and saved, saying what."""
    from treespec.calibrate.drafters import (
        ACCEPTANCE_TEMPERATURES, acceptance_keys, calibrate_acceptance, calibrate_drafter_batches, calibrate_loop,
    )
    from treespec.calibrate.passes import calibrate_batches

    missing_t = [t for t in ACCEPTANCE_TEMPERATURES
                 if any(key not in cal.acceptance for key in acceptance_keys(drafter_name, t))]
    missing_b = sorted(set(batches) - set(cal.batch_target))
    missing_d = (sorted(set(batches) - set(cal.batch_drafters.get(drafter_name, {})))
                 if drafter_name in cal.drafters else [])
    missing_loop = drafter_name in cal.drafters and drafter_name not in cal.loop
    if not (missing_t or missing_b or missing_d or missing_loop):
        return cal
    parts = [text for text, missing in (
        (f"{drafter_name} acceptance at T = {', '.join(f'{t:g}' for t in missing_t)}", missing_t),
        (f"the generator's loop costs with {drafter_name}", missing_loop),
        (f"batched passes at B = {', '.join(map(str, missing_b))}", missing_b),
        (f"batched {drafter_name} calls at B = {', '.join(map(str, missing_d))}", missing_d),
    ) if missing]
    print(f"[adding to the calibration at {path}: {'; '.join(parts)}]", file=out, flush=True)
    say = lambda m: print(f"  {m}", file=out, flush=True)  # noqa: E731
    if missing_t:
        cal = calibrate_acceptance(cal, drafter_name, drafter_name, target, held_out, missing_t)
    if missing_loop:
        cal = calibrate_loop(cal, drafter_name, drafter_name, target, held_out, progress=say)
    if missing_b:
        from treespec.runtime.batch_compiled import batch_passes

        compiled = batch_passes(target) if target.passes is not None else None   # the graphs the server runs
        cal = calibrate_batches(cal, target.model, missing_b, progress=say, passes=compiled)
    if missing_d:
        cal = calibrate_drafter_batches(cal, drafter_name, target, missing_d, progress=say)
    cal.save(path)
    return cal
