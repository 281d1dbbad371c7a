"""The calibration file: this machine's measured pass times, read by the cost model.

On a CPU the verification cost is far from a roofline: one token runs matrix-vector kernels,
2-3 tokens a slow small-row GEMM path (a 3-token pass can cost more than a 4-token one), then
the cost grows with FLOPs. So the calibrated model is the measurement itself: medians of
repeated passes at n = 1 … 128 tokens, interpolated piecewise-linearly in n (``Curve``) and
extrapolated with the slope of the last segment. Each point also keeps the spread of its
repeated timings (``Curve.spread``); their median, ``Calibration.timing_noise``, says how noisy
the machine was, and ``planner.auto_min_gain`` asks a tree for more predicted gain the noisier
it is.

Batch and context: the target curve is measured at batch 1 with a cached prefix of ``context``
tokens. Batched curves (``Calibration.batch_target``, measured by
``treespec.calibrate.calibrate_batches``) are read by ``CalibratedCost``, interpolated between
measured B; without them, B sequences are read as one pass of B · n tokens, which
under-predicts the batched pass (its padded attention and per-row mask work). Longer contexts
add their KV bytes at the bandwidth the n = 1 pass attained (weight bytes / t(1)).

File: ``default_calibration_path(model, dtype)`` = ``$TREESPEC_CACHE/calibration-<model>.json``,
else ``~/.cache/treespec/calibration-<model>.json`` (``-<dtype>`` before ``.json`` for weights
other than float32). Measuring is ``treespec.calibrate``; this module only reads and writes.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treespec.planning.shapes import ModelShape

__all__ = [
    "CALIBRATION_VERSION",
    "CalibratedCost",
    "Calibration",
    "Curve",
    "LoopCost",
    "PLAIN_LOOP",
    "acceptance_key",
    "default_calibration_path",
    "machine_mismatch",
    "model_calibration_path",
    "relative_spread",
]


CALIBRATION_VERSION = 2


# The fewest repeated timings of a point whose spread is recorded (a quartile of fewer says little).
MIN_SPREAD_REPS = 4


def relative_spread(samples: Sequence[float]) -> float:
    """Interquartile range of repeated timings of one pass over their median: how far a single
    pass strays on this machine (about 1.35 standard deviations for normal scatter)."""
    if len(samples) < MIN_SPREAD_REPS:
        raise ValueError(f"a spread needs at least {MIN_SPREAD_REPS} timings, got {len(samples)}")
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(samples)


@dataclass(frozen=True)
class Curve:
    """Piecewise-linear interpolation of measured median seconds against tokens per pass.

    The fit goes through every measured point, non-monotone ones included: on this CPU a
    3-token pass is reproducibly slower than a 4-token one (the GEMM kernels pick a slower path
    for 2-3 rows), so smoothing toward a monotone curve would mispredict exactly where small
    trees live.

    Attributes:
        ns:      measured token counts, strictly increasing.
        seconds: median seconds measured at each n.
        spread:  ``relative_spread`` of the repeated timings at each n, or None when not
                 recorded (files written before it, or fewer than ``MIN_SPREAD_REPS`` reps).
    """

    ns: tuple[int, ...]
    seconds: tuple[float, ...]
    spread: tuple[float, ...] | None = None

    @classmethod
    def fit(cls, ns: Sequence[int], seconds: Sequence[float], spread: Sequence[float] | None = None) -> Curve:
        if len(ns) != len(seconds) or not ns:
            raise ValueError(f"need one time per n, got {len(ns)} ns and {len(seconds)} times")
        if any(b <= a for a, b in zip(ns, ns[1:])) or ns[0] < 1:
            raise ValueError(f"ns must be positive and strictly increasing, got {list(ns)}")
        if any(not s > 0 for s in seconds):
            raise ValueError(f"measured seconds must be > 0, got {list(seconds)}")
        if spread is not None:
            if len(spread) != len(ns):
                raise ValueError(f"need one spread per n, got {len(spread)} spreads for {len(ns)} ns")
            if any(not 0 <= x < float("inf") for x in spread):
                raise ValueError(f"spreads must be finite and >= 0, got {list(spread)}")
            spread = tuple(float(x) for x in spread)
        return cls(tuple(int(n) for n in ns), tuple(float(s) for s in seconds), spread)

    @classmethod
    def from_timings(cls, ns: Sequence[int], timings: Sequence[Sequence[float]]) -> Curve:
        """The Curve of repeated timings per n: their medians, and their spreads when every n
        has at least ``MIN_SPREAD_REPS`` of them."""
        spread = None
        if all(len(t) >= MIN_SPREAD_REPS for t in timings):
            spread = [relative_spread(t) for t in timings]
        return cls.fit(ns, [statistics.median(t) for t in timings], spread)

    @property
    def noise(self) -> float | None:
        """The median of ``spread`` (None when not recorded): how far one pass typically strays."""
        return None if self.spread is None else statistics.median(self.spread)

    def __call__(self, n: float) -> float:
        """Seconds for n tokens: interpolated inside the measured range, flat below it, and
        extended above it with the last segment's slope (never decreasing)."""
        ns, ts = self.ns, self.seconds
        if n <= ns[0]:
            return ts[0]
        if n >= ns[-1]:
            slope = max(0.0, (ts[-1] - ts[-2]) / (ns[-1] - ns[-2])) if len(ns) > 1 else 0.0
            return ts[-1] + slope * (n - ns[-1])
        i = bisect.bisect_right(ns, n)
        frac = (n - ns[i - 1]) / (ns[i] - ns[i - 1])
        return ts[i - 1] + frac * (ts[i] - ts[i - 1])

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"ns": list(self.ns), "seconds": list(self.seconds)}
        if self.spread is not None:
            data["spread"] = list(self.spread)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Curve:
        return cls.fit(data["ns"], data["seconds"], data.get("spread"))


