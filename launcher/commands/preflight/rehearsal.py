"""Pre-flight v3, dress rehearsal: N steps of the full config, and the golden steps a real run compares with.

N steps of the full config (--steps, default `rehearsal_steps`), saves and evaluations at the run's
cadence (at least one of each that the run has); golden steps recorded in RUN_DIR/preflight/golden.json
(components/observe/golden.py); passes only if the median MFU against the profile's peak reaches
the run's resolved `mfu_threshold` (launcher/settings.py).
"""
from __future__ import annotations

import statistics

from zerotrain import durable
from zerotrain.launcher.commands.preflight.measure import SIGTERM_GRACE_S, device_description, rate, rehearsal_steps
from zerotrain.launcher.components.observe.golden import make_golden


class Rehearsal:
    """The v3 checks: the rehearsal, then its utilisation."""
    name, title = "v3", "dress rehearsal"

    def __init__(self, pf):  # pf: the harness's Preflight (harness.py, which imports this module)
        self.pf = pf
        self.records3: list[dict] = []  # the rehearsal's step records

    def run(self) -> bool:
        self.pf.start_stage(self.name)
        self.pf.ensure_backend()
        cfg, n = self.pf.cfg, self.pf.opts.steps or rehearsal_steps(self.pf.cfg.schedule.max_steps)
        changes = dict(max_steps=n, save_every_hours=None,
                       save_every_steps=(cfg.checkpoints.save_every_steps
                                         if 0 < cfg.checkpoints.save_every_steps <= n else 0))
        if cfg.eval.eval_every_steps:  # the run evaluates: so does its rehearsal, at least once
            changes["eval_every_steps"] = min(cfg.eval.eval_every_steps, n)
        self.pf.check("rehearsal", lambda: self.c_rehearsal(self.pf.scratch_cfg("v3", **changes), n),
                      "the rehearsal did not finish: see the log")
        if not self.pf.passed("rehearsal"):
            self.pf.skip(["utilisation"], "needs the rehearsal")
            return self.pf.end_stage()
        self.pf.check("utilisation", self.c_mfu, "below the profile's MFU threshold: run v2 (micro-batch, data), check"
                                                 " activation checkpointing, --compile, the interconnect, and that"
                                                 " nothing else runs on the devices")
        return self.pf.end_stage({"golden": str(self.pf.root / "golden.json")})

    def c_rehearsal(self, cfg, n):
        trainer = None
        self.pf.fresh_peaks()  # earlier stages' objects are gone (the harness keeps none): not the run's memory
        try:
            trainer = self.pf.build(self.pf.plan(cfg))
            result = trainer.train()
        finally:
            self.pf.release(trainer)
            self.pf.drop_checkpoints("v3")
        records, events = self.pf.records("v3")
        self.records3 = records
        if result.exit_code != 0 or result.step != n:
            return False, f"it ended {result.stop} at step {result.step}: {result.message}", {}
        path = self.pf.root / "golden.json"

        def write_golden():
            golden = make_golden(records, self.pf.cfg, self.pf.world, self.pf.profile_name, device_description(), n)
            durable.write_json(path, golden, default=str)
            return golden["steps"]

        points = self.pf.from_main(write_golden)
        saves = sum(e.get("save_blocked_s", 0.0) for e in events if e.get("event") == "stop")
        figures = ", ".join(f"{p['step']}: {rate(p['tokens_per_s'])} tok/s"
                            + (f" {p[p['memory_key']]:.2f} GiB" if p.get("memory_key") else "") for p in points)
        late = f" (more than the launcher's {SIGTERM_GRACE_S} s SIGTERM grace)" if saves > SIGTERM_GRACE_S else ""
        return True, (f"{n} steps, loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}; golden steps {figures}"
                      f" -> {path}; saves blocked training {saves:.1f} s{late}"), \
            {"steps": n, "golden_steps": points, "save_blocked_s": saves}

    def c_mfu(self):
        peak = self.pf.settings.peak_flops_per_device
        if not peak:
            return False, (f"profile {self.pf.profile_name} has no zerotrain.peak_flops_per_device: MFU cannot be"
                           " judged"), {}
        mfus = [r["mfu"] for r in (self.records3[1:] or self.records3) if r.get("mfu") is not None]
        if not mfus:
            return False, "the rehearsal's records have no MFU", {}
        threshold, source = self.pf.settings.mfu_threshold, self.pf.settings.sources["mfu_threshold"]
        mfu = statistics.median(mfus)
        return mfu >= threshold, (f"median MFU {mfu:.3f} of {peak / 1e12:.4g} TFLOP/s per device; threshold"
                                  f" {threshold:.3f} ({source})"), \
            {"mfu": mfu, "threshold": threshold, "threshold_source": source, "peak_flops_per_device": peak,
             "seconds": 0.0}
