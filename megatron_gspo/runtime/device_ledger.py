"""Device-memory ledger: a CPU stand-in for what one GPU of a colocated run holds, driven by the
real calls of a real run (off unless `MEGATRON_GSPO_DEVICE_LEDGER` names a spec file).

A CPU run cannot see GPU memory: which learner parts are resident, what the learner freed but
its caching allocator still holds, what SGLang's memory saver gives back on release and maps
again on resume. The ledger keeps those numbers for one GPU of a *sized* configuration (the
spec: the memory plan's per-part bytes of a shipped GPU config, `megatron.memory.report`),
while the call sites of the run report what they do:

- the learner's parts (`learner`: weights, grads, main, moments, reference resident or not):
  a part that leaves the device goes to the learner's *cache*, not to the driver. torch's
  caching allocator (c10/cuda/CUDACachingAllocator.cpp) keeps freed blocks for reuse by the
  same process; only `torch.cuda.empty_cache()` (`empty_cache` here) returns them, and new
  allocations of the learner are served from that cache first;
- transient learner allocations (`transient`: activations and logits of a training step, the
  weight-sync bucket): allocated, then freed into the cache;
- SGLang's regions (`sglang_launch`, `sglang_release`, `sglang_resume`, `sglang_weights_sent`)
  as torch_memory_saver 0.0.9 treats them (csrc/core.cpp): a release unmaps and frees the
  region at once (the driver gets it back); a resume maps fresh memory with `cuMemCreate`,
  whose failure calls `exit(1)` in the server (csrc/utils.h) - recorded here as an
  out-of-memory problem; the content of released weights comes back only with a CPU backup
  (`--enable-weights-cpu-backup`), otherwise the served weights are garbage until a full
  sync. At launch SGLang sizes its KV cache from the driver's free memory
  (model_runner_kv_cache_mixin.py, `profile_max_num_token`): cached learner bytes count as used.

Each `moment` (start-up, resume, generation, training, weight sync, checkpoint, sync probe)
keeps its peak; `report()` lists the peaks next to the plan's figure for the moment and the
problems: a peak above the GPU, a peak more than `tolerance` away from the plan, a KV cache
smaller than planned, served weights that are lost. With `strict` the first out-of-memory
raises (the server dies on a GPU). Pure Python: no torch, no megatron.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass, field

from megatron_gspo.runtime.sglang_pools import ServerKnobs, hybrid_pools, sglang_kv_tokens

ENV = "MEGATRON_GSPO_DEVICE_LEDGER"
LEARNER_PARTS = ("weights", "grads", "main", "moments", "reference")
SGLANG_REGIONS = {"weights": "SGLang weights", "kv_cache": "SGLang KV cache",
                  "cuda_graph": "SGLang CUDA graphs"}
# learner part -> the memory plan's row name
PLAN_ROWS = {"weights": "learner weights", "grads": "gradient buffer", "main": "main weights",
             "moments": "optimizer moments", "reference": "KL reference"}


class DeviceOutOfMemory(RuntimeError):
    """A modelled allocation that would not fit on the GPU (strict ledgers)."""


class LedgerSpecError(ValueError):
    """A ledger spec file that cannot be read or is not a spec (message: one line)."""


def _spec_problem(data, fields: dict) -> str | None:
    """Why `data` (a parsed spec) is not a LedgerSpec's fields, or None."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, expected an object"
    unknown = sorted(set(data) - set(fields))
    if unknown:
        return f"unknown key {unknown[0]!r}; known keys: {', '.join(fields)}"
    missing = [k for k, f in fields.items() if f.default is dataclasses.MISSING and k not in data]
    if missing:
        return f"missing key {missing[0]!r}"
    kinds = {"name": str, "gpu_bytes": int, "sizes": dict, "plan_moments": dict,
             "plan_kv_tokens": (int, type(None)), "mem_fraction": (int, float),
             "kv_cell_bytes": int, "weights_cpu_backup": bool, "tolerance": (int, float),
             "strict": bool, "hybrid": (dict, type(None))}
    for key, value in data.items():
        ok = isinstance(value, kinds[key]) and not (isinstance(value, bool)
                                                     and kinds[key] in (int, (int, float)))
        if key in ("sizes", "plan_moments") and ok:
            ok = all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                     and v >= 0 for k, v in value.items())
        if not ok:
            want = ("a mapping of names to byte counts" if key in ("sizes", "plan_moments")
                    else getattr(kinds[key], "__name__", "a number"))
            return f"{key}: {str(value)[:60]!r} is not {want}"
    if data["gpu_bytes"] <= 0 or data.get("kv_cell_bytes", 1) <= 0:
        return "gpu_bytes and kv_cell_bytes must be positive"
    return None