# ``Calibration.loop`` key of the generator's plain-decoding loop (a budget-1 tree: one token a
# step, no drafter); no registered drafter is named with a space.
PLAIN_LOOP = "plain decoding"


@dataclass(frozen=True)
class LoopCost:
    """Seconds a generation step spends besides the calibrated target pass and drafter calls, as
    the generator (``treespec.runtime.generator``, batch 1) pays them.

    The passes alone undercount a speculative step: measured on an AVX2 EPYC, a 2-node chain's
    step spent 1.6 ms accepting, compacting and committing and 1 ms of builder work around its
    draft calls, against a 31 ms pass, so a tree predicted to gain 14 % lost 3 %.

    Attributes:
        step: per step: acceptance, KV compaction, the drafter's commit, the loop itself.
        call: per drafter call: the builder's own work around it (ranking, growing the tree).
    """

    step: float
    call: float = 0.0

    def __post_init__(self) -> None:
        for name in ("step", "call"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"LoopCost.{name} must be finite seconds >= 0, got {value!r}")

    def seconds(self, calls: int) -> float:
        """Loop seconds of one step with ``calls`` drafter calls."""
        return self.step + self.call * calls


class DamagedCalibration(ValueError):
    """A calibration file that cannot be read (truncated, hand-edited): its message names the
    file and the command that rebuilds it."""


@dataclass(frozen=True)
class Calibration:
    """Measured pass times of one model on this machine.

    Attributes:
        model:    model name (the file is ``calibration-<model>.json``).
        shape:    the measured model's shape (bytes per weight as run: fp32 = 4).
        context:  cached prefix tokens during the measurement (P).
        target:   seconds of a target verify pass (forward over n tree tokens + softmax), batch 1.
        drafters: drafter kind -> seconds of one drafting pass over n tokens, batch 1. Besides
                  the generic "early_exit" / "eagle" passes, ``calibrate_drafter`` adds real
                  drafters under their registered names (one expand call over n nodes).
        drafter_layers: drafter kind -> layers the measured drafter ran.
        acceptance: ``acceptance_key(name, T)`` -> the registered drafter's measured positional
                  acceptance vector at temperature T (``calibrate_drafter``); the engine's
                  builder="auto" reads it with ``acceptance_for``.
        batch_target: B -> seconds of ONE batched verify pass of B requests with n nodes each
                  (``calibrate_batches``), against n; empty if not measured.
        batch_drafters: drafter name -> B -> seconds of ONE batched drafting call
                  (``BatchDrafter.expand_batch``) expanding w nodes for each of B requests,
                  against w (``treespec.calibrate.drafters.calibrate_drafter_batches``); empty if not measured.
        loop:     ``PLAIN_LOOP`` and drafter names -> the generator's ``LoopCost`` with that
                  drafter (``treespec.calibrate.drafters.calibrate_loop``); the planner reads a
                  drafter's only together with plain decoding's, at batch 1.
        weights:  drafter name -> checksum of the checkpoint it was measured with (drafters
                  loaded from a checkpoint; ``calibrate_drafter`` records their
                  ``weights_checksum``). Acceptance is a property of the weights: builder="auto"
                  does not plan a drafter loaded from other weights with it, and
                  ``treespec.calibrate.ensure.ensure_calibration`` measures a drafter again when its
                  shipped checkpoint has changed since.
        device:   machine description (CPU model, threads, torch version).
        threads:  torch intra-op threads during the measurement (run the engine with the same).
        clock:    the timer's name: "perf_counter" (wall clock) or "thread_time" (CPU time).
        created:  UTC time of the measurement, ISO 8601.
    """

    model: str
    shape: ModelShape
    context: int
    target: Curve
    drafters: Mapping[str, Curve] = field(default_factory=dict)
    drafter_layers: Mapping[str, int] = field(default_factory=dict)
    acceptance: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    batch_target: Mapping[int, Curve] = field(default_factory=dict)
    batch_drafters: Mapping[str, Mapping[int, Curve]] = field(default_factory=dict)
    loop: Mapping[str, LoopCost] = field(default_factory=dict)
    weights: Mapping[str, str] = field(default_factory=dict)
    device: str = ""
    threads: int = 0
    clock: str = "perf_counter"
    created: str = ""

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON to ``path`` (directories created); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "version": CALIBRATION_VERSION,
            "model": self.model,
            "shape": dataclasses.asdict(self.shape),
            "context": self.context,
            "target": self.target.to_json(),
            "drafters": {kind: curve.to_json() for kind, curve in self.drafters.items()},
            "drafter_layers": dict(self.drafter_layers),
            "acceptance": {name: list(a) for name, a in self.acceptance.items()},
            "batch_target": {str(b): curve.to_json() for b, curve in sorted(self.batch_target.items())},
            "batch_drafters": {name: {str(b): curve.to_json() for b, curve in sorted(by_b.items())}
                               for name, by_b in self.batch_drafters.items()},
            "loop": {name: dataclasses.asdict(cost) for name, cost in self.loop.items()},
            "weights": dict(self.weights),
            "device": self.device,
            "threads": self.threads,
            "clock": self.clock,
            "created": self.created,
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        """Read a file written by ``save``. Missing file -> FileNotFoundError saying how to make it."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no calibration at {path}; run `treespec calibrate --model <name>` "
                                    "(or `python -m treespec.cli.plan calibrate`) first")
        try:
            return cls._from_json(json.loads(path.read_text()), path)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise DamagedCalibration(f"the calibration file {path} is damaged ({type(e).__name__}: {e}); delete it "
                                     f"and rebuild it with `treespec calibrate --model <name> --weights pretrained` "
                                     f"(--budget auto measures it again by itself)") from None

    @classmethod
    def _from_json(cls, data: dict, path: Path) -> Calibration:
        if data.get("version") != CALIBRATION_VERSION:
            raise ValueError(f"{path}: calibration version {data.get('version')!r}, expected "
                             f"{CALIBRATION_VERSION}; recalibrate")
        return cls(
            model=data["model"],
            shape=ModelShape(**data["shape"]),
            context=int(data["context"]),
            target=Curve.from_json(data["target"]),
            drafters={kind: Curve.from_json(c) for kind, c in data["drafters"].items()},
            drafter_layers={kind: int(k) for kind, k in data.get("drafter_layers", {}).items()},
            acceptance={name: tuple(float(x) for x in a) for name, a in data.get("acceptance", {}).items()},
            batch_target={int(b): Curve.from_json(c) for b, c in data.get("batch_target", {}).items()},
            batch_drafters={name: {int(b): Curve.from_json(c) for b, c in by_b.items()}
                            for name, by_b in data.get("batch_drafters", {}).items()},
            loop={name: LoopCost(**cost) for name, cost in data.get("loop", {}).items()},
            weights=dict(data.get("weights", {})),
            device=data.get("device", ""),
            threads=int(data.get("threads", 0)),
            clock=data.get("clock", "perf_counter"),
            created=data.get("created", ""),
        )

    def without_drafter(self, name: str) -> Calibration:
        """This calibration less every measurement of drafter ``name`` (its pass times, layers,
        acceptance at every temperature and mode, batched calls, loop costs, weights), to be
        measured again; the target's curves and the other drafters' stay."""
        def of_name(key: str) -> bool:
            return key == name or key.startswith(f"{name}@")

        return dataclasses.replace(
            self, drafters={k: v for k, v in self.drafters.items() if k != name},
            drafter_layers={k: v for k, v in self.drafter_layers.items() if k != name},
            acceptance={k: v for k, v in self.acceptance.items() if not of_name(k)},
            batch_drafters={k: v for k, v in self.batch_drafters.items() if k != name},
            loop={k: v for k, v in self.loop.items() if k != name},
            weights={k: v for k, v in self.weights.items() if k != name})

    def acceptance_for(self, name: str | None, temperature: float = 0.0,
                       mode: str = "deterministic") -> tuple[float, ...] | None:
        """The acceptance vector of drafter ``name`` drafting in ``mode`` (a ``DraftMode``),
        measured at the temperature nearest to ``temperature``; None if ``name`` was never
        measured. Acceptance falls as T rises, so a T > 0 request planned with the T = 0 vector
        gets too big a tree: measure both. Greedy drafting is deterministic in every mode, so the
        T = 0 vector serves every mode; a stochastic mode above T = 0 needs a vector of its own
        (None without one: the greedy vector says nothing about sampled drafts)."""
        if name is None:
            return None
        measured = {}
        for key in self.acceptance:
            if key == name:
                measured[0.0] = key
            elif key.startswith(f"{name}@T"):
                t, _, key_mode = key[len(name) + 2:].partition("/")
                try:
                    t = float(t)
                except ValueError:  # another drafter whose name extends this one's
                    continue
                if (key_mode or "deterministic") == mode:
                    measured[t] = key
        if mode != "deterministic" and temperature > 0 and not any(t > 0 for t in measured):
            return None
        if not measured:
            return None
        nearest = min(measured, key=lambda t: (abs(t - temperature), t))
        return self.acceptance[measured[nearest]]

    def loop_text(self, name: str) -> str:
        """The generator's loop costs for drafter ``name`` in words (benchmark headers)."""
        plain, drafting = self.loop.get(PLAIN_LOOP), self.loop.get(name)
        if plain is None or drafting is None:
            return f"the generator's loop costs with {name} not measured (the plan counts the passes alone)"
        return (f"the generator's own work: {plain.step * 1e3:.2f} ms a step decoding plainly, "
                f"{drafting.step * 1e3:.2f} ms a step + {drafting.call * 1e3:.2f} ms a drafter call with {name}")

    def target_batch_s(self, n_tokens: float, batch: int) -> float | None:
        """Measured seconds of one batched verify pass of ``batch`` requests with ``n_tokens``
        nodes each: interpolated linearly in B between measured batch sizes (B = 1 is the
        target curve), extended past the largest with the last two's slope per request.
        None when no batch above 1 was measured and ``batch`` > 1."""
        if batch == 1:
            return self.target(n_tokens)
        return _across_batches({1: self.target, **self.batch_target}, n_tokens, batch)

    def drafter_batch_s(self, name: str, width: float, batch: int) -> float | None:
        """Measured seconds of one batched drafting call of drafter ``name`` expanding ``width``
        nodes for each of ``batch`` requests, read across B as ``target_batch_s`` does (B = 1 is
        ``drafters[name]``). None when nothing above B = 1 was measured for it."""
        if batch == 1:
            return self.drafters[name](width)
        return _across_batches({1: self.drafters[name], **self.batch_drafters.get(name, {})}, width, batch)

    @property
    def timing_noise(self) -> float | None:
        """How much a single verify pass strays on this machine: the median ``relative_spread``
        of the target curve's points (None when the file did not record spreads). A shared or
        throttled host shows 10 % or more, a quiet one a few %; ``planner.auto_min_gain``
        turns it into the gain a tree must promise before ``builder="auto"`` speculates."""
        return self.target.noise

    @property
    def bandwidth(self) -> float:
        """Bytes/s the n = 1 pass attained (weight bytes / t(1)): used for KV-read corrections."""
        return self.shape.weight_bytes / self.target(1)