@dataclass
class LedgerSpec:
    """One GPU of a sized configuration: part sizes (plan row name -> bytes), the plan's figure
    per moment, and SGLang's KV sizing inputs."""

    name: str
    gpu_bytes: int
    sizes: dict[str, int]
    plan_moments: dict[str, int]
    plan_kv_tokens: int | None = None
    mem_fraction: float = 0.0
    kv_cell_bytes: int = 1
    weights_cpu_backup: bool = False
    tolerance: float = 0.05
    strict: bool = False  # the first modelled out-of-memory raises DeviceOutOfMemory
    # a hybrid linear-attention model (`runtime.sglang_pools.hybrid_pools`): its
    # "state_bytes_per_request", "context_len" and "knobs" (ServerKnobs fields); None: dense
    hybrid: dict | None = None

    @classmethod
    def load(cls, path: str) -> LedgerSpec:
        """The spec in `path` (written by `megatron-gspo plan --ledger-spec`).

        Raises:
            LedgerSpecError: one line naming the file and what is wrong with it.
        """
        where = f"{ENV}: ledger spec {path}"
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise LedgerSpecError(f"{where}: {e.strerror or e}") from None
        except (ValueError, UnicodeDecodeError) as e:  # truncated or not JSON
            raise LedgerSpecError(f"{where}: not a spec ({str(e).splitlines()[0][:120]}); "
                                  "write one with megatron-gspo plan --ledger-spec") from None
        problem = _spec_problem(data, {f.name: f for f in dataclasses.fields(cls)})
        if problem:
            raise LedgerSpecError(f"{where}: {problem}")
        return cls(**data)

    def dump(self, path: str) -> None:
        """Write the spec to `path` in one go (a partial file never stays behind).

        Raises:
            LedgerSpecError: one line naming the path (a directory, a full disk, ...).
        """
        data = {k: v for k, v in self.__dict__.items() if k != "hybrid" or v is not None}
        text = json.dumps(data, indent=1)  # a dense model's spec: no "hybrid" key
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
        except OSError as e:
            with contextlib.suppress(OSError):
                if os.path.isfile(path):
                    os.unlink(path)
            raise LedgerSpecError(f"ledger spec {path}: cannot write it: "
                                  f"{e.strerror or e}") from None