def _across_batches(curves: Mapping[int, Curve], n: float, batch: int) -> float | None:
    """Seconds at ``batch`` from per-B curves (B = 1 included): linear in B between measured
    batch sizes, past the largest with the last two's slope. None if only B = 1 is known."""
    if len(curves) < 2:
        return None
    if batch in curves:
        return curves[batch](n)
    bs = sorted(curves)
    hi = next((b for b in bs if b > batch), None)
    lo, hi = (bs[-2], bs[-1]) if hi is None else (max(b for b in bs if b < batch), hi)
    t_lo, t_hi = curves[lo](n), curves[hi](n)
    return max(t_lo, t_lo + (t_hi - t_lo) * (batch - lo) / (hi - lo))


def acceptance_key(name: str, temperature: float, mode: str = "deterministic") -> str:
    """``Calibration.acceptance`` key of drafter ``name`` at ``temperature`` drafting in ``mode``:
    the bare name at T = 0 (greedy drafts are deterministic in every mode; files written before
    temperatures were measured stay valid), ``name@T<t>`` above for deterministic drafts, and
    ``name@T<t>/<mode>`` for sampled ones."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0.0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if mode not in ("deterministic", "with_replacement", "without_replacement"):
        raise ValueError(f"mode must be 'deterministic', 'with_replacement' or 'without_replacement', got {mode!r}")
    if temperature == 0.0:
        return name
    return f"{name}@T{temperature:g}" + ("" if mode == "deterministic" else f"/{mode}")


def default_calibration_path(model: str, dtype: str = "float32", packed: bool | str = False,
                             attention: str | None = None, isa: str | None = None, compiled: bool = False,
                             threads: int = 1) -> Path:
    """``$TREESPEC_CACHE/calibration-<model>.json``, else under ``~/.cache/treespec``; weights
    other than float32 get their own file (``calibration-<model>-bfloat16.json``): the CPU's
    verify curve depends on the dtype far more than on anything else. A target whose linear
    layers run on a packed kernel (``treespec.fastpath.packing.linear_kernel``) has its own curve too:
    ``...-packed.json`` for oneDNN (``packed=True`` or ``"onednn"``), ``...-panel.json`` for the
    panel GEMM on fp32 panels, ``...-blocks.json`` for it on exact integer blocks, ``...-amx.json``
    for those blocks on the AMX tile unit, ``...-x8.json`` for them times 8-bit inputs. A model on
    treespec's grouped sdpa attention (``attention``, the model's attention implementation;
    :mod:`treespec.fastpath.attention`) adds ``-grouped``: its tree passes cost less than stock
    attention's, so a curve measured with the other must not be reused; row attention (the amx
    targets') adds ``-rows``. The panel and block
    kernels on their AVX-512 code (``isa="avx512"``, :func:`treespec.fastpath.kernels.kernel_isa`)
    add ``-avx512`` after the kernel: their passes of 4 rows and more cost up to a third less
    than the AVX2 code's, whose files keep their names. A target whose passes run as compiled
    graphs (``compiled``, :func:`treespec.runtime.compiled.compile_target`) adds ``-compiled``:
    a compiled pass costs a fraction of the eager one (no Python per layer) and is a step
    function of the node count (one graph per bucket), so auto must plan with its own curve.
    A measurement on more than one intra-op thread ends in ``-<threads>threads``: a 2-thread
    pass is neither half nor all of a 1-thread one, and each thread count keeps its own file
    instead of replacing the other's."""
    if not isinstance(dtype, str):
        dtype = str(dtype).removeprefix("torch.")
    kernel_suffix = {False: "", "stock": "", True: "-packed", "onednn": "-packed", "panel": "-panel",
                     "blocks": "-blocks", "amx": "-amx", "x8": "-x8"}
    if packed not in kernel_suffix:
        raise ValueError(f"packed must be a bool or one of 'stock', 'onednn', 'panel', 'blocks', 'amx', 'x8'; "
                         f"got {packed!r}")
    from treespec.fastpath.attention import GROUPED_SDPA, ROW_ATTENTION
    from treespec.fastpath.kernels import ISAS

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    if isa is not None and isa not in ISAS:
        raise ValueError(f"isa must be None or one of {ISAS}; got {isa!r}")
    root = os.environ.get("TREESPEC_CACHE")

    suffix = (("" if dtype == "float32" else f"-{dtype}") + kernel_suffix[packed]
              + ("-avx512" if isa == "avx512" and packed in ("panel", "blocks") else "")
              + {GROUPED_SDPA: "-grouped", ROW_ATTENTION: "-rows"}.get(attention, "")
              + ("-compiled" if compiled else "")
              + (f"-{threads}threads" if threads > 1 else ""))
    return (Path(root) if root else Path.home() / ".cache" / "treespec") / f"calibration-{model}{suffix}.json"


def target_calibration_path(target: Any) -> Path:
    """``model_calibration_path`` of a :class:`treespec.Target`: its model's file, or the
    ``-compiled`` one where its passes run compiled (``target.passes``)."""
    return model_calibration_path(target.name, target.model, compiled=getattr(target, "passes", None) is not None)


def model_calibration_path(name: str, model: Any, compiled: bool = False, threads: int | None = None) -> Path:
    """``default_calibration_path`` of a loaded model: its dtype, its linear kernel and its
    attention, read from the model itself (one place, so a new path-changing switch is keyed
    once); ``compiled``: its passes run as compiled graphs; ``threads``: the intra-op threads
    it runs on (None: torch's current setting; a model on a GPU: 1)."""
    import torch

    from treespec.fastpath.packing import linear_isa, linear_kernel
    from treespec.core.masks import attn_implementation_of

    param = next(model.parameters())
    if threads is None:
        threads = torch.get_num_threads() if param.device.type == "cpu" else 1
    return default_calibration_path(name, param.dtype, linear_kernel(model), attn_implementation_of(model),
                                    linear_isa(model), compiled, threads)


@dataclass(frozen=True)
class CalibratedCost:
    """StepCost (see ``planner.StepCost``) from a Calibration.

    Attributes:
        calibration:  the measurement.
        drafter_kind: a key of ``calibration.drafters``, or "lookup" (0 s).
        scale:        multiplies every time; 1 for the calibrated model (``for_model`` sets
                      the ratio of matmul parameters to plan another model on this machine,
                      a rough approximation).
    """

    calibration: Calibration
    drafter_kind: str
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.drafter_kind != "lookup" and self.drafter_kind not in self.calibration.drafters:
            raise KeyError(f"calibration of {self.calibration.model!r} has no {self.drafter_kind!r} drafter; "
                           f"measured: {sorted(self.calibration.drafters)} (plus 'lookup', free)")
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")

    @classmethod
    def for_model(cls, calibration: Calibration, drafter_kind: str, shape: ModelShape) -> CalibratedCost:
        """Cost of ``shape`` on the calibrated machine: scaled by matmul parameters when
        ``shape`` is not the calibrated model."""
        same = shape.matmul_params == calibration.shape.matmul_params and shape.layers == calibration.shape.layers
        scale = 1.0 if same else shape.matmul_params / calibration.shape.matmul_params
        return cls(calibration, drafter_kind, scale)

    def _kv_s(self, extra_tokens: int) -> float:
        """Seconds to read the KV of ``extra_tokens`` more cached tokens than the measured pass
        read (never negative), at the bandwidth the n = 1 pass attained."""
        return max(0, extra_tokens) * self.calibration.shape.kv_bytes_per_token / self.calibration.bandwidth

    def verify_s(self, n_tokens: int, batch: int, context: int) -> float:
        cal = self.calibration
        measured = cal.target_batch_s(n_tokens, batch)
        if measured is not None:  # the batched pass itself: B rows of the calibration context
            return self.scale * (measured + self._kv_s(batch * (context - cal.context)))
        return self.scale * (cal.target(n_tokens * batch) + self._kv_s(batch * context - cal.context))

    def draft_s(self, widths: Sequence[int], batch: int, context: int) -> float:
        if not widths or self.drafter_kind == "lookup":
            return 0.0
        cal = self.calibration
        if batch > 1 and self.drafter_kind in cal.batch_drafters:   # the batched call itself
            return self.scale * sum(cal.drafter_batch_s(self.drafter_kind, w, batch) for w in widths)
        curve = cal.drafters[self.drafter_kind]
        return self.scale * sum(curve(w * batch) for w in widths)

    def loop_s(self, widths: Sequence[int], batch: int) -> float:
        """The generator's loop seconds of a step drafting ``widths`` (() for plain decoding):
        ``Calibration.loop``, at batch 1 and only when both plain decoding's and this drafter's
        were measured (one without the other would tilt the comparison); else 0. Not scaled:
        it is mostly Python, not weights."""
        plain, drafting = self.calibration.loop.get(PLAIN_LOOP), self.calibration.loop.get(self.drafter_kind)
        if batch != 1 or plain is None or drafting is None:
            return 0.0
        return drafting.seconds(len(widths)) if widths else plain.seconds(0)