@dataclass
class DeviceLedger:
    """The modelled GPU (see the module docstring)."""

    spec: LedgerSpec
    report_path: str | None = None  # where `write_report` puts `report()`
    learner: dict[str, bool] = field(default_factory=dict)  # part -> resident
    cached: int = 0  # learner bytes freed into its allocator cache
    transients: dict[str, int] = field(default_factory=dict)  # live transient allocations
    regions: dict[str, bool] = field(default_factory=dict)  # SGLang region -> mapped
    kv_bytes: int = 0
    kv_tokens: int | None = None
    served_weights_ok: bool = True
    current: str = "start-up"
    peaks: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    oom_moments: set[str] = field(default_factory=set)
    log: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------------ accounting
    def size(self, row: str) -> int:
        return int(self.spec.sizes.get(row, 0))

    def region_bytes(self, region: str) -> int:
        return self.kv_bytes if region == "kv_cache" else self.size(SGLANG_REGIONS[region])

    def total(self) -> int:
        """Bytes taken from the driver now (contexts, learner resident + cached + transients,
        mapped SGLang regions)."""
        learner = sum(self.size(PLAN_ROWS[p]) for p, on in self.learner.items() if on)
        sglang = sum(self.region_bytes(r) for r, on in self.regions.items() if on)
        return (self.size("CUDA contexts, NCCL") + learner + self.cached
                + sum(self.transients.values()) + sglang)

    def _touch(self, what: str) -> None:
        now = self.total()
        self.peaks[self.current] = max(self.peaks.get(self.current, 0), now)
        self.log.append(f"{self.current}: {what} -> {now / 2**30:.2f} GiB")
        if now > self.spec.gpu_bytes:
            msg = (f"{self.spec.name}: {self.current}: {what} needs {now / 2**30:.1f} GiB "
                   f"> {self.spec.gpu_bytes / 2**30:.1f} GiB per GPU")
            if self.current not in self.oom_moments:  # the first call that does not fit
                self.oom_moments.add(self.current)
                self.problems.append(msg)
            if self.spec.strict:
                raise DeviceOutOfMemory(msg)

    def _learner_alloc(self, n: int) -> None:
        self.cached -= min(self.cached, n)  # the learner's cache serves it first

    # ------------------------------------------------------------------------ events
    def moment(self, name: str) -> None:
        self.current = name
        self._touch(f"enter {name}")

    def set_learner(self, resident: dict[str, bool]) -> None:
        """The learner's parts now: a part that arrives is allocated (cache first), one that
        leaves is freed into the cache."""
        for part, on in resident.items():
            was = self.learner.get(part, False)
            if on and not was:
                self._learner_alloc(self.size(PLAN_ROWS[part]))
            elif was and not on:
                self.cached += self.size(PLAN_ROWS[part])
            self.learner[part] = on
        on = [p for p, here in resident.items() if here]
        self._touch(f"learner {','.join(on)} resident" if on else "learner offloaded")

    def empty_cache(self) -> None:
        self.cached = 0
        self._touch("empty_cache")

    @contextlib.contextmanager
    def transient(self, *rows: str):
        """Learner allocations alive inside the block (plan rows), then freed into the cache."""
        n = sum(self.size(r) for r in rows)
        key = "+".join(rows)
        self._learner_alloc(n)
        self.transients[key] = self.transients.get(key, 0) + n
        self._touch(key)
        try:
            yield
        finally:
            self.transients[key] -= n
            self.cached += n

    def sglang_launch(self) -> None:
        """Servers start: weights and CUDA graphs mapped, the KV cache sized from what the
        driver has free now."""
        free = self.spec.gpu_bytes - self.total()  # what the driver reports free now
        h = self.spec.hybrid
        if h:  # KV of the full-attention layers + the delta-net state, one memory-saver region
            pools = hybrid_pools(free, self.size("SGLang weights"), self.spec.mem_fraction,
                                 self.spec.kv_cell_bytes, int(h["state_bytes_per_request"]),
                                 int(h["context_len"]), ServerKnobs(**h.get("knobs", {})))
            self.kv_tokens, self.kv_bytes = pools.kv_tokens, pools.kv_bytes + pools.state_bytes
        else:
            self.kv_tokens = sglang_kv_tokens(free, self.size("SGLang weights"),
                                              self.spec.mem_fraction, self.spec.kv_cell_bytes)
            self.kv_bytes = self.kv_tokens * self.spec.kv_cell_bytes
        self.regions = dict.fromkeys(SGLANG_REGIONS, True)
        self.served_weights_ok = True
        want = self.spec.plan_kv_tokens
        if want and abs(self.kv_tokens - want) > self.spec.tolerance * want:
            self.problems.append(
                f"{self.spec.name}: {self.current}: SGLang sizes its KV cache to "
                f"{self.kv_tokens} tokens at launch, the plan to {want} (free memory at launch "
                f"{free / 2**30:.1f} GiB)")
        self._touch(f"servers launch ({self.kv_tokens} KV tokens)")

    def sglang_release(self, tags) -> None:
        for t in tags or SGLANG_REGIONS:
            if self.regions.get(t):
                self.regions[t] = False
                if t == "weights" and not self.spec.weights_cpu_backup:
                    self.served_weights_ok = False
        self._touch("release " + ",".join(tags or SGLANG_REGIONS))

    def sglang_resume(self, tags) -> None:
        for t in tags or SGLANG_REGIONS:
            self.regions[t] = True
        self._touch("resume " + ",".join(tags or SGLANG_REGIONS))

    def sglang_weights_sent(self, full: bool) -> None:
        """A weight update reached the servers: a full one makes them whole again."""
        if full:
            self.served_weights_ok = True

    def generating(self) -> None:
        """The servers generate now: their weights must be whole."""
        if not self.served_weights_ok:
            msg = (f"{self.spec.name}: {self.current}: the servers generate from weights lost "
                   "in a release without CPU backup and not sent again in full")
            if msg not in self.problems:
                self.problems.append(msg)

    # ------------------------------------------------------------------------ results
    def report(self) -> dict:
        """Peaks per moment beside the plan's figures, with every problem (also a plan figure
        the peak misses by more than the tolerance)."""
        problems = list(self.problems)
        rows = []
        for name, peak in self.peaks.items():
            plan = self.spec.plan_moments.get(name)
            off = None if not plan else peak / plan - 1
            rows.append({"moment": name, "peak_bytes": peak, "plan_bytes": plan,
                         "off": off})
            if off is not None and abs(off) > self.spec.tolerance:
                problems.append(f"{self.spec.name}: {name}: peak {peak / 2**30:.2f} GiB, plan "
                                f"{plan / 2**30:.2f} GiB ({100 * off:+.1f}%)")
        return {"name": self.spec.name, "gpu_bytes": self.spec.gpu_bytes, "moments": rows,
                "kv_tokens": self.kv_tokens, "plan_kv_tokens": self.spec.plan_kv_tokens,
                "problems": problems, "log": self.log}