BATCH_NS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)


def _device_description(device: Any = None) -> str:
    """What a measurement ran on: the GPU, or the CPU model with its relevant flags (a name like
    "AMD EPYC" covers AVX2-only and AVX-512 parts alike), plus torch and the thread count."""
    import torch

    from treespec.fastpath.packing import cpu_info

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        hardware = torch.cuda.get_device_name(dev)
    else:
        cpu = cpu_info()
        hardware = f"{cpu.model} [{' '.join(cpu.flags) or 'no AVX2'}]"
    return f"{hardware}; torch {torch.__version__}; {torch.get_num_threads()} threads"


def machine_mismatch(calibration: Calibration, device: Any = None) -> str | None:
    """Why ``calibration`` does not describe this machine (None if it does): another CPU or GPU,
    another torch, or another thread count. Its curves are timings of *that* machine, so a tree
    sized by them here can be far from the best (an AVX-512 curve on an AVX2 part, say)."""
    import torch

    def parts(desc: str) -> tuple[str, str]:
        hardware, _, rest = desc.partition("; ")
        return hardware, rest.rsplit("; ", 1)[0]  # (hardware, "torch X")

    (hw_then, torch_then), (hw_now, torch_now) = parts(calibration.device), parts(_device_description(device))
    if "[" not in hw_then:  # written before the flags were recorded: compare the model names
        hw_now = hw_now.split(" [")[0]
    if hw_then != hw_now:
        return f"it was measured on {hw_then!r}, this is {hw_now!r}"
    if torch_then != torch_now:
        return f"it was measured with {torch_then}, this is {torch_now}"
    threads = torch.get_num_threads()
    if calibration.threads and calibration.threads != threads:
        return f"it was measured with {calibration.threads} thread(s), this process runs {threads}"
    return None