# ---------------------------------------------------------------------------- the active ones
_ACTIVE: list[DeviceLedger] | None = None  # None: not read from the environment yet


def install(*ledgers: DeviceLedger) -> None:
    """Make `ledgers` the ones the call sites report to (none: off)."""
    global _ACTIVE
    _ACTIVE = list(ledgers)


def active() -> list[DeviceLedger]:
    """The installed ledgers; on first use, one per spec file named in
    `MEGATRON_GSPO_DEVICE_LEDGER` (separated by `os.pathsep`: one run, several GPU configs)."""
    global _ACTIVE
    if _ACTIVE is None:
        paths = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p]
        _ACTIVE = [DeviceLedger(LedgerSpec.load(p), report_path=p + ".report.json")
                   for p in paths]
    return _ACTIVE


def models_gpu() -> bool:
    """True when a ledger stands in for the GPU: code that orders memory calls only on CUDA
    runs them as on CUDA."""
    return bool(active())


def note(event: str, *args) -> None:
    """Call `event` of every active ledger (no-op without one)."""
    for led in active():
        getattr(led, event)(*args)


def transient(*rows: str):
    """`DeviceLedger.transient` of every active ledger (a no-op context without one)."""
    stack = contextlib.ExitStack()
    for led in active():
        stack.enter_context(led.transient(*rows))
    return stack


def write_report() -> None:
    """Write each active ledger's report as JSON next to its spec (`SPEC.report.json`)."""
    for led in active():
        if led.report_path:
            with open(led.report_path, "w") as f:
                json.dump(led.report(), f, indent=1)
